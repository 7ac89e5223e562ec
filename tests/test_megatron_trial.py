"""bench/megatron_trial.py on the CPU: without a GPU it stops in one line; its pure parts against rollplex's layouts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollplex.models.config import load_model_config
from rollplex.parallel.layout import gate_up_rows, qkv_rows, row_parallel_slab

ROOT = Path(__file__).resolve().parents[1]


def load_trial():
    spec = importlib.util.spec_from_file_location("megatron_trial", ROOT / "bench/megatron_trial.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while being built
    spec.loader.exec_module(module)
    return module


trial = load_trial()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a machine without a GPU")
def test_without_a_gpu_the_trial_exits_non_zero_with_one_stderr_line_and_writes_nothing(tmp_path):
    out = tmp_path / "results" / "trial.json"
    command = [sys.executable, str(ROOT / "bench/megatron_trial.py"), "--model", "3b", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    assert proc.stderr.splitlines() == [trial.NEEDS]
    assert proc.stdout == "" and not any(tmp_path.iterdir())


def test_a_missing_megatron_core_is_one_line_even_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "megatron", None)  # `import megatron...` fails as if it were not installed
    line = trial.missing_requirement()
    assert line.startswith("megatron_trial: cannot import megatron-core") and "\n" not in line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trial.missing_requirement() == trial.NEEDS


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_slab_of_megatrons_row_parallel_shard_is_rollplexs_stored_slab(tp):
    full = torch.randn(24, 40)  # a row-parallel [O, I] weight
    for rank in range(tp):
        local = full.split(40 // tp, dim=1)[rank]  # RowParallelLinear's shard: its rank's part of dim 1
        slab = trial.slab_of(local)
        assert torch.equal(slab, row_parallel_slab(full, tp, rank)) and slab.shape == (40 // tp, 24)
        assert slab.is_contiguous() and slab.data_ptr() != full.data_ptr()


@pytest.mark.parametrize("name", ["tiny", "qwen2_5_vl_3b", "qwen2_5_vl_7b"])
def test_decoder_ops_split_into_rollplexs_training_shards(name):
    t = load_model_config(name).text
    ops = {op.name: op for op in trial.decoder_ops(t)}
    assert [op.column for op in ops.values()] == [True, False, True, False] and ops["qkv"].bias
    assert ops["o_proj"].in_features == t.num_attention_heads * t.head_dim == ops["qkv"].in_features
    assert (ops["down_proj"].in_features, ops["down_proj"].out_features) == (t.intermediate_size, t.hidden_size)
    megatron_order = qkv_rows(t, 1, 0)  # the fused QKV interleaved per query group over all groups
    assert len(megatron_order) == ops["qkv"].out_features
    for tp in [d for d in range(1, t.num_key_value_heads + 1) if t.num_key_value_heads % d == 0]:
        rows = ops["qkv"].out_features // tp
        for rank in range(tp):  # ColumnParallelLinear's even split of megatron's QKV is rollplex's shard: copied as is
            assert torch.equal(megatron_order[rank * rows : (rank + 1) * rows], qkv_rows(t, tp, rank))
            assert len(gate_up_rows(t, tp, rank)) == ops["gate_up"].out_features // tp


def test_on_cpu_processes_over_gloo_megatrons_layers_agree_with_ours_and_bind_to_a_buffer(tmp_path):
    """Runs where megatron-core is importable (not in CI: the suite must not depend on it)."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "trial.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29547",
               str(ROOT / "bench/megatron_trial.py"), "--device", "cpu", "--model", "tiny", "--tokens", "32",
               "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["world_size"] == 2
    assert all(op["agree"] for op in result["ops"].values())
    assert all(result["binding"][q]["answer"] for q in ("i_column_view_parameter", "ii_row_view_data"))
