"""Policy losses (vanilla, GSPO, CISPO) and rollout correction against slow references
written from the papers' formulas: loops over sequences and tokens on float64 scalars,
gradients by autograd through those scalars."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.config import AlgoConfig, ConfigError, RolloutCorrectionConfig, load_config
from polyrl.trainer.grpo import LossInputs, policy_loss
from polyrl.trainer.rollout_correction import SEQ_SUMS, TOKEN_MEANS

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]

# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def _clip(r: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return torch.clamp(r, lo, hi)


def _keep_and_weights(x: LossInputs, rc: RolloutCorrectionConfig, b: int, toks: list[int]):
    """({t: kept}, {t: weight}) for sequence b, from rho_t = exp(old_t - behav_t)."""
    log_rho = {t: float(x.old_logp[b, t] - x.behav_logp[b, t]) for t in toks}
    seq_log = sum(log_rho.values())
    geo_log = seq_log / len(toks) if toks else 0.0
    weight = dict.fromkeys(toks, 1.0)
    if rc.rollout_is == "token":
        weight = {t: min(math.exp(v), rc.rollout_is_threshold) for t, v in log_rho.items()}
    elif rc.rollout_is == "sequence":
        w = min(math.exp(min(max(seq_log, -20.0), 20.0)), rc.rollout_is_threshold)
        weight = dict.fromkeys(toks, w)
    kept = dict.fromkeys(toks, True)
    if rc.rollout_rs is not None:
        hi = rc.rollout_rs_threshold
        lo = rc.rollout_rs_threshold_lower or 1 / hi

        def inside(v: float) -> bool:
            return math.log(lo) <= v <= math.log(hi)

        for t in toks:
            stat = {"token": log_rho[t], "sequence": seq_log, "geometric": geo_log}[rc.rollout_rs]
            kept[t] = inside(stat)
    veto = rc.rollout_token_veto_threshold
    if veto is not None and any(v < math.log(veto) for v in log_rho.values()):
        kept = dict.fromkeys(toks, False)
    return kept, weight


def _reference(x: LossInputs, cfg: AlgoConfig, num_tokens: int, num_seqs: int) -> torch.Tensor:
    """The loss from the formulas, term by term, on 0-d float64 tensors (for autograd).

    vanilla  -min(r A, clip(r) A),                 r = pi / pi_old per token (PPO)
    gspo     -min(s A, clip(s) A) for each token,  s = exp(mean_t log(pi / pi_old)) per sequence
             (GSPO, arXiv 2507.18071, in its GSPO-token form, which has the sequence
             objective's value and, without per-token weights, its gradient)
    cispo    -sg(clip(r)) A log pi                 (MiniMax-M1, arXiv 2506.13585, eq. 4)
    """
    B, T = x.mask.shape
    lo, hi = 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high
    seq_values = []
    total = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        toks = [t for t in range(T) if x.mask[b, t] > 0]
        kept, weight = _keep_and_weights(x, cfg.rollout_correction, b, toks)
        log_s = sum((x.logp[b, t] - x.old_logp[b, t] for t in toks), torch.zeros((), dtype=torch.float64))
        s = torch.exp(log_s / max(len(toks), 1))  # the paper's sequence ratio
        seq_sum = torch.zeros((), dtype=torch.float64)
        for t in toks:
            if not kept[t]:
                continue
            a = x.advantages[b] if x.advantages.dim() == 1 else x.advantages[b, t]
            r = torch.exp(x.logp[b, t] - x.old_logp[b, t])
            if cfg.policy_loss == "vanilla":
                pg = torch.max(-a * r, -a * _clip(r, lo, hi))
            elif cfg.policy_loss == "gspo":
                # GSPO-token: sg(s) * pi_t / sg(pi_t), so that each token's own correction
                # weight scales its own gradient (test_gspo_is_the_sequence_objective: without
                # such weights this is the sequence objective).
                ratio = s.detach() * torch.exp(x.logp[b, t] - x.logp[b, t].detach())
                pg = torch.max(-a * ratio, -a * _clip(ratio, lo, hi))
            else:
                pg = -_clip(r, lo, hi).detach() * a * x.logp[b, t]
            term = pg * weight[t]
            if x.ref_logp is not None and cfg.kl_coef > 0:
                d = x.ref_logp[b, t] - x.logp[b, t]
                term = term + cfg.kl_coef * (torch.exp(d) - d - 1)
            if x.entropy is not None and cfg.entropy_coef > 0:
                term = term - cfg.entropy_coef * x.entropy[b, t]
            seq_sum = seq_sum + term
            total = total + term
        n_kept = sum(kept.values())
        seq_values.append(seq_sum / max(n_kept, 1) if cfg.loss_agg_mode == "seq-mean-token-mean" else seq_sum)
    if cfg.loss_agg_mode == "token-mean":
        return total / num_tokens
    return sum(seq_values) / num_seqs


def _inputs(seed: int, per_token_adv: bool = False, B: int = 6, T: int = 7) -> LossInputs:
    """float64; lengths include 0 (a sequence without response tokens) and a hole in the
    middle of a sequence (a masked tool output); padding holds garbage."""
    g = torch.Generator().manual_seed(seed)
    old = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_(False)
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    behav = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    lengths = torch.tensor([T, 3, 0, 5, 1, 6])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()  # [B, T]
    mask[3, 2] = 0.0
    ent = (torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        pad = mask == 0
        behav[pad] = float("nan")
        old[pad] = -float("inf")
        logp[pad] = 80.0
        ent[pad] = float("nan")
    return LossInputs(logp, old, behav, adv, mask, entropy=ent, ref_logp=ref)


CORRECTIONS = {
    "none": {"rollout_is": "none"},
    "token_tis": {"rollout_is": "token", "rollout_is_threshold": 1.3},
    "seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": 1.5},
    "token_rs": {"rollout_is": "none", "rollout_rs": "token", "rollout_rs_threshold": 1.6},
    "seq_rs": {"rollout_is": "token", "rollout_rs": "sequence", "rollout_rs_threshold": 2.5},
    "geo_rs_veto": {
        "rollout_is": "sequence",
        "rollout_rs": "geometric",
        "rollout_rs_threshold": 1.3,
        "rollout_rs_threshold_lower": 0.8,
        "rollout_token_veto_threshold": 0.45,
    },
}


def _cfg(loss: str, mode: str, correction: str, **kw) -> AlgoConfig:
    clip = {"clip_ratio_low": 3e-2, "clip_ratio_high": 4e-2} if loss == "gspo" else {}
    rc = RolloutCorrectionConfig(**CORRECTIONS[correction])
    return AlgoConfig(policy_loss=loss, loss_agg_mode=mode, rollout_correction=rc, **clip, **kw)


def _grads(x: LossInputs) -> list[torch.Tensor]:
    out = [x.logp.grad.clone(), x.entropy.grad.clone()]
    x.logp.grad = x.entropy.grad = None
    return out


# ---------------------------------------------------------------------------------------------
# Loss and gradients against the references
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_loss_and_gradients_match_reference(loss: str, mode: str, correction: str) -> None:
    cfg = _cfg(loss, mode, correction, kl_coef=0.1, entropy_coef=0.01)
    for seed, per_token in ((0, False), (1, True)):
        x = _inputs(seed, per_token)
        num_tokens, num_seqs = int(x.mask.sum()), x.mask.shape[0]
        got, metrics = policy_loss(x, cfg, num_tokens, num_seqs)
        got.backward()
        g = _grads(x)
        want = _reference(x, cfg, num_tokens, num_seqs)
        want.backward()
        assert got.item() == pytest.approx(want.item(), abs=1e-6)
        for a, b in zip(g, _grads(x)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert all(math.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize("loss", ["vanilla", "gspo", "cispo"])
def test_corrections_do_something(loss: str) -> None:
    """The fixture drops some tokens (but not all), and GSPO / CISPO clip some, so the
    reference comparison above is not vacuous."""
    x = _inputs(0)
    n = int(x.mask.sum())
    for correction in ("token_rs", "geo_rs_veto", "seq_rs"):
        _, metrics = policy_loss(x, _cfg(loss, "token-mean", correction), n, 6)
        assert 0 < metrics["mismatch/masked_token_frac"] < 1, correction
    _, metrics = policy_loss(x, _cfg(loss, "token-mean", "none"), n, 6)
    assert 0 < metrics["actor/clipfrac"] < 1


def test_gspo_is_the_sequence_objective() -> None:
    """With one advantage per sequence and no clipping, GSPO's gradient on token t of
    sequence i is -A_i s_i / |y_i| / num_seqs under seq-mean-token-mean (the paper's eq. 9)."""
    x = _inputs(2)
    cfg = AlgoConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=9.0, clip_ratio_high=9.0)
    cfg = cfg.model_copy(update={"rollout_correction": RolloutCorrectionConfig(rollout_is="none")})
    loss, _ = policy_loss(x, cfg, int(x.mask.sum()), 6)
    loss.backward()
    m = x.mask > 0
    lengths = m.sum(-1, keepdim=True).clamp(min=1)
    s = (torch.where(m, x.logp - x.old_logp, 0.0).sum(-1, keepdim=True) / lengths).exp()
    expected = torch.where(m, -x.advantages[:, None] * s / lengths / 6, 0.0)
    torch.testing.assert_close(x.logp.grad, expected.detach(), atol=1e-12, rtol=1e-9)


def test_empty_sequence_and_empty_batch() -> None:
    """A sequence with no counted token adds nothing, and a micro-batch without one gives 0."""
    x = _inputs(3)
    with torch.no_grad():
        x.mask.zero_()
    for loss in ("vanilla", "gspo", "cispo"):
        out, metrics = policy_loss(x, _cfg(loss, "seq-mean-token-mean", "geo_rs_veto"), 0, 6)
        out.backward()
        assert out.item() == 0.0 and (x.logp.grad == 0).all()
        assert metrics["mismatch/masked_seq_frac"] == 0.0
        x.logp.grad = x.entropy.grad = None


# ---------------------------------------------------------------------------------------------
# Mismatch metrics
# ---------------------------------------------------------------------------------------------


def test_mismatch_metrics_match_reference() -> None:
    x = _inputs(4)
    cfg = _cfg("vanilla", "token-mean", "geo_rs_veto")
    n = int(x.mask.sum())
    _, metrics = policy_loss(x, cfg, n, num_seqs=12)  # a 2x larger mini-batch
    k1 = k3 = 0.0
    ws, ppl, dropped, masked = [], 0.0, 0, 0
    for b in range(6):
        toks = [t for t in range(7) if x.mask[b, t] > 0]
        kept, weight = _keep_and_weights(x, cfg.rollout_correction, b, toks)
        lr = [float(x.old_logp[b, t] - x.behav_logp[b, t]) for t in toks]
        k1 += sum(-v for v in lr)
        k3 += sum(math.exp(v) - 1 - v for v in lr)
        ws += [weight[t] for t in toks]
        if toks:
            # log-perplexity: mean_t -log pi, the trainer's minus the engine's
            ppl += sum(-float(x.old_logp[b, t]) + float(x.behav_logp[b, t]) for t in toks) / len(toks)
            dropped += not any(kept.values())
        masked += sum(not k for k in kept.values())
    assert metrics["mismatch/k1_kl"] == pytest.approx(k1 / n, abs=1e-9)
    assert metrics["mismatch/k3_kl"] == pytest.approx(k3 / n, abs=1e-9)
    assert metrics["mismatch/is_ess"] == pytest.approx(sum(ws) ** 2 / (n * sum(w * w for w in ws)), abs=1e-9)
    assert metrics["mismatch/masked_token_frac"] == pytest.approx(masked / n, abs=1e-9)
    assert metrics["mismatch/log_ppl_diff"] == pytest.approx(ppl / 12, abs=1e-9)
    assert metrics["mismatch/masked_seq_frac"] == pytest.approx(dropped / 12, abs=1e-9)
    assert 0 < dropped < 5  # the fixture drops some sequences, not all
    assert set(TOKEN_MEANS) | set(SEQ_SUMS) <= set(metrics)


def test_default_is_the_former_tis() -> None:
    """Unset, the correction is what `tis_cap`'s default was: token TIS capped at 2."""
    x = _inputs(5)
    n = int(x.mask.sum())
    a, _ = policy_loss(x, AlgoConfig(), n, 6)
    b, _ = policy_loss(x, AlgoConfig(tis_cap=2.0), n, 6)
    c, _ = policy_loss(x, _cfg("vanilla", "token-mean", "none"), n, 6)
    assert a.item() == b.item() != c.item()


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def test_tis_cap_maps_to_token_is() -> None:
    rc = AlgoConfig(tis_cap=1.5).rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold) == ("token", 1.5)
    assert AlgoConfig(tis_cap=0).rollout_correction.rollout_is == "none"
    cfg = load_config(None, ["algo.tis_cap=3", "algo.rollout_correction.rollout_is_threshold=3.0"])
    assert cfg.algo.rollout_correction.rollout_is == "token"
    assert load_config(None, ["algo.rollout_correction.rollout_is=none"]).algo.rollout_correction.rollout_is == "none"


def test_saved_config_reloads(tmp_path) -> None:
    from polyrl.config import save_config

    for overrides in (["algo.tis_cap=1.5", "algo.policy_loss=cispo"], ["algo.rollout_correction.rollout_is=null"]):
        cfg = load_config(None, overrides)
        save_config(cfg, tmp_path / "c.toml")
        assert load_config(tmp_path / "c.toml", []).algo == cfg.algo


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["algo.tis_cap=1.5", "algo.rollout_correction.rollout_is=sequence"], ["algo.tis_cap", "rollout_is"]),
        (["algo.tis_cap=1.5", "algo.rollout_correction.rollout_is_threshold=3"], ["tis_cap", "rollout_is_threshold"]),
        (["algo.tis_cap=0", "algo.rollout_correction.rollout_is=token"], ["tis_cap", "rollout_is"]),
        (["algo.rollout_correction.rollout_rs=geometric"], ["rollout_rs_threshold"]),
        (
            [
                "algo.rollout_correction.rollout_rs=token",
                "algo.rollout_correction.rollout_rs_threshold=2",
                "algo.rollout_correction.rollout_rs_threshold_lower=3",
            ],
            ["rollout_rs_threshold_lower"],
        ),
        (["algo.policy_loss=ppo"], ["algo.policy_loss", "vanilla"]),
        (
            ["algo.recompute_old_logprobs=false", "algo.rollout_correction.rollout_token_veto_threshold=1e-4"],
            ["rollout_token_veto_threshold", "algo.recompute_old_logprobs"],
        ),
        (["algo.rollout_correction.rollout_is=seq"], ["rollout_is"]),
    ],
)
def test_config_refuses_contradictions(overrides: list[str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert all(w in str(err.value) for w in words), str(err.value)
