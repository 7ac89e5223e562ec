"""Video-QA workloads for rollplex: what a GRPO iteration reads and how its responses are scored.

Modules, one job each (import them directly; this package imports nothing, so it stays cheap):
    types       `Example`, `AnswerKind`: one prompt with its verifiable answer
    tokenizer   `Tokenizer` protocol, `CharTokenizer` (tiny models), `HFTokenizer` (real checkpoints)
    chat        the Qwen chat prompt with the vision pad tokens in place -> `rollplex.models.inputs.Prompt`
    sizes       Qwen2.5-VL's pixel geometry (smart resize, patch grids): pure arithmetic
    video       Qwen2.5-VL pixel preprocessing (smart resize, CLIP normalisation, patches) -> `Visual`
    scene       moving coloured shapes: simulation (straight lines, bounces) and numpy rendering
    synthetic   seeded synthetic video QA over those scenes, with verifiable answers
    presets     workload shapes after the paper's four datasets, response-length distributions
    decode      video files -> sampled RGB frames (PyAV), Qwen's frame sampling
    video_r1    Video-R1-style JSON / JSONL rows over real video (or image) files -> examples
    rewards     reward registry: format, tags, accuracy, and weighted sums
"""
