"""The packed suffix's cuDNN backward at the 3B floors (`cudnn_ragged.suffix_kernels(8, 8, 2048, 8192)`, 16 query
heads over 2, head dim 128): per part, the workspace and the time of the backward told both totals, the query total
alone (the two `cudnn_ragged._graph` builds and keeps the smaller of) and neither; then the prompt part with empty
segments against all real at equal tokens, and the own part with few and many responses; last, each part's backward
on cuDNN's deterministic kernels against the default's, with the largest workspace of each and how far two calls'
gradients differ. CUDA-event medians of 10.
Needs a GPU and cudnn-frontend (`pip install rollplex[gpu]`).

    python bench/cudnn_ragged_backward.py
"""

import random
import statistics

import cudnn
import torch

from rollplex.models.cascade import Segments
from rollplex.models.cudnn_ragged import _build, build_graphs, suffix_kernels

DEV = torch.device("cuda", torch.cuda.current_device())
PROMPT_LENS = [4910, 6077, 5151, 4953, 6031, 5357, 6757, 6532]  # the 3B spec's first step


def inputs(q_lens: list[int], k_lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(sum(q_lens), 16, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(k_lens), 2, 128, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, v


def median_ms(run, iters: int = 10) -> float:
    times = []
    for _ in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[3:])


def told_neither(shape):
    """The backward of `shape` told neither total: cudnn-frontend's sdpa_backward with the query total dropped too."""
    original = cudnn.pygraph.sdpa_backward

    def sdpa_backward(self, *args, **kwargs):
        kwargs.pop("max_total_seq_len_q", None)
        return original(self, *args, **kwargs)

    cudnn.pygraph.sdpa_backward = sdpa_backward
    try:
        return _build(shape, True, key_total=False)
    finally:
        cudnn.pygraph.sdpa_backward = original


def workspaces(parts, resp: list[list[int]]) -> None:
    runs = [sum(r) for r in resp]
    cases = {False: (runs, PROMPT_LENS), True: ([x for r in resp for x in r], [x for r in resp for x in r])}
    for part in parts:
        q_lens, k_lens = cases[part.causal]
        s = Segments.of(q_lens, k_lens, causal=part.causal, device=DEV)
        q, k, v = inputs(q_lens, k_lens, 0)
        out, lse, (shape, lens) = part.forward(q, k, v, s, 128**-0.5)
        dout, first = torch.randn_like(out), None
        builds = {
            "both totals": _build(shape, True, key_total=True),
            "query total": _build(shape, True, key_total=False),
            "neither": told_neither(shape),
        }
        for name, graph in builds.items():
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            values = {"q": q, "k": k, "v": v, "o": out, "do": dout, "stats": lse.T.contiguous(), "dq": dq, "dk": dk,
                      "dv": dv, **lens.by_name}  # fmt: skip
            ms = median_ms(lambda graph=graph, values=values: graph.run(values, DEV))
            first = first or (dq.float(), dk.float())
            diff = max((dq.float() - first[0]).abs().max().item(), (dk.float() - first[1]).abs().max().item())
            kind = "own part (causal)" if part.causal else "prompt part"
            print(f"{kind}, {name}: workspace {graph.workspace / 2**20:.0f} MiB, {ms:.3f} ms, max |d grad| {diff:.1e}")


def forward_backward(part, q_lens: list[int], k_lens: list[int]) -> str:
    s = Segments.of(q_lens, k_lens, causal=part.causal, device=DEV)
    q, k, v = inputs(q_lens, k_lens, 1)
    fwd, bwd = [], []
    for _ in range(13):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        out, lse, saved = part.forward(q, k, v, s, 128**-0.5)
        e[1].record()
        part.backward(torch.ones_like(out), q, k, v, out, lse, s, 128**-0.5, saved)
        e[2].record()
        torch.cuda.synchronize()
        fwd.append(e[0].elapsed_time(e[1]))
        bwd.append(e[1].elapsed_time(e[2]))
    return f"forward {statistics.median(fwd[3:]):.3f} ms, backward {statistics.median(bwd[3:]):.3f} ms"


def spread(part, q_lens: list[int], k_lens: list[int]) -> str:
    """The backward's time and the largest difference between two calls' gradients on the same inputs."""
    s = Segments.of(q_lens, k_lens, causal=part.causal, device=DEV)
    q, k, v = inputs(q_lens, k_lens, 2)
    out, lse, saved = part.forward(q, k, v, s, 128**-0.5)
    dout = torch.randn_like(out)
    grads = [part.backward(dout, q, k, v, out, lse, s, 128**-0.5, saved) for _ in range(2)]
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(*grads, strict=True))
    ms = median_ms(lambda: part.backward(dout, q, k, v, out, lse, s, 128**-0.5, saved))
    return f"backward {ms:.3f} ms, two calls' gradients apart by at most {diff:.1e}"


def main() -> None:
    print(torch.cuda.get_device_name(DEV))
    rng = random.Random(0)
    resp = [[min(2048, max(8, int(rng.lognormvariate(5.3, 1.0)))) for _ in range(8)] for _ in range(8)]
    prompt, own = suffix_kernels(8, 8, 2048, 8192)
    workspaces((prompt, own), resp)
    p = PROMPT_LENS
    print("prompt part, 8 real segments, 224 queries:", forward_backward(prompt, [28] * 8, p))
    print("prompt part, 6 real + 2 empty, 222 queries:", forward_backward(prompt, [37] * 6, p[:6]))
    print("prompt part, 8 real, 16,384 queries:", forward_backward(prompt, [2048] * 8, p))
    print("prompt part, 7 real + 1 empty, 16,384 queries:", forward_backward(prompt, [2341] * 6 + [2338], p[:7]))
    for n, each in ((31, 463), (56, 260), (64, 228)):
        lens = [2048] + [each] * (n - 1)
        print(f"own part, {n} responses, {sum(lens):,} queries:", forward_backward(own, lens, lens))
    for deterministic in (False, True):
        prompt, own = suffix_kernels(8, 8, 2048, 8192, deterministic=deterministic)
        kind = "deterministic" if deterministic else "default"
        workspace = build_graphs((prompt, own), DEV, torch.bfloat16, 16, 2, 128)
        print(f"{kind}: the largest workspace of the two parts' graphs at the floors: {workspace / 2**30:.2f} GiB")
        print(f"{kind}: prompt part, 8 real, 16,384 queries:", spread(prompt, [2048] * 8, p))
        lens = [x for r in resp for x in r]
        print(f"{kind}: own part, 64 responses, {sum(lens):,} queries:", spread(own, lens, lens))


if __name__ == "__main__":
    main()
