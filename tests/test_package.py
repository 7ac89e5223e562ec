import subprocess
import sys


def test_import_rollplex_does_not_import_torch():
    code = "import sys, rollplex, rollplex.graph, rollplex.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
