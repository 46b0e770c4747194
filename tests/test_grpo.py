"""GRPO math against hand-computed numbers and plain-Python references."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.config import AlgoConfig
from polyrl.trainer import grpo
from polyrl.trainer.grpo import (
    LossInputs,
    filter_zero_variance,
    group_advantages,
    policy_loss,
    token_logprobs,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]

# ---------------------------------------------------------------------------------------------
# group_advantages / filter_zero_variance
# ---------------------------------------------------------------------------------------------

REWARDS = torch.tensor(
    [
        [1.0, 0.0, 0.0, 0.0],  # mean 0.25, unbiased std 0.5
        [0.5, 1.0, 1.5, 2.0],  # mean 1.25, unbiased std sqrt(1.25 / 3) = 0.6454972243679028
        [3.0, 3.0, 3.0, 3.0],  # mean 3, std 0
    ]
)


def test_group_advantages_unnormalised() -> None:
    expected = torch.tensor(
        [
            [0.75, -0.25, -0.25, -0.25],
            [-0.75, -0.25, 0.25, 0.75],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(group_advantages(REWARDS, norm_by_std=False), expected)


def test_group_advantages_std_normalised() -> None:
    # (r - mean) / (std + 1e-6), from Python's statistics.mean / statistics.stdev.
    expected = torch.tensor(
        [
            [1.499997000006, -0.499999000002, -0.499999000002, -0.499999000002],
            [-1.1618932038650136, -0.3872977346216712, 0.3872977346216712, 1.1618932038650136],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(group_advantages(REWARDS, norm_by_std=True), expected)


@pytest.mark.parametrize("norm", [True, False])
def test_group_advantages_single_sample_groups_are_zero(norm: bool) -> None:
    adv = group_advantages(torch.tensor([[5.0], [-1.0]]), norm_by_std=norm)
    assert adv.shape == (2, 1)
    assert torch.equal(adv, torch.zeros(2, 1))


def test_group_advantages_int_rewards() -> None:
    adv = group_advantages(torch.tensor([[1, 0]]), norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5]]))


def test_filter_zero_variance() -> None:
    keep = filter_zero_variance(REWARDS)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, True, False]
    assert filter_zero_variance(torch.tensor([[2.0], [0.0]])).tolist() == [False, False]
    assert filter_zero_variance(torch.tensor([[0.0, 0.0, 1e-3]])).tolist() == [True]


# ---------------------------------------------------------------------------------------------
# token_logprobs
# ---------------------------------------------------------------------------------------------


def _naive_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lp = torch.log_softmax(z, dim=-1)
    logp = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(lp.exp() * lp).sum(-1)
    return logp, entropy


def _logits_and_grads(fn, logits, targets, temperature, g1, g2):
    leaf = logits.detach().clone().requires_grad_(True)
    logp, ent = fn(leaf, targets, temperature)
    ((logp * g1).sum() + (ent * g2).sum()).backward()
    return logp.detach(), ent.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("seed", [0, 1])
def test_token_logprobs_matches_naive(dtype: torch.dtype, temperature: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    B, T, V = (int(v) for v in torch.randint(1, 7, (3,), generator=gen))
    V += 3
    logits = (torch.randn(B, T, V, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    g1, g2 = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)

    got = _logits_and_grads(token_logprobs, logits, targets, temperature, g1, g2)
    ref = _logits_and_grads(_naive_logprobs, logits, targets, temperature, g1, g2)

    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    assert got[2].dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16 grads: both are rounded
    torch.testing.assert_close(got[2], ref[2], atol=1e-5, rtol=rtol)
    assert (got[0] <= 0).all() and (got[1] >= -1e-6).all() and (got[1] <= math.log(V) + 1e-5).all()


def test_token_logprobs_float64_exact_and_gradcheck() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, 5, (2, 3), generator=gen)
    for temperature in (0.7, 1.0, 1.3):
        logp, ent = token_logprobs(logits, targets, temperature)
        ref_logp, ref_ent = _naive_logprobs(logits, targets, temperature)
        assert logp.dtype == torch.float64
        torch.testing.assert_close(logp, ref_logp, atol=1e-6, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)
    leaf = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.8), (leaf,))


@pytest.mark.parametrize("chunk_elems", [1, 2 * 7, 2 * 4 * 7])
def test_token_logprobs_chunked_and_noncontiguous(monkeypatch: pytest.MonkeyPatch, chunk_elems: int) -> None:
    # V=7, T=4: chunks of 1 token, of 2 tokens, and of 2 whole sequences (5 seqs: uneven).
    monkeypatch.setattr(grpo, "_CHUNK_ELEMS", chunk_elems)
    gen = torch.Generator().manual_seed(4)
    full = torch.randn(5, 5, 7, generator=gen)
    logits = full[:, :-1]  # [5, 4, 7], not contiguous, as a causal LM shift produces
    targets = torch.randint(0, 7, (5, 4), generator=gen)
    g1, g2 = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    got = _logits_and_grads(token_logprobs, logits, targets, 1.3, g1, g2)
    ref = _logits_and_grads(_naive_logprobs, logits, targets, 1.3, g1, g2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_token_logprobs_rejects_bad_temperature() -> None:
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), 0.0)


# ---------------------------------------------------------------------------------------------
# policy_loss: plain-Python reference
# ---------------------------------------------------------------------------------------------


def _reference_loss(x: LossInputs, cfg: AlgoConfig, num_tokens: int, num_seqs: int) -> float:
    """Loops over b, t with math.* only."""
    B, T = x.mask.shape
    lp, old, beh = x.logp.tolist(), x.old_logp.tolist(), x.behav_logp.tolist()
    adv, mask = x.advantages.tolist(), x.mask.tolist()
    ent = x.entropy.tolist() if x.entropy is not None else None
    ref = x.ref_logp.tolist() if x.ref_logp is not None else None
    lo, hi = 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high

    def token_loss(b: int, t: int) -> float:
        a = adv[b]
        r = math.exp(lp[b][t] - old[b][t])
        pg = max(-a * r, -a * min(max(r, lo), hi))
        if cfg.tis_cap > 0:
            pg *= min(math.exp(old[b][t] - beh[b][t]), cfg.tis_cap)
        total = pg
        if ref is not None and cfg.kl_coef > 0:
            if cfg.kl_estimator == "k1":
                kl = lp[b][t] - ref[b][t]
            else:
                d = ref[b][t] - lp[b][t]
                kl = math.exp(d) - d - 1
            total += cfg.kl_coef * kl
        if ent is not None and cfg.entropy_coef > 0:
            total -= cfg.entropy_coef * ent[b][t]
        return total

    if cfg.loss_agg_mode == "token-mean":
        s = 0.0
        for b in range(B):
            for t in range(T):
                if mask[b][t]:
                    s += token_loss(b, t)
        return s / num_tokens
    s = 0.0
    for b in range(B):
        seq_sum, seq_len = 0.0, 0
        for t in range(T):
            if mask[b][t]:
                seq_sum += token_loss(b, t)
                seq_len += 1
        if cfg.loss_agg_mode == "seq-mean-token-mean":
            seq_sum /= max(seq_len, 1)
        s += seq_sum
    return s / num_seqs


def _random_inputs(seed: int, B: int = 4, T: int = 6, grad: bool = True) -> LossInputs:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen) * 3  # [B, T]
    # Large enough deviations that both clip bounds and the TIS cap are hit.
    logp = (old + torch.randn(B, T, generator=gen) * 0.4).requires_grad_(grad)
    behav = old + torch.randn(B, T, generator=gen) * 0.6
    lengths = torch.tensor([T, 3, 1, 4, 2, 5][:B])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [B, T]
    entropy = (torch.rand(B, T, generator=gen) * 2).requires_grad_(grad)
    ref = old + torch.randn(B, T, generator=gen) * 0.3
    adv = torch.randn(B, generator=gen)
    return LossInputs(logp, old, behav, adv, mask, entropy=entropy, ref_logp=ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tis_cap", [0.0, 1.5])
@pytest.mark.parametrize(
    "kl_coef,kl_estimator,entropy_coef",
    [(0.0, "k3", 0.0), (0.3, "k1", 0.0), (0.3, "k3", 0.0), (0.0, "k3", 0.05), (0.2, "k3", 0.05)],
)
def test_policy_loss_matches_python_reference(
    mode: str, tis_cap: float, kl_coef: float, kl_estimator: str, entropy_coef: float
) -> None:
    cfg = AlgoConfig(
        loss_agg_mode=mode,
        tis_cap=tis_cap,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
    )
    for seed in range(3):
        x = _random_inputs(seed)
        num_tokens, num_seqs = int(x.mask.sum()), x.mask.shape[0]
        loss, metrics = policy_loss(x, cfg, num_tokens, num_seqs)
        assert loss.dim() == 0
        assert loss.item() == pytest.approx(_reference_loss(x, cfg, num_tokens, num_seqs), abs=1e-5)
        assert metrics["_num_tokens"] == num_tokens
        assert all(isinstance(v, float) for v in metrics.values())


def test_policy_loss_metrics() -> None:
    x = _random_inputs(7)
    cfg = AlgoConfig(tis_cap=1.5, kl_coef=0.1)
    m = x.mask.bool()
    n = int(m.sum())
    _, metrics = policy_loss(x, cfg, num_tokens=3 * n, num_seqs=12)  # a 3x larger mini-batch
    ratio = (x.logp - x.old_logp).exp()[m]
    a = x.advantages[:, None].expand_as(m)[m]
    clipped = -a * ratio.clamp(0.8, 1.28) > -a * ratio
    w = (x.old_logp - x.behav_logp).exp().clamp(max=1.5)[m]
    assert 0 < clipped.float().mean() < 1  # the fixture does exercise clipping
    assert metrics["actor/clipfrac"] == pytest.approx(clipped.float().mean().item())
    assert metrics["actor/ppo_kl"] == pytest.approx((x.old_logp - x.logp)[m].mean().item())
    assert metrics["actor/entropy"] == pytest.approx(x.entropy[m].mean().item())
    assert metrics["actor/tis_weight_mean"] == pytest.approx(w.mean().item())
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28)) * w
    assert metrics["actor/pg_loss"] == pytest.approx(pg.sum().item() / (3 * n), abs=1e-6)
    d = (x.ref_logp - x.logp)[m]
    assert metrics["actor/kl_loss"] == pytest.approx((d.exp() - d - 1).sum().item() / (3 * n))
    assert metrics["_num_tokens"] == n

    bare = LossInputs(x.logp, x.old_logp, x.behav_logp, x.advantages, x.mask)
    _, metrics = policy_loss(bare, AlgoConfig(tis_cap=0.0), n, 4)
    assert metrics["actor/tis_weight_mean"] == 1.0
    assert metrics["actor/entropy"] == 0.0 and metrics["actor/kl_loss"] == 0.0


# ---------------------------------------------------------------------------------------------
# policy_loss: gradients by hand
# ---------------------------------------------------------------------------------------------


def _hand_example(w_raw: list[list[float]] | None = None) -> LossInputs:
    """2 seqs x 3 tokens. clip range [0.8, 1.28].

    seq 0, A = +1, ratios [1.0, 1.5, 0.5]: t1 is clipped (1.5 > 1.28 with A > 0), t0/t2 not.
    seq 1, A = -2, ratios [0.5, 1.5, 1.0]: t0 is clipped (0.5 < 0.8 with A < 0); t1 not
    (for A < 0 the upper bound does not bind); t2 is padding.
    """
    old = torch.full((2, 3), -1.0)
    ratios = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]])
    logp = (old + ratios.log()).requires_grad_(True)
    w = torch.ones(2, 3) if w_raw is None else torch.tensor(w_raw)
    behav = old - w.log()  # exp(old - behav) = w_raw
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return LossInputs(logp, old, behav, torch.tensor([1.0, -2.0]), mask)


def test_gradient_by_hand_token_mean_no_tis() -> None:
    # pg per token = max(-A r, -A clip(r)):
    #   seq 0: -1.0, -1.28 (clipped), -0.5        seq 1: 1.6 (clipped), 3.0, [pad]
    #   loss = (-1 - 1.28 - 0.5 + 1.6 + 3.0) / 5 tokens = 1.82 / 5 = 0.364
    # d/dlogp = -A * r / 5 on unclipped tokens, 0 on clipped ones and padding:
    #   seq 0: [-1 * 1.0 / 5, 0, -1 * 0.5 / 5] = [-0.2, 0, -0.1]
    #   seq 1: [0, 2 * 1.5 / 5, 0]             = [0, 0.6, 0]
    x = _hand_example()
    loss, metrics = policy_loss(x, AlgoConfig(tis_cap=0.0), num_tokens=5, num_seqs=2)
    loss.backward()
    assert loss.item() == pytest.approx(0.364, abs=1e-6)
    torch.testing.assert_close(x.logp.grad, torch.tensor([[-0.2, 0.0, -0.1], [0.0, 0.6, 0.0]]))
    assert metrics["actor/clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/tis_weight_mean"] == 1.0


@pytest.mark.parametrize(
    "mode,expected_loss,expected_grad",
    [
        # w = min(exp(old - behav), 2) = seq 0: [2 (capped from 3), 1, 0.5]; seq 1: [1, 0.5, pad]
        # weighted pg: seq 0: [-2, -1.28, -0.25] sums to -3.53; seq 1: [1.6, 1.5] sums to 3.1
        # seq-mean-token-mean: loss = (-3.53 / 3 + 3.1 / 2) / 2 seqs = 0.18666...
        #   grad = -A r w / (len_b * 2): seq 0 t0: -1*1*2/6 = -1/3, t2: -1*0.5*0.5/6 = -1/24;
        #                                seq 1 t1: 2*1.5*0.5/(2*2) = 0.375
        (
            "seq-mean-token-mean",
            (-3.53 / 3 + 3.1 / 2) / 2,
            [[-1 / 3, 0.0, -1 / 24], [0.0, 0.375, 0.0]],
        ),
        # seq-mean-token-sum: loss = (-3.53 + 3.1) / 2 = -0.215; grad = -A r w / 2 seqs:
        #   seq 0 t0: -2/2 = -1, t2: -0.25/2 = -0.125; seq 1 t1: 1.5/2 = 0.75
        ("seq-mean-token-sum", -0.215, [[-1.0, 0.0, -0.125], [0.0, 0.75, 0.0]]),
    ],
)
def test_gradient_by_hand_with_tis(mode: str, expected_loss: float, expected_grad: list[list[float]]) -> None:
    x = _hand_example(w_raw=[[3.0, 1.0, 0.5], [1.0, 0.5, 7.0]])
    cfg = AlgoConfig(tis_cap=2.0, loss_agg_mode=mode)
    loss, metrics = policy_loss(x, cfg, num_tokens=5, num_seqs=2)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    torch.testing.assert_close(x.logp.grad, torch.tensor(expected_grad))
    assert metrics["actor/tis_weight_mean"] == pytest.approx((2 + 1 + 0.5 + 1 + 0.5) / 5)
    assert x.behav_logp.grad is None and x.old_logp.grad is None


@pytest.mark.parametrize("estimator,expected", [("k3", [-0.25, 0.0]), ("k1", [0.25, 0.25])])
def test_gradient_by_hand_kl_and_entropy(estimator: str, expected: list[float]) -> None:
    # A = 0 so only KL and entropy act. kl_coef 0.5, token-mean over 2 tokens.
    # ref - logp = [ln 2, 0].  k3 = e^d - d - 1, dk3/dlogp = 1 - e^d = [-1, 0];  dk1/dlogp = 1.
    # grad = 0.5 * dk/dlogp / 2.  Entropy: dL/dH = -entropy_coef / 2 = -0.05 per token.
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ent = torch.tensor([[0.5, 0.7]], requires_grad=True)
    ref = logp.detach() + torch.tensor([[math.log(2.0), 0.0]])
    x = LossInputs(logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 2), ent, ref)
    cfg = AlgoConfig(tis_cap=0.0, kl_coef=0.5, kl_estimator=estimator, entropy_coef=0.1)
    loss, metrics = policy_loss(x, cfg, num_tokens=2, num_seqs=1)
    loss.backward()
    kl = (1 - math.log(2.0)) / 2 if estimator == "k3" else -math.log(2.0) / 2
    assert metrics["actor/kl_loss"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(0.5 * kl - 0.1 * 0.6)
    torch.testing.assert_close(logp.grad, torch.tensor([expected]))
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.05, -0.05]]))


# ---------------------------------------------------------------------------------------------
# policy_loss: micro-batch additivity and robustness
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_sum_to_mini_batch(mode: str) -> None:
    cfg = AlgoConfig(loss_agg_mode=mode, tis_cap=1.5, kl_coef=0.1, entropy_coef=0.01)
    x = _random_inputs(11)
    num_tokens, num_seqs = int(x.mask.sum()), 4

    whole, _ = policy_loss(x, cfg, num_tokens, num_seqs)
    whole.backward()
    g_logp, g_ent = x.logp.grad.clone(), x.entropy.grad.clone()
    x.logp.grad, x.entropy.grad = None, None

    total = 0.0
    for sl in (slice(0, 2), slice(2, 4)):
        part = LossInputs(
            x.logp[sl],
            x.old_logp[sl],
            x.behav_logp[sl],
            x.advantages[sl],
            x.mask[sl],
            x.entropy[sl],
            x.ref_logp[sl],
        )
        loss, _ = policy_loss(part, cfg, num_tokens, num_seqs)
        loss.backward()  # accumulates into the shared leaves
        total += loss.item()

    assert total == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(x.logp.grad, g_logp)
    torch.testing.assert_close(x.entropy.grad, g_ent)


def test_padding_garbage_does_not_leak() -> None:
    # Padding positions may hold anything (e.g. -inf log-probs); loss and grads stay finite
    # and equal to the clean case.
    cfg = AlgoConfig(tis_cap=2.0, kl_coef=0.1, entropy_coef=0.01)
    clean = _random_inputs(5)
    dirty = _random_inputs(5)
    pad = dirty.mask == 0
    with torch.no_grad():
        dirty.logp[pad] = 80.0
        dirty.old_logp[pad] = -float("inf")
        dirty.behav_logp[pad] = float("nan")
        dirty.ref_logp[pad] = float("inf")
        dirty.entropy[pad] = float("nan")
    n = int(clean.mask.sum())
    loss_c, met_c = policy_loss(clean, cfg, n, 4)
    loss_d, met_d = policy_loss(dirty, cfg, n, 4)
    loss_c.backward()
    loss_d.backward()
    assert loss_d.item() == pytest.approx(loss_c.item())
    assert torch.isfinite(dirty.logp.grad).all()
    torch.testing.assert_close(dirty.logp.grad, clean.logp.grad)
    assert met_d == pytest.approx(met_c)
