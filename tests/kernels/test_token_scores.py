"""The fused LM-head scores against eager torch (`models.scores`' path on the CPU): the target's log-prob and the
entropy at each token, at temperatures 1 and not, and the gradients they send to the hidden states and the head."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import DEVICE, DTYPE, ON_GPU, needs_cuda

from rollplex.kernels.token_scores import BLOCK_V, head_scores
from rollplex.models.sampling import tempered

TOL = dict(atol=2e-2, rtol=2e-2) if ON_GPU else dict(atol=1e-5, rtol=1e-5)


def eager(hidden, weight, targets, temperature):
    logprobs = tempered(hidden @ weight.t(), temperature)
    return logprobs.gather(-1, targets[:, None])[:, 0], -(logprobs.exp() * logprobs).sum(-1)


def inputs(rows: int, vocab: int, width: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, width, generator=g) * 2).to(DEVICE, DTYPE)
    weight = torch.randn(vocab, width, generator=g).to(DEVICE, DTYPE)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    weights = torch.randn(2, rows, generator=g).to(DEVICE)  # the loss's weights on each log-prob and entropy
    return hidden, weight, targets, weights


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_scores_and_their_gradients_are_eagers(temperature):
    hidden, weight, targets, (a, b) = inputs(5, BLOCK_V + 300)  # two blocks of the vocabulary, the second partial
    got, want = [], []
    for fn, out in ((head_scores, got), (eager, want)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w, targets, temperature)
        (a * lp + b * ent).sum().backward()
        out += [lp.detach(), ent.detach(), h.grad, w.grad]
    assert got[0].dtype == got[1].dtype == torch.float32 and got[2].dtype == hidden.dtype
    assert got[1].min() > 0 and got[1].std() > 0  # entropies that differ from row to row
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), **TOL)


def test_a_loss_of_the_log_probs_alone_and_scoring_without_gradients():
    hidden, weight, targets, (a, _) = inputs(3, 700, seed=1)
    h = hidden.clone().requires_grad_()
    lp, _ = head_scores(h, weight, targets, 1.0)
    (a * lp).sum().backward()
    h2 = hidden.clone().requires_grad_()
    (a * eager(h2, weight, targets, 1.0)[0]).sum().backward()
    torch.testing.assert_close(h.grad.float(), h2.grad.float(), **TOL)
    with torch.no_grad():
        lp, ent = head_scores(hidden, weight, targets, 1.0)
    assert not lp.requires_grad
    torch.testing.assert_close(torch.stack([lp, ent]), torch.stack(eager(hidden, weight, targets, 1.0)), **TOL)
    empty = head_scores(hidden[:0], weight, targets[:0], 1.0)
    assert [t.shape for t in empty] == [(0,), (0,)]


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_at_the_3b_vocabulary_the_scores_are_eagers_in_bf16():
    hidden, weight, targets, (a, b) = inputs(64, 151936, width=256, seed=2)
    got, want = [], []
    for fn, out in ((head_scores, got), (eager, want)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w, targets, 1.0)
        (a * lp + b * ent).sum().backward()
        out += [lp.detach(), ent.detach(), h.grad.float(), w.grad.float()]
    torch.testing.assert_close(got[0], want[0], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-4)
    for g, w in zip(got[2:], want[2:], strict=True):  # bf16 gradients, rounded alike
        assert (g - w).norm() <= 1e-2 * w.norm()


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_token_scores_takes_the_fused_kernels_in_chunks_and_agrees_with_eager(monkeypatch):
    import rollplex.kernels.token_scores as kernels
    from rollplex.models import scores

    hidden, weight, targets, _ = inputs(300, 5000, width=64, seed=3)
    head = torch.nn.Linear(64, 5000, bias=False, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        head.weight.copy_(weight)
    monkeypatch.setattr(scores, "LOGIT_CHUNK_BYTES", 64 * 5000 * 4)  # several chunks either way
    calls = []
    real = kernels.head_scores
    monkeypatch.setattr(kernels, "head_scores", lambda *x: calls.append(x[0].shape[0]) or real(*x))
    fused = scores.token_scores(hidden, head, targets, 5000)
    assert len(calls) > 1 and sum(calls) == 300
    eager = scores.token_scores(hidden, torch.nn.Sequential(head), targets, 5000)  # not a plain Linear: eager
    for f, e in zip(fused, eager, strict=True):
        torch.testing.assert_close(f, e, atol=1e-3, rtol=1e-4)


def test_what_the_fused_head_keeps_per_token_is_what_the_plan_counts():
    """The plan's head term (`layout.shapes.head_saved_bytes_per_token`, in `output_activation_bytes_per_token`):
    the head's input and three floats and a target a token, beside the weight; no logits."""
    from rollplex.layout.shapes import BF16, head_saved_bytes_per_token
    from rollplex.models.config import load_model_config

    hidden, weight, targets, _ = inputs(7, 900, width=64, seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = head_scores(h, w, targets, 1.0)
    per_token = (sum(kept.values()) - w.nbytes) / h.shape[0]
    text = load_model_config("tiny").text
    assert h.shape[1] == text.hidden_size  # the inputs at the tiny model's width, so that its config sizes them
    kept_in_bf16 = per_token - h.shape[1] * (h.element_size() - BF16)  # the plan counts a bf16 head input
    assert kept_in_bf16 == head_saved_bytes_per_token(text)
    (lp + ent).sum().backward()  # what was kept suffices
