"""Every mistake a user can make in a spec ends in one line naming the key (and line), exit code 2."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollplex.cli import main

ROOT = Path(__file__).resolve().parents[2]

BASE = """\
model: tiny
cluster: {nodes: 1, gpus_per_node: 1, hbm_gib: 16, host_gib: 8}
parallel: {train_tp: 1, rollout_tp: 1}
workload: {prompts_per_step: 2, group_size: 4, prompt_tokens: 96, response_tokens: 16, visual_tokens: 8}
"""

GRAPH_HEAD = BASE + "graph:\n  nodes:\n"
DECODE = "    - {id: rollout, kind: decode, role: rollout, inputs: [prompts], outputs: [responses]}\n"


def run_compile(tmp_path, text, capsys, *extra):
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    code = main(["compile", str(path), "--dry-run", *extra])
    err = capsys.readouterr().err.strip()
    return code, err


CASES = {
    "yaml syntax": (BASE + "memory: {recompute: full\n", ["YAML syntax error", "spec.yaml:"]),
    "unknown key": (
        BASE.replace("train_tp: 1", "train_tpp: 1"),
        ["parallel.train_tpp", "unknown key", "train_tp", ":3:"],
    ),
    "wrong type": (BASE.replace("group_size: 4", "group_size: many"), ["workload.group_size", "many", ":4:"]),
    "wrong value": (BASE + "schedule: fast\n", ["schedule", "'serial' or 'rollplex'", ":5:"]),
    "missing section": (
        BASE.replace("cluster: {nodes: 1, gpus_per_node: 1, hbm_gib: 16, host_gib: 8}\n", ""),
        ["cluster", "missing"],
    ),
    "unknown model": (BASE.replace("model: tiny", "model: qwen9"), ["model", "qwen9", "qwen2_5_vl_7b", ":1:"]),
    "input nobody produces": (
        GRAPH_HEAD
        + DECODE
        + "    - {id: score, kind: forward, role: actor, inputs: [prompts, answers], outputs: [lp]}\n",
        ["graph.nodes.1.inputs", "'answers'", "no node produces", ":8:"],
    ),
    "cycle": (
        GRAPH_HEAD
        + DECODE
        + "    - {id: a, kind: forward, role: actor, inputs: [responses, y], outputs: [x]}\n"
        + "    - {id: b, kind: forward, role: actor, inputs: [x], outputs: [y]}\n",
        ["cycle", "a -> b -> a"],
    ),
    "phase-1 node reads a response": (
        GRAPH_HEAD
        + DECODE
        + "    - {id: again, kind: decode, role: rollout, inputs: [prompts, responses], outputs: [more]}\n",
        ["graph.nodes.1.inputs", "decode node 'again'", "'responses'", "Phase 1", ":8:"],
    ),
    "tp does not divide heads": (
        BASE.replace("model: tiny", "model: qwen2_5_vl_7b")
        .replace("gpus_per_node: 1", "gpus_per_node: 8")
        .replace("train_tp: 1", "train_tp: 8")
        .replace("prompts_per_step: 2", "prompts_per_step: 8"),
        ["parallel.train_tp", "28 attention heads", "use one of", ":3:"],
    ),
    "replayed lengths without a preset": (
        BASE.replace("visual_tokens: 8}", "visual_tokens: 8, dataset: my.jsonl, replay_lengths: true}"),
        ["workload", "replay_lengths needs a synthetic:<preset> dataset", "my.jsonl"],
    ),
    "more layers kept than the model has": (
        BASE + "memory: {layers_kept: 99}\n",
        ["memory.layers_kept", "99 is more than tiny's 2 decoder layers", "use at most 2"],
    ),
    "train tp not a multiple of rollout tp": (
        BASE.replace("gpus_per_node: 1", "gpus_per_node: 4")
        .replace("train_tp: 1, rollout_tp: 1", "train_tp: 2, rollout_tp: 4")
        .replace("prompts_per_step: 2", "prompts_per_step: 4"),
        ["parallel.rollout_tp", "rollout_tp 4 does not divide train_tp 2", ":3:"],
    ),
    "decode kernels not known": (
        BASE + "run: {decode_kernels: fastest}\n",
        ["run.decode_kernels", "cublas", "rollplex_pdl"],
    ),
    "the actor's prefill for a rollout in another process": (
        BASE + "run: {rollout_prefill: actor_prefix}\nsharing: {policy: mps}\n",
        ["run.rollout_prefill actor_prefix needs a sharing.policy other than mps"],
    ),
    "the actor's prefill with several mini-batches": (
        BASE + "run: {rollout_prefill: actor_prefix}\nalgorithm: {minibatches_per_step: 2}\n",
        ["run.rollout_prefill actor_prefix needs algorithm.minibatches_per_step 1"],
    ),
    "the actor's prefill on two GPUs": (
        BASE.replace("gpus_per_node: 1", "gpus_per_node: 2") + "run: {rollout_prefill: actor_prefix}\n",
        ["run.rollout_prefill actor_prefix needs one GPU"],
    ),
    "more memory than the gpu has": (
        BASE.replace("hbm_gib: 16, host_gib: 8}", "hbm_gib: 139, host_gib: 8, gpu: H800}"),
        ["cluster.hbm_gib", "hbm_gib 139 is more than an H800 has (79.6 GiB)", "set cluster.gpu", ":2:"],
    ),
    "more memory than the default gpu has": (
        BASE.replace("hbm_gib: 16", "hbm_gib: 192"),
        ["cluster.hbm_gib", "more than an H200 (the default gpu) has (140.4 GiB)"],
    ),
    "reward with a role": (
        GRAPH_HEAD + DECODE + "    - {id: r, kind: reward, role: actor, inputs: [responses], outputs: [rw]}\n",
        ["graph.nodes.1", "reward node has no role"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_spec_gives_one_line_naming_the_key_and_exit_2(tmp_path, capsys, name):
    text, expected = CASES[name]
    code, err = run_compile(tmp_path, text, capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def test_a_missing_spec_file_is_a_one_line_error(tmp_path, capsys):
    code = main(["compile", str(tmp_path / "nope.yaml"), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot read spec" in err


def test_a_plan_that_cannot_fit_exits_1_naming_phase_peak_capacity_and_remedies(tmp_path, capsys):
    text = BASE.replace("model: tiny", "model: qwen2_5_vl_7b").replace("hbm_gib: 16", "hbm_gib: 60")
    text = text.replace("host_gib: 8", "host_gib: 400").replace("response_tokens: 16", "response_tokens: 4096")
    code, err = run_compile(tmp_path, text + "memory: {recompute: none}\n", capsys)
    assert code == 1
    assert "Phase 2" in err and "> 60.0 GiB" in err and "activations" in err and "memory.recompute: full" in err
    code, err = run_compile(tmp_path, text, capsys)  # auto: recomputed already, and still over
    assert code == 1 and "Phase 2" in err and "memory.recompute" not in err


def test_the_console_script_prints_no_traceback(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(BASE + "bogus: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rollplex.cli", "compile", str(path), "--dry-run"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "bogus: unknown key" in proc.stderr


def test_a_spec_written_in_json_with_tab_indents_compiles_and_its_errors_name_the_line(tmp_path, capsys):
    import json

    import yaml

    from rollplex.graph.load import load_spec

    tiny = yaml.safe_load((ROOT / "specs/tiny_cpu.yaml").read_text())
    (tmp_path / "tiny.json").write_text(json.dumps(tiny, indent="\t"))
    assert load_spec(tmp_path / "tiny.json").spec == load_spec(ROOT / "specs/tiny_cpu.yaml").spec
    (tmp_path / "bad.json").write_text(json.dumps({**tiny, "run": {**tiny["run"], "steps": 0}}, indent="\t"))
    assert main(["compile", str(tmp_path / "bad.json"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    line = (
        json.dumps({**tiny, "run": {**tiny["run"], "steps": 0}}, indent="\t").splitlines().index('\t\t"steps": 0,') + 1
    )
    assert len(err.splitlines()) == 1 and f"bad.json:{line}: run.steps" in err
