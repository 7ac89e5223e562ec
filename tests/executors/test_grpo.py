"""GRPO arithmetic against a plain per-token reference written out with Python loops."""

import math

import pytest
import torch

from rollplex.executors.grpo import GrpoConfig, group_advantages, grpo_loss, k3_kl, loss_scale


def reference_loss(cfg, lp, old, ref, adv, ent, mask):
    """The textbook definition, one token at a time."""
    terms = []
    for p in range(len(lp)):
        for n in range(len(lp[0])):
            seq = []
            for t in range(len(lp[0][0])):
                if not mask[p][n][t]:
                    continue
                ratio = math.exp(lp[p][n][t] - old[p][n][t])
                a = adv[p][n]
                clipped = min(max(ratio, 1 - cfg.clip_ratio), 1 + cfg.clip_ratio)
                d = ref[p][n][t] - lp[p][n][t]
                kl = math.exp(d) - d - 1
                seq.append(-min(ratio * a, clipped * a) + cfg.kl_coef * kl - cfg.entropy_coef * ent[p][n][t])
            terms.append(seq)
    if cfg.loss_agg == "token_mean":
        return sum(sum(s) for s in terms) / sum(len(s) for s in terms)
    return sum(sum(s) / max(len(s), 1) for s in terms) / len(terms)


def test_group_advantages_normalise_within_each_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = group_advantages(r)
    assert torch.allclose(a[0], (r[0] - 0.5) / (r[0].std() + 1e-6))
    assert torch.equal(a[1], torch.zeros(4))  # a group that agrees teaches nothing


@pytest.mark.parametrize("reward, n", [(0.7, 12), (1 + 2 / 3, 8), (0.1, 8), (0.3, 8)])
def test_a_group_that_agrees_on_an_inexact_reward_has_no_advantage(reward, n):
    r = torch.tensor([[reward] * n, [0.0] * (n - 1) + [reward]])  # float32: its mean lands an ulp off the rewards
    a = group_advantages(r)
    assert torch.equal(a[0], torch.zeros(n))
    assert a.dtype == torch.float32 and a[1, -1] > 0 and torch.allclose(a[1].sum(), torch.tensor(0.0), atol=1e-5)


def test_k3_kl_is_zero_at_equality_and_positive_elsewhere():
    lp = torch.log(torch.tensor([0.2, 0.5]))
    assert torch.allclose(k3_kl(lp, lp), torch.zeros(2))
    assert (k3_kl(lp, lp + 0.3) > 0).all()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_the_loss_equals_the_textbook_definition_and_splits_exactly_over_groups(agg):
    g = torch.Generator().manual_seed(0)
    P, N, R = 3, 4, 5
    lp = -torch.rand(P, N, R, generator=g, dtype=torch.float64) * 2
    old = lp + 0.3 * (torch.rand(P, N, R, generator=g, dtype=torch.float64) - 0.5)
    ref = lp + 0.2 * torch.randn(P, N, R, generator=g, dtype=torch.float64)
    ent = torch.rand(P, N, R, generator=g, dtype=torch.float64)
    lens = torch.randint(1, R + 1, (P, N), generator=g)
    mask = torch.arange(R) < lens.unsqueeze(-1)
    adv = group_advantages(torch.rand(P, N, generator=g, dtype=torch.float64))
    cfg = GrpoConfig(clip_ratio=0.2, kl_coef=0.1, entropy_coef=0.01, loss_agg=agg)
    scale = loss_scale(mask)
    whole = grpo_loss(cfg, scale, lp, old, ref, adv, ent, mask).loss
    per_group = sum(grpo_loss(cfg, scale, lp[p], old[p], ref[p], adv[p], ent[p], mask[p]).loss for p in range(P))
    expected = reference_loss(cfg, lp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), ent.tolist(), mask.tolist())
    assert whole.item() == pytest.approx(expected, rel=1e-12)
    assert per_group.item() == pytest.approx(expected, rel=1e-12)


def test_on_policy_the_gradient_is_the_advantage_weighted_score():
    lp = torch.log(torch.tensor([[[0.5, 0.25]]], dtype=torch.float64)).requires_grad_()
    mask = torch.ones(1, 1, 2, dtype=torch.bool)
    cfg = GrpoConfig(clip_ratio=0.2, kl_coef=0.0, entropy_coef=0.0, loss_agg="token_mean")
    out = grpo_loss(
        cfg,
        loss_scale(mask),
        lp,
        lp.detach(),
        None,
        torch.tensor([[2.0]], dtype=torch.float64),
        torch.zeros(1, 1, 2, dtype=torch.float64),
        mask,
    )
    out.loss.backward()
    assert torch.allclose(lp.grad, torch.full((1, 1, 2), -1.0, dtype=torch.float64))  # -A / num_tokens


def test_an_extreme_log_ratio_gives_a_finite_loss_where_the_advantage_is_zero():
    """A group whose rewards agree (advantage 0) beside a policy far from the old one: exp of the raw log-ratio
    overflows FP32 and inf x 0 is NaN; the ratio clamped from above keeps the loss at its KL term, its gradient
    finite; a reference far below the policy is not clamped (exp only underflows)."""
    lp = torch.tensor([[[-0.5, -1.0]]], requires_grad=True)
    old = torch.tensor([[[-200.0, -1.0]]])  # log-ratio 199.5: exp overflows FP32
    ref = torch.tensor([[[-300.0, -1.0]]])  # ref - lp far below the policy
    mask = torch.ones(1, 1, 2, dtype=torch.bool)
    cfg = GrpoConfig(clip_ratio=0.2, kl_coef=0.1, entropy_coef=0.0, loss_agg="token_mean")
    adv = group_advantages(torch.tensor([[1.0]]).expand(1, 4))[:, :1]
    out = grpo_loss(cfg, loss_scale(mask), lp, old, ref, adv, torch.zeros(1, 1, 2), mask)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert out.loss.item() == pytest.approx(0.1 * (299.5 - 1) / 2, rel=1e-5)  # below the limit: unclamped k3
    assert lp.grad[0, 0, 0] != 0  # the KL still pulls the token towards the reference
