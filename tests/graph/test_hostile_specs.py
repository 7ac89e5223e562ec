"""A corpus of malformed and hostile specs against `rollplex compile`: each gets, within a second, its exit code
(2: a bad spec, 1: a plan that cannot fit) and one line of at most ~300 characters that names the file and,
where one applies, the key and its YAML line; never a traceback, and nothing in a spec executes."""

import json
import time

import pytest

from rollplex.cli import main
from rollplex.errors import MAX_LINE

BASE = """model: tiny
cluster: {hbm_gib: 16, host_gib: 8}
workload: {prompts_per_step: 2, group_size: 4, prompt_tokens: 384, response_tokens: 16, visual_tokens: 8}
"""
GRAPH = """graph:
  nodes:
    - {id: rollout, kind: decode, role: rollout, inputs: [prompts], outputs: [responses]}
    - {id: reward, kind: reward, inputs: [prompts, responses], outputs: [rewards]}
"""
ACTOR = "    - {id: actor_score, kind: forward, role: actor, inputs: [prompts, responses], outputs: [lp]}\n"
REFERENCE = "    - {id: ref_score, kind: forward, role: reference, inputs: [prompts, responses], outputs: [ref_lp]}\n"
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)
CONFIG = {  # the tiny model's config.json shape, for the model-file cases
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_scaling": {"mrope_section": [2, 3, 3]},
    "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64},
}


def with_config(**changes) -> str:
    return json.dumps({**CONFIG, **changes})


CASES = [  # (name, file content, exit code, what the line says; `{dir}` is the case's directory)
    ("binary", bytes(range(256)) * 8, 2, "not a text file"),
    ("utf16 with a BOM", BASE.encode("utf-16"), 2, "UTF-16"),
    ("utf16 without a BOM", BASE.encode("utf-16-le"), 2, "UTF-16"),
    ("latin-1", BASE.replace("tiny", "tiny # caf\u00e9").encode("latin-1"), 2, "not UTF-8"),
    ("empty", "", 2, "a YAML mapping of sections"),
    ("a list", "- model\n- cluster\n", 2, "a YAML mapping of sections"),
    ("a scalar", "hello\n", 2, "a YAML mapping of sections"),
    ("unclosed brace", BASE.replace("host_gib: 8}", "host_gib: 8"), 2, "YAML syntax error"),
    ("tab indentation", "model: tiny\ncluster:\n\thbm_gib: 16\n", 2, "YAML syntax error"),
    ("5000-deep list", "model: " + "[" * 5000 + "]" * 5000 + "\n", 2, "nested more than"),
    ("alias bomb under a key", BASE + "run: {steps: 1}\nsharing:\n  " + BOMB.replace("\n", "\n  "), 2, "alias"),
    ("alias bomb at the top", BOMB + BASE, 2, "alias"),
    ("a small alias", BASE + "run: &r {steps: 1}\nschedule: *r\n", 2, "alias"),
    ("merge key", "base: &b {hbm_gib: 16, host_gib: 8}\ncluster: {<<: *b}\n" + BASE, 2, "alias"),
    ("python tag", BASE + "run: !!python/object/apply:os.system ['touch {dir}/pwned']\n", 2, "YAML syntax error"),
    ("duplicate section", BASE + "cluster: {hbm_gib: 80, host_gib: 8}\n", 2, "duplicate key (lines 2 and 4)"),
    (
        "a group of one under GRPO",
        BASE.replace("group_size: 4", "group_size: 1"),
        2,
        "3: workload.group_size: workload.group_size 1 under GRPO: each advantage",
    ),
    (
        "duplicate key",
        BASE.replace("host_gib: 8", "host_gib: 8, hbm_gib: 32"),
        2,
        "cluster.hbm_gib: duplicate key (twice on line 2)",
    ),
    ("over a MiB", BASE + "# " + "x" * (1 << 20) + "\n", 2, "a spec is at most"),
    ("300k values", BASE + "run: {seed: 0}\nx: [" + "1, " * 300_000 + "1]\n", 2, "more than 10,000 values"),
    ("hbm .inf", BASE.replace("hbm_gib: 16", "hbm_gib: .inf"), 2, "cluster.hbm_gib: hbm_gib must be a finite"),
    ("hbm .nan", BASE.replace("hbm_gib: 16", "hbm_gib: .nan"), 2, "must be a finite number"),
    ("hbm negative", BASE.replace("hbm_gib: 16", "hbm_gib: -1"), 2, "cluster.hbm_gib: Input should be greater"),
    ("hbm 1e30", BASE.replace("hbm_gib: 16", "hbm_gib: 1.0e+30"), 2, "beyond any real setting"),
    ("hbm 1e30 as text", BASE.replace("hbm_gib: 16", "hbm_gib: 1e30"), 2, "less than or equal to 4096"),
    ("host 1e9 GiB", BASE.replace("host_gib: 8", "host_gib: 1000000000"), 2, "cluster.host_gib"),
    ("31-digit prompt count", BASE.replace("prompts_per_step: 2", "prompts_per_step: " + "9" * 31), 2, "beyond"),
    (
        "group_size true",
        BASE.replace("group_size: 4", "group_size: true"),
        2,
        "group_size takes a number, not the boolean true",
    ),
    (
        "prefix_sms true",
        BASE + "sharing: {prefix_sms: true}\n",
        2,
        "prefix_sms takes a number or a name, not the boolean",
    ),
    ("train_tp yes", BASE + "parallel: {train_tp: yes}\n", 2, "parallel.train_tp: train_tp takes a number"),
    ("lr false", BASE + "algorithm: {lr: false}\n", 2, "algorithm.lr"),
    ("misspelt section", BASE.replace("workload:", "worklaod:"), 2, "worklaod: unknown key; did you mean `workload`"),
    ("misspelt key", BASE.replace("hbm_gib", "hbm_gb"), 2, "cluster.hbm_gb: unknown key; did you mean `hbm_gib`"),
    ("unknown section", BASE + "trainer: {x: 1}\n", 2, "trainer: unknown key"),
    ("a number as a key", BASE + "1: 2\n", 2, "1: Keys should be strings"),
    ("missing cluster", BASE.replace("cluster: {hbm_gib: 16, host_gib: 8}\n", ""), 2, "required key is missing"),
    ("null cluster", BASE.replace("{hbm_gib: 16, host_gib: 8}", "null"), 2, "cluster"),
    ("list for a section", BASE.replace("{hbm_gib: 16, host_gib: 8}", "[16, 8]"), 2, "cluster"),
    ("text for a count", BASE.replace("prompt_tokens: 384", "prompt_tokens: many"), 2, "workload.prompt_tokens"),
    ("float for a count", BASE.replace("group_size: 4", "group_size: 4.5"), 2, "workload.group_size"),
    ("zero nodes", BASE.replace("cluster: {", "cluster: {nodes: 0, "), 2, "cluster.nodes"),
    ("zero steps", BASE + "run: {steps: 0}\n", 2, "run.steps"),
    ("negative seed", BASE + "run: {seed: -1}\n", 2, "run.seed: Input should be greater than or equal to 0"),
    ("beta of 1.5", BASE + "algorithm: {betas: [1.5, 0.999]}\n", 2, "algorithm.betas.0: Input should be less than 1"),
    ("beta of 1", BASE + "algorithm: {betas: [0.9, 1]}\n", 2, "algorithm.betas.1: Input should be less than 1"),
    ("huge model name", BASE.replace("model: tiny", "model: " + "m" * 100_000), 2, "not a shipped config or a path"),
    ("long list for betas", BASE + "algorithm: {betas: [" + "0.9, " * 5000 + "0.9]}\n", 2, "algorithm.betas"),
    ("unknown model", BASE.replace("model: tiny", "model: qwen9"), 2, "neither a shipped config"),
    ("model dir without config", BASE.replace("model: tiny", "model: {dir}"), 2, "neither a shipped config"),
    ("config zero kv heads", ("config.json", with_config(num_key_value_heads=0)), 2, "num_key_value_heads must"),
    ("config invalid json", ("config.json", "{'vocab_size': 512,"), 2, "config.json: not a JSON config"),
    (
        "config lacks a key",
        ("config.json", json.dumps({k: v for k, v in CONFIG.items() if k != "vocab_size"})),
        2,
        "config.json: lacks 'vocab_size'",
    ),
    ("config a list", ("config.json", "[1, 2]"), 2, "config.json: not a Qwen2.5-VL config"),
    ("config text size", ("config.json", with_config(hidden_size="big")), 2, "hidden_size must be a positive"),
    ("config heads not dividing", ("config.json", with_config(num_attention_heads=3)), 2, "config.json: hidden_size"),
    ("train_tp 3", BASE + "cluster: {gpus_per_node: 3, hbm_gib: 16, host_gib: 8}\n", 2, "duplicate key"),
    (
        "train_tp not dividing heads",
        BASE.replace("cluster: {", "cluster: {gpus_per_node: 3, ") + "parallel: {train_tp: 3, rollout_tp: 1}\n",
        2,
        "parallel.train_tp: 3 does not divide",
    ),
    (
        "rollout_tp not dividing",
        BASE + "parallel: {train_tp: 1, rollout_tp: 2}\n",
        2,
        "parallel.rollout_tp: rollout_tp 2 does not divide train_tp 1",
    ),
    ("unknown schedule", BASE + "schedule: fast\n", 2, "schedule: Input should be"),
    ("unknown algorithm", BASE + "algorithm: {name: dpo}\n", 2, "algorithm.name"),
    ("negative temperature", BASE + "algorithm: {temperature: -1}\n", 2, "algorithm.temperature"),
    ("minibatches not dividing", BASE + "algorithm: {minibatches_per_step: 3}\n", 2, "does not divide the 2"),
    ("ppo with minibatches", BASE + "algorithm: {name: ppo, minibatches_per_step: 2}\n", 2, "runs with grpo only"),
    ("visual over the prompt", BASE.replace("visual_tokens: 8", "visual_tokens: 999"), 2, "exceed prompt_tokens"),
    (
        "video and visual tokens",
        BASE.replace("visual_tokens: 8", "visual_tokens: 8, video: {frames: 4, height: 56, width: 56}"),
        2,
        "workload: give either `video` or `visual_tokens`",
    ),
    (
        "graph cycle",
        BASE + GRAPH + "    - {id: a, kind: forward, role: actor, inputs: [b_out], outputs: [a_out]}\n"
        "    - {id: b, kind: forward, role: actor, inputs: [a_out], outputs: [b_out]}\n",
        2,
        "cycle",
    ),
    (
        "graph unread input",
        BASE + GRAPH + "    - {id: x, kind: forward, role: actor, inputs: [ghost], outputs: [y]}\n",
        2,
        "reads 'ghost', which no node produces",
    ),
    (
        "graph duplicate id",
        BASE + GRAPH + "    - {id: reward, kind: reward, inputs: [prompts], outputs: [r2]}\n",
        2,
        "duplicate node id",
    ),
    (
        "graph critic under grpo",
        BASE + GRAPH + "    - {id: c, kind: forward, role: critic, inputs: [prompts, responses], outputs: [v]}\n",
        2,
        "spec.yaml: the graph has a critic: set algorithm.name: ppo",
    ),
    (
        "graph without the reference kl_coef needs",
        BASE + GRAPH + ACTOR + "    - {id: actor_backward, kind: backward, role: actor, inputs: [lp, rewards]}\n",
        2,
        "algorithm.kl_coef 0.04 needs node 'actor_backward' to read a reference forward node's output",
    ),
    (
        "graph with a reference kl_coef 0 leaves unused",
        BASE
        + "algorithm: {kl_coef: 0}\n"
        + GRAPH
        + ACTOR
        + REFERENCE
        + "    - {id: actor_backward, kind: backward, role: actor, inputs: [lp, ref_lp, rewards]}\n",
        2,
        "reads the reference's scores, which algorithm.kl_coef 0 leaves unused",
    ),
    (
        "graph ppo without values",
        BASE
        + "algorithm: {name: ppo}\n"
        + GRAPH
        + ACTOR
        + REFERENCE
        + "    - {id: critic_score, kind: forward, role: critic, inputs: [prompts, responses], outputs: [v]}\n"
        "    - {id: actor_backward, kind: backward, role: actor, inputs: [lp, ref_lp, rewards]}\n",
        2,
        "algorithm.name ppo needs node 'actor_backward' to read the critic's values",
    ),
    ("lr read as text", BASE + "algorithm: {lr: 1e30}\n", 2, "algorithm.lr: lr 1e+30 is beyond any real setting"),
    ("no rewards", BASE + "algorithm: {rewards: []}\n", 2, "algorithm.rewards: Tuple should have at least 1 item"),
    (
        "beyond the model's context",
        BASE.replace("prompt_tokens: 384", "prompt_tokens: 4090"),
        2,
        "4082 prompt text + 16 response tokens exceed tiny's context of 4096",
    ),
    (
        "video height not whole patches",
        BASE.replace("visual_tokens: 8", "video: {frames: 4, height: 30, width: 56}"),
        2,
        "workload.video.height: 30 is not a multiple of 28",
    ),
    ("too small to fit", BASE.replace("hbm_gib: 16", "hbm_gib: 0.01"), 1, "does not fit"),
    ("a billion prompts", BASE.replace("prompts_per_step: 2", "prompts_per_step: 1000000000"), 2, "at most 65,536"),
    ("a billion samples", BASE.replace("group_size: 4", "group_size: 1000000000"), 2, "at most 1,048,576"),
    ("prompts x samples", BASE.replace("2, group_size: 4", "40000, group_size: 32"), 2, "1,280,000 responses"),
]


@pytest.mark.parametrize(("name", "content", "code", "says"), CASES, ids=[c[0] for c in CASES])
def test_a_malformed_spec_is_one_short_line_with_its_exit_code(tmp_path, capsys, name, content, code, says):
    spec = tmp_path / "spec.yaml"
    if isinstance(content, tuple):  # a model config file, and a spec that names it
        (tmp_path / content[0]).write_text(content[1])
        content = BASE.replace("model: tiny", f"model: {tmp_path / content[0]}")
    if isinstance(content, str):
        content = content.replace("{dir}", str(tmp_path)).encode()
    spec.write_bytes(content)
    start = time.perf_counter()
    assert main(["compile", str(spec), "--dry-run"]) == code
    assert time.perf_counter() - start < 1.0
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[:2000]
    assert len(lines[0]) - len(str(spec)) <= len("rollplex: ") + MAX_LINE and str(spec) in lines[0], lines[0][:500]
    assert says in lines[0], lines[0]
    assert not (tmp_path / "pwned").exists()


def test_the_corpus_is_large():
    assert len(CASES) >= 50
