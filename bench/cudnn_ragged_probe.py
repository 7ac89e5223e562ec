"""cuDNN's fused attention through cudnn-frontend over ragged (THD) segments, the packed suffix's two parts at the 3B
scoring shapes, against FlashAttention 2's variable-length kernels as torch ships them: agreement (out, lse, dq, dk,
dv) and CUDA-event times, and each graph's build time, for graphs sized to the call and to capacities (what
`rollplex/models/cudnn_ragged.py` builds). Needs a GPU and cudnn-frontend (`pip install rollplex[gpu]`).

    OUT=<dir> python bench/cudnn_ragged_probe.py   # writes <dir>/cudnn_probe.json; STATS=ragged|padded picks the
                                                   # statistics' layout (default: both, ragged first)
"""

import json
import math
import os
import time
import traceback

import cudnn
import torch

torch.manual_seed(0)
dev = torch.device("cuda")
H, G, D = int(os.environ.get("H", 16)), int(os.environ.get("G", 2)), 128
SCALE = D**-0.5
BF = torch.bfloat16
results = {
    "gpu": torch.cuda.get_device_name(),
    "cudnn_backend": cudnn.backend_version(),
    "torch": torch.__version__,
    "frontend": getattr(cudnn, "__version__", "?"),
}
print(results, flush=True)
handle = cudnn.create_handle()


def timed(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def offsets(lens, width):
    cu = torch.tensor([0, *list(torch.tensor(lens).cumsum(0).tolist())], dtype=torch.int64, device=dev)
    return (cu * width).view(-1, 1, 1, 1)


class Ragged:
    """fwd and bwd graphs for B segments, capacities sq, skv; THD q/o [T, H, D], k/v [Tk, G, D]."""

    def __init__(self, B, sq, skv, causal, ragged_stats):
        self.B, self.sq, self.skv, self.causal, self.ragged_stats = B, sq, skv, causal, ragged_stats
        t0 = time.perf_counter()
        self.fwd = self._build(backward=False)
        t1 = time.perf_counter()
        self.bwd = self._build(backward=True)
        t2 = time.perf_counter()
        self.build_s = (t1 - t0, t2 - t1)
        self.ws = torch.empty(
            max(self.fwd[0].get_workspace_size(), self.bwd[0].get_workspace_size()), dtype=torch.uint8, device=dev
        )

    def _t(self, g, heads, s, name):
        t = g.tensor(
            name=name,
            dim=[self.B, heads, s, D],
            stride=[heads * D, D, heads * D, 1],
            data_type=cudnn.data_type.BFLOAT16,
        )
        off = g.tensor(
            name=name + "_off", dim=[self.B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64
        )
        t.set_ragged_offset(off)
        return t, off

    def _stats(self, g, t):
        B, sq = self.B, self.sq
        if self.ragged_stats:
            t.set_dim([B, H, sq, 1]).set_stride([H, 1, H, 1]).set_data_type(cudnn.data_type.FLOAT)
            off = g.tensor(name="stats_off", dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)
            t.set_ragged_offset(off)
            return off
        t.set_dim([B, H, sq, 1]).set_stride([H * sq, sq, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        return None

    def _build(self, backward):
        g = cudnn.pygraph(
            io_data_type=cudnn.data_type.BFLOAT16,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        q, qo = self._t(g, H, self.sq, "q")
        k, ko = self._t(g, G, self.skv, "k")
        v, vo = self._t(g, G, self.skv, "v")
        lq = g.tensor(name="lq", dim=[self.B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        lk = g.tensor(name="lk", dim=[self.B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        names = dict(q=q, qo=qo, k=k, ko=ko, v=v, vo=vo, lq=lq, lk=lk)
        if not backward:
            o, stats = g.sdpa(
                name="fwd",
                q=q,
                k=k,
                v=v,
                generate_stats=True,
                attn_scale=SCALE,
                use_padding_mask=True,
                seq_len_q=lq,
                seq_len_kv=lk,
                use_causal_mask=self.causal,
            )
            o.set_output(True).set_dim([self.B, H, self.sq, D]).set_stride([H * D, D, H * D, 1])
            oo = g.tensor(name="oo", dim=[self.B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64)
            o.set_ragged_offset(oo)
            stats.set_output(True)
            so = self._stats(g, stats)
            names.update(o=o, oo=oo, stats=stats, so=so)
        else:
            o, oo = self._t(g, H, self.sq, "o")
            do, doo = self._t(g, H, self.sq, "do")
            stats = g.tensor(
                name="stats", dim=[self.B, H, self.sq, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT
            )
            so = self._stats(g, stats)
            dq, dk, dv = g.sdpa_backward(
                name="bwd",
                q=q,
                k=k,
                v=v,
                o=o,
                dO=do,
                stats=stats,
                attn_scale=SCALE,
                use_padding_mask=True,
                seq_len_q=lq,
                seq_len_kv=lk,
                use_causal_mask=self.causal,
            )
            for t, heads, s, off in ((dq, H, self.sq, qo), (dk, G, self.skv, ko), (dv, G, self.skv, vo)):
                t.set_output(True).set_dim([self.B, heads, s, D]).set_stride([heads * D, D, heads * D, 1])
                t.set_ragged_offset(off)
            names.update(o=o, oo=oo, do=do, doo=doo, stats=stats, so=so, dq=dq, dk=dk, dv=dv)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g, names

    def inputs(self, q_lens, k_lens):
        n = len(q_lens)
        pad = self.B - n
        ql = list(q_lens) + [0] * pad
        kl = list(k_lens) + [0] * pad
        lq = torch.tensor(ql, dtype=torch.int32, device=dev).view(-1, 1, 1, 1)
        lk = torch.tensor(kl, dtype=torch.int32, device=dev).view(-1, 1, 1, 1)
        return dict(lq=lq, lk=lk, qo=offsets(ql, H * D), ko=offsets(kl, G * D), so=offsets(ql, H), ql=ql)

    def forward(self, q, k, v, meta):
        g, t = self.fwd
        out = torch.empty_like(q)
        if self.ragged_stats:
            stats = torch.empty(q.shape[0], H, dtype=torch.float32, device=dev)
        else:
            stats = torch.empty(self.B, H, self.sq, 1, dtype=torch.float32, device=dev)
        pack = {
            t["q"]: q,
            t["k"]: k,
            t["v"]: v,
            t["qo"]: meta["qo"],
            t["ko"]: meta["ko"],
            t["vo"]: meta["ko"],
            t["lq"]: meta["lq"],
            t["lk"]: meta["lk"],
            t["o"]: out,
            t["oo"]: meta["qo"],
            t["stats"]: stats,
        }
        if t["so"] is not None:
            pack[t["so"]] = meta["so"]
        g.execute(pack, self.ws, handle=handle)
        return out, stats

    def backward(self, q, k, v, out, stats, dout, meta):
        g, t = self.bwd
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pack = {
            t["q"]: q,
            t["k"]: k,
            t["v"]: v,
            t["qo"]: meta["qo"],
            t["ko"]: meta["ko"],
            t["vo"]: meta["ko"],
            t["lq"]: meta["lq"],
            t["lk"]: meta["lk"],
            t["o"]: out,
            t["oo"]: meta["qo"],
            t["do"]: dout,
            t["doo"]: meta["qo"],
            t["stats"]: stats,
            t["dq"]: dq,
            t["dk"]: dk,
            t["dv"]: dv,
        }
        if t["so"] is not None:
            pack[t["so"]] = meta["so"]
        g.execute(pack, self.ws, handle=handle)
        return dq, dk, dv


def lse_of(stats, meta, ragged_stats):
    """[H, T] from cuDNN's stats."""
    if ragged_stats:
        return stats.T
    parts = [stats[b, :, :n, 0] for b, n in enumerate(meta["ql"]) if n]
    return torch.cat(parts, dim=1)


def flash(q, k, v, q_lens, k_lens, causal):
    cq = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    ck = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)

    def fwd():
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cq, ck, max(q_lens), max(k_lens), 0.0, causal, False, scale=SCALE
        )

    out, lse, rng, unused, _ = fwd()
    return out, lse, (cq, ck, rng, unused), fwd


def flash_bwd(dout, q, k, v, out, lse, q_lens, k_lens, causal, saved):
    cq, ck, rng, unused = saved
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cq, ck, max(q_lens), max(k_lens), 0.0, causal, rng, unused, scale=SCALE
    )


def case(name, q_lens, k_lens, causal, B, sq, skv, ragged_stats):
    row = {
        "case": name,
        "B": B,
        "sq": sq,
        "skv": skv,
        "segments": len(q_lens),
        "q_tokens": sum(q_lens),
        "ragged_stats": ragged_stats,
    }
    try:
        T, Tk = sum(q_lens), sum(k_lens)
        q = torch.randn(T, H, D, device=dev, dtype=BF)
        k = torch.randn(Tk, G, D, device=dev, dtype=BF)
        v = torch.randn(Tk, G, D, device=dev, dtype=BF)
        dout = torch.randn(T, H, D, device=dev, dtype=BF)
        fo, flse, saved, ffwd = flash(q, k, v, q_lens, k_lens, causal)
        fdq, fdk, fdv = flash_bwd(dout, q, k, v, fo, flse, q_lens, k_lens, causal, saved)
        row["flash_fwd_ms"] = timed(ffwd)
        row["flash_bwd_ms"] = timed(lambda: flash_bwd(dout, q, k, v, fo, flse, q_lens, k_lens, causal, saved))
        r = Ragged(B, sq, skv, causal, ragged_stats)
        row["build_s"] = r.build_s
        meta = r.inputs(q_lens, k_lens)
        out, stats = r.forward(q, k, v, meta)
        lse = lse_of(stats, meta, ragged_stats)
        row["out_diff"] = (out.float() - fo.float()).abs().max().item()
        row["lse_diff"] = (lse - flse).abs().max().item()
        dq, dk, dv = r.backward(q, k, v, fo, flse.T.contiguous() if ragged_stats else stats, dout, meta)
        for nm, a, b in (("dq", dq, fdq), ("dk", dk, fdk), ("dv", dv, fdv)):
            row[nm + "_diff"] = (a.float() - b.float()).abs().max().item()
            row[nm + "_scale"] = b.float().abs().max().item()
        row["cudnn_fwd_ms"] = timed(lambda: r.forward(q, k, v, meta))
        row["cudnn_bwd_ms"] = timed(lambda: r.backward(q, k, v, out, stats, dout, meta))
        t0 = time.perf_counter()
        for _ in range(20):
            r.forward(q, k, v, meta)
        row["cudnn_fwd_host_us"] = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        pairs = sum(a * b if not causal else a * (a + 1) // 2 for a, b in zip(q_lens, k_lens, strict=True))
        flop = 4 * pairs * H * D
        row["fwd_tflops_cudnn"] = flop / row["cudnn_fwd_ms"] / 1e9
        row["bwd_tflops_cudnn"] = 2.5 * flop / row["cudnn_bwd_ms"] / 1e9
        row["fwd_tflops_flash"] = flop / row["flash_fwd_ms"] / 1e9
        row["bwd_tflops_flash"] = 2.5 * flop / row["flash_bwd_ms"] / 1e9
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


prompts = [6644, 6139, 5033, 5660, 5063, 6579, 5627, 5403]
g = torch.Generator().manual_seed(1)
resp = [max(8, min(2048, int(math.exp(torch.randn(1, generator=g).item() * 1.0 + 5.3)))) for _ in range(64)]
resp[5] = 2048
runs = [sum(resp[8 * p : 8 * p + 8]) for p in range(8)]
print("runs", runs, "responses", sum(resp), flush=True)
rows = []
modes = [True, False] if os.environ.get("STATS", "both") == "both" else [os.environ["STATS"] == "ragged"]
for rs in modes:
    rows.append(case("prompt_tight", runs, prompts, False, 8, max(runs), max(prompts), rs))
    if "error" in rows[-1] and rs:
        continue
    rows.append(case("prompt_cap", runs, prompts, False, 8, 16384, 8192, rs))
    rows.append(case("prompt_cap_B16", runs, prompts, False, 16, 16384, 8192, rs))
    rows.append(case("own_tight", resp, resp, True, 64, max(resp), max(resp), rs))
    rows.append(case("own_cap", resp, resp, True, 64, 2048, 2048, rs))
    rows.append(case("own_half", resp[:32], resp[:32], True, 64, 2048, 2048, rs))
    break
out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "cudnn_probe.json"), "w") as f:
        json.dump({**results, "rows": rows}, f, indent=1)
heads = ("case", "stats", "fl_fwd", "fl_bwd", "cu_fwd", "cu_bwd", "cu_fTF", "cu_bTF", "dq_diff", "build")
print("\n" + " ".join(f"{h:>9}" for h in heads))
for r in rows:
    if "error" in r:
        print(r["case"], r["error"][:200])
        continue
    times = (r["flash_fwd_ms"], r["flash_bwd_ms"], r["cudnn_fwd_ms"], r["cudnn_bwd_ms"])
    rates = (r["fwd_tflops_cudnn"], r["bwd_tflops_cudnn"])
    build = "{:.2f}/{:.2f}".format(*r["build_s"])
    print(
        f"{r['case']:>9} {r['ragged_stats']!s:>9} "
        + " ".join(f"{t:9.3f}" for t in times)
        + " "
        + " ".join(f"{t:9.0f}" for t in rates)
        + f" {r['dq_diff']:9.4f} {build:>9}"
    )
