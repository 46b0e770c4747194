"""The seeds' own setup, predicted (`polyrl plan seeds`).

The PolyRL reproduction guide (`seeds/polyrl-reproduce.md`) trains Qwen3-8B with GRPO on
OpenR1 on a trainer of 8 H100s, with spot rollout workers of 2 H100s each (four emulated
on a second H100x8), and reports about 10k tokens/s for veRL alone and about 12k, 14k,
16k and 18k with 1 to 4 workers, at $83.79/h for an H100x8 and $21.28/h for a spot one.

Nothing here was measured on that setup: no 8B model and no 8-GPU host were available.
The rates are a roofline over the H100's measured copy bandwidth (2.78 TB/s, one process
alone, HOPPER.md) and the learner's measured MFU on the 0.6B shape (35%), and the
workload is an assumption (the guide does not print its batch or lengths): 128 prompts x
8 samples, lognormal response lengths with median 1500 and 99th percentile 8000 tokens,
capped at 8192, 300-token prompts, 4 mini-batches. The schedule is the seeds' own: the
trainer's engines generate beside the workers until the step's first mini-batch starts
training, then hand their unfinished samples, tokens kept, to the workers
(`hybrid_local_until = learner`). What it shows is that mechanism, not a calibrated
forecast.
"""

from __future__ import annotations

from polyrl.plan.calibration import Calibration, DecodePoint
from polyrl.plan.fleet_model import Fleet, Workload, predict

PARAMS = 8.19e9
WEIGHT_BYTES = 2 * PARAMS
KV_BYTES_PER_TOKEN = 36 * 2 * 8 * 128 * 2
"""36 layers, K and V, 8 KV heads of 128, bfloat16."""
COPY_BYTES_PER_S = 2.78e12
MFU = 0.35
H100_BF16_FLOPS = 989e12
DECODE_OVERHEAD_S = 0.004
"""A decode step's fixed host and launch cost (the embedded engine's, with CUDA graphs)."""
GPUS_PER_ENGINE = 2
TRAINER_GPUS = 8
SEEDS_TOKENS_PER_S = {0: 10_000, 1: 12_000, 2: 14_000, 3: 16_000, 4: 18_000}


def roofline(mean_context: float) -> Calibration:
    """A 2-GPU tensor-parallel engine's decode step reads the weights once and each
    sequence's KV cache; the learner runs 8 flops per parameter and token (forward,
    backward, and the old log-probs' forward) at `MFU` on the trainer's 8 GPUs."""
    bandwidth = GPUS_PER_ENGINE * COPY_BYTES_PER_S
    points = [
        DecodePoint(
            batch=b, step_s=DECODE_OVERHEAD_S + (WEIGHT_BYTES + b * mean_context * KV_BYTES_PER_TOKEN) / bandwidth
        )
        for b in (1, 64, 256, 512)
    ]
    return Calibration(
        device="H100 roofline (not measured)",
        model="Qwen3-8B",
        decode=points,
        prefill_tokens_per_s=GPUS_PER_ENGINE * MFU * H100_BF16_FLOPS / (2 * PARAMS),
        learner_tokens_per_s=TRAINER_GPUS * MFU * H100_BF16_FLOPS / (8 * PARAMS),
        version_bytes=int(WEIGHT_BYTES),
        pull_gbps=100.0,
        swap_s=0.5,
    )


def seeds_workload() -> Workload:
    return Workload.long_tail(128, 8, 300, 1500, 8000, 8192, mini_batches=4)


def seeds_table() -> str:
    work = seeds_workload()
    mean_len = sum(work.budgets) / len(work.budgets)
    cal = roofline(work.prompt_tokens + mean_len / 2)
    engines = TRAINER_GPUS // GPUS_PER_ENGINE
    trainer_usd = 83.79
    worker_usd = 21.28 / (8 // GPUS_PER_ENGINE)
    lines = [
        "Qwen3-8B GRPO, trainer 8xH100 ($83.79/h) with 4 engines of 2 GPUs; spot workers of 2xH100 ($5.32/h)",
        "rates: a roofline, not measured; workload assumed (see `polyrl.plan.seeds`)",
        "",
        "| fleet | predicted step s | predicted tokens/s | seeds' tokens/s | predicted tokens/$ | vs colocated |",
        "|---|---|---|---|---|---|",
    ]
    base = None
    for n in range(5):
        fleet = Fleet(
            workers=n,
            mode="colocated" if n == 0 else "remote",
            trainer_engine=True,
            trainer_until="learner",
            trainer_engines=engines,
            max_num_seqs=512,
            trainer_max_num_seqs=512,
            trainer_usd_per_hour=trainer_usd,
            worker_usd_per_hour=worker_usd,
        )
        p = predict(cal, work, fleet, steps=2, warmup=1)
        base = base or p.tokens_per_s
        name = "veRL-like, colocated" if n == 0 else f"{n} spot worker{'s' * (n != 1)}"
        lines.append(
            f"| {name} | {p.step_s:.0f} | {p.tokens_per_s:,.0f} | ~{SEEDS_TOKENS_PER_S[n]:,} | "
            f"{p.tokens_per_usd:,.0f} | {p.tokens_per_s / base:.2f}x |"
        )
    return "\n".join(lines)
