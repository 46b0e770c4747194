"""Measure the fleet model's rates on this machine (`polyrl plan calibrate`).

The run's own model, engine and learner, built from its config as `polyrl train` builds
them, each timed alone: the engine's decode step at several batch sizes (the time of T
tokens minus that of one, over T - 1, so the prefill drops out), its prefill rate, and
one mini-batch of the learner on the workload's lengths. On a CPU host the engine runs
with the workers' thread count (`fleet.worker_threads`) and the learner with the
trainer's, since that is how they run beside each other.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from polyrl.config import RunConfig
from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest
from polyrl.models.precision import DTYPES
from polyrl.plan.calibration import Calibration, DecodePoint
from polyrl.protocol.sampling import SamplingParams
from polyrl.rollout.local import LocalRollout, engine_dtype, learner_weights
from polyrl.trainer.batching import SeqItem
from polyrl.trainer.distributed import DataParallel
from polyrl.trainer.policy import build_learner, load_policy

log = logging.getLogger("polyrl.plan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_CALLS = itertools.count()
"""Seeds each timed call's prompts: a prompt an earlier call sent would be read from the
engine's prefix cache, and the call would time no prefill (the first calibrations of the
MPS rows read 2-3M prefill tokens/s on half an H200 that way)."""


def _generate(engine: Engine, batch: int, prompt_tokens: int, new_tokens: int, vocab: int) -> float:
    rng = random.Random(next(_CALLS))
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, n=1, seed=0)
    t0 = time.perf_counter()
    for i in range(batch):
        engine.add_request(EngineRequest(str(i), [rng.randrange(3, vocab) for _ in range(prompt_tokens)], sampling))
    while engine.has_work:
        engine.step()
    return time.perf_counter() - t0


_TOKEN = "calibrate"
SERVED_WORKERS_ON_CPU = 3
"""Worker processes `--served` times on a CPU host, the median step kept: one process's
batch-256 step came out at 10.1-12.1 ms in six calibrations on the 2-core box, by the
process (more repeats in one process did not narrow it), and a run's workers draw the
same lottery (BENCHMARKS.md, the fleet model on this box)."""


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _ServedWorker:
    """A real `polyrl worker` on a free local port, with the fleet's thread count, driven
    as the manager drives it: streaming /generate calls of one group (`rollout.n`
    samples) each, read incrementally. Besides the times, it keeps what each timing cost
    in CPU: the worker's cores while it decoded, and the reader's seconds per token."""

    def __init__(self, cfg: RunConfig, model_dir: Path, max_num_seqs: int, vocab: int) -> None:
        import httpx

        from polyrl.launch.fleet import worker_env

        self.cfg, self.vocab = cfg, vocab
        started = time.perf_counter()
        self.worker_cores: list[float] = []
        self.reader_s_per_token: list[float] = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "polyrl.cli", "worker", "--model", str(model_dir), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), f"engine.max_num_seqs={max_num_seqs}"]
        if cfg.engine.num_kv_blocks:  # the run's KV cache, not a share of what the GPU has free
            cmd.append(f"engine.num_kv_blocks={cfg.engine.num_kv_blocks}")
        env = worker_env(_TOKEN, cfg.fleet.worker_threads)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the calibration's worker exited with {self.proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        self.start_s = time.perf_counter() - started
                        """From its start to serving: a replacement's time to come up."""
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("the calibration's worker did not come up in 120 s")
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def info(self) -> dict:
        import httpx

        headers = {"Authorization": f"Bearer {_TOKEN}"}
        return httpx.get(f"{self.url}/get_server_info", headers=headers, timeout=10).json()

    def time(self, batch: int, prompt_tokens: int, new_tokens: int, n: int | None = None) -> float:
        """One call of `batch` samples in groups of `n` (default: the run's `rollout.n`)."""
        import asyncio

        import httpx

        from polyrl.manager.backends import GenerationCall, generate_body

        n = min(batch, n or self.cfg.rollout.n)
        seed = next(_CALLS)
        rng = random.Random(seed)
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, n=n, seed=0)
        calls = [  # ids of their own: calls from two threads run at once (`_prefill_step_s`)
            GenerationCall(f"c{i}s{seed}", [rng.randrange(3, self.vocab) for _ in range(prompt_tokens)], sampling)
            for i in range(max(1, batch // n))
        ]
        headers = {"Authorization": f"Bearer {_TOKEN}", "Content-Type": "application/json"}
        interval = self.cfg.manager.stream_interval_s

        async def one(client: httpx.AsyncClient, call: GenerationCall) -> None:
            body = generate_body(call, incremental=True, stream_interval_s=interval)
            async with client.stream("POST", f"{self.url}/generate", content=body, headers=headers) as r:
                r.raise_for_status()
                async for _ in r.aiter_lines():
                    pass

        async def all_calls() -> None:
            async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
                await asyncio.gather(*(one(client, c) for c in calls))

        cpu0, worker0, t0 = time.process_time(), _cpu_s(self.proc.pid), time.perf_counter()
        asyncio.run(all_calls())
        wall = time.perf_counter() - t0
        self.worker_cores.append((_cpu_s(self.proc.pid) - worker0) / wall)
        self.reader_s_per_token.append((time.process_time() - cpu0) / (len(calls) * n * new_tokens))
        return wall


def _decode_step(timer: Callable[[int], float], new_tokens: int, repeats: int) -> tuple[float, float]:
    """One batch's decode step, from the time of `new_tokens` tokens less that of one (the
    prefill drops out), and that one-token call's time; `timer(tokens)` times a call."""
    timer(2)  # warm-up (graphs, allocator)
    one = min(timer(1) for _ in range(repeats))
    full = min(timer(new_tokens) for _ in range(repeats))
    return max(1e-6, (full - one) / (new_tokens - 1)), one


def _decode_points(
    timer: Callable[[int, int], float], batches: tuple[int, ...], new_tokens: int, prompt_tokens: int, repeats: int
) -> tuple[list[DecodePoint], float]:
    """Decode steps from the time of `new_tokens` tokens less that of one, and the
    largest batch's prefill rate (as the model charges it: every sample's prompt, though
    a group's samples share theirs; on a CPU host the call's own cost, not prefill)."""
    points, prefill = [], 0.0
    for b in batches:
        step_s, one = _decode_step(lambda t, b=b: timer(b, t), new_tokens, repeats)
        points.append(DecodePoint(batch=b, step_s=step_s))
        prefill = b * prompt_tokens / one  # the largest batch's: at batch 1 the call's own cost dominates
        log.info("decode step at batch %d: %.2f ms", b, points[-1].step_s * 1e3)
    return points, prefill


def calibrate(
    cfg: RunConfig,
    batches: tuple[int, ...] = (1, 16, 64, 256),
    new_tokens: int = 64,
    prompt_tokens: int = 8,
    learner_lengths: tuple[int, ...] = (),
    repeats: int = 3,
    served: bool = False,
    context: int = 0,
    corun: bool = False,
    pull_gbps: float = 10.0,
    served_workers: int | None = None,
    context_batch: int = 64,
) -> Calibration:
    """Rates of `cfg`'s model on `cfg.trainer.device`. `learner_lengths`: the sequences of
    one timed mini-batch (prompt and response tokens); by default the run's own, one
    mini-batch of `rollout.max_new_tokens` samples. `served`: time decoding through a real
    worker process and its HTTP stream, as the manager drives it (on a CPU host the
    serving path costs about as much as the model: BENCHMARKS.md), not the bare engine.
    `context`: also time a batch whose prompts are this much longer, for the decode
    step's cost per token of context (`decode_kv_s_per_token`; on a GPU at RL lengths the
    KV reads outweigh the weights), and the prefill rate of those prompts; at
    `context_batch` sequences (the batch of `batches` nearest it). `corun` (with
    `served`, on a GPU): time the worker's decoding while the learner trains in this
    process, for what clients of one GPU cost each other (`shared_gpu`: run it with MPS,
    each process at its share of the SMs); with `context`, at that batch and context,
    where a fleet's engines spend a long-tailed step. `served` also times the trainer's
    publish of a version for pulls (`publish_s`). `pull_gbps`: the workers' link,
    recorded as given. `served_workers`: worker processes timed one after another, the
    median of their decode steps kept (None: `SERVED_WORKERS_ON_CPU` on a CPU host, 1 on
    a GPU)."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="polyrl-calibrate-") as tmp:
        init = Path(cfg.model.path) if cfg.model.path else Path(tmp) / "init"  # as `polyrl train` picks it
        policy = load_policy(cfg, init, None)
        device = policy.model.device
        vocab = policy.model.config.vocab_size
        engine_threads = cfg.fleet.worker_threads if device.type == "cpu" else threads
        worker = None
        kv_s = prefill_step = 0.0
        room = getattr(policy.model.config, "max_position_embeddings", None)
        if context and room:  # the longer prompts and their tokens must fit the model's positions
            context = max(0, min(context, room - prompt_tokens - new_tokens))
        ctx_batch = min(batches, key=lambda b: (abs(b - context_batch), b))
        group = cfg.rollout.n
        served_prompts = lambda b: max(1, b // min(b, group))  # noqa: E731  (`_ServedWorker.time`'s calls)

        def kv_slope(
            timer: Callable[[int, int, int], float], prompts: Callable[[int], int] = lambda b: b
        ) -> tuple[float, float]:
            """Seconds per decode step per token of context, at `ctx_batch` sequences: the
            steps of `context` more generated tokens, against the first `new_tokens`'.
            Generated tokens are each sample's own, as the context a long tail holds is,
            and the calls stay a group each, as the manager sends them (calls of one
            sample each made the worker stream 8x the requests and timed its host: on an
            H200 the slope came out 2.7x the generated tokens' one; BENCHMARKS.md, the MPS
            kill row). Also the prefill rate of prompts `context` tokens longer (the short
            ones measure a call's own cost more than prefill: on an H200 they gave 13k
            tokens/s), of the tokens the engine computes, as a moved sample re-prefills
            them; `prompts`: the distinct ones of a batch (a served call's samples share
            theirs; counted per sample, the first MPS calibrations read 2-3M tokens/s)."""
            first, one = _decode_step(lambda t: timer(ctx_batch, prompt_tokens, t), new_tokens, repeats)
            base = one + first * (new_tokens - 1)  # the new_tokens call `_decode_step` timed
            longer = min(timer(ctx_batch, prompt_tokens, new_tokens + context) for _ in range(repeats))
            later = max(1e-6, (longer - base) / context)  # its steps' mean context: prompt + new_tokens + context / 2
            # the first steps' mean context is prompt + new_tokens / 2
            slope = max(0.0, (later - first) / (ctx_batch * (new_tokens + context) / 2))
            log.info(
                "decode step at batch %d: %.2f ms over the first %d tokens, %.2f ms over the next %d",
                ctx_batch,
                first * 1e3,
                new_tokens,
                later * 1e3,
                context,
            )
            one_long = min(timer(ctx_batch, prompt_tokens + context, 1) for _ in range(repeats))
            if one_long > one:
                rate = prompts(ctx_batch) * context / (one_long - one)
            else:  # lost in the noise (a tiny model): the long call's whole time as its prefill's
                rate = prompts(ctx_batch) * (prompt_tokens + context) / one_long
            log.info(
                "decode step per token of context: %.3g s (batch %d, +%d tokens); prefill %.0f tokens/s",
                slope,
                ctx_batch,
                context,
                rate,
            )
            return slope, rate

        if served:
            if served_workers is None:
                served_workers = SERVED_WORKERS_ON_CPU if device.type == "cpu" else 1
            if served_workers < 1:
                raise ValueError(f"served_workers must be at least 1 (got {served_workers})")
            runs, cores, readers = [], [], []
            for i in range(served_workers):  # one process after another, each timed in full; the median kept
                worker = _ServedWorker(cfg, init, max(batches), vocab)
                last = i == served_workers - 1
                try:
                    runs.append(
                        _decode_points(
                            lambda b, t, w=worker: w.time(b, prompt_tokens, t),
                            batches,
                            new_tokens,
                            prompt_tokens,
                            repeats,
                        )
                    )
                    # the largest batch's full-length timings: the decode steps the model plays
                    cores.append(statistics.median(worker.worker_cores[-repeats:]))
                    readers.append(statistics.median(worker.reader_s_per_token[-repeats:]))
                    if context and last:
                        # every sequence's context its own: what the worker's KV cache holds
                        # for a batch, with a block to spare (a preempted sequence recomputes)
                        kv_room = worker.info()["max_total_num_tokens"] // ctx_batch - cfg.engine.block_size
                        context = max(1, min(context, kv_room - prompt_tokens - new_tokens))
                        kv_s, context_prefill = kv_slope(worker.time, served_prompts)
                        if device.type == "cuda":  # a CPU engine captures no decode graphs
                            prefill_step, _ = _prefill_step_s(  # calls 4x as long: room for arrivals
                                worker,
                                ctx_batch,
                                max(prompt_tokens, min(prompt_tokens + context, kv_room - 4 * new_tokens)),
                                4 * new_tokens,
                                repeats,
                            )
                finally:
                    if not (corun and last):
                        worker.close()
            points = [
                DecodePoint(batch=b, step_s=statistics.median(run[0][j].step_s for run in runs))
                for j, b in enumerate(batches)
            ]
            prefill = context_prefill if context else statistics.median(run[1] for run in runs)
            served_cores, served_reader = statistics.median(cores), statistics.median(readers)
            if served_workers > 1:
                log.info(
                    "served decode step at batch %d over %d worker processes: %s ms",
                    max(batches),
                    served_workers,
                    ", ".join(f"{max(run[0], key=lambda q: q.batch).step_s * 1e3:.2f}" for run in runs),
                )
        compute_dtype = DTYPES[cfg.model.dtype]
        # the trainer's own engine, built as the colocated rollout builds it (its dtype, its copy)
        engine_cfg = cfg.engine.model_copy(update={"max_num_seqs": max(batches)})
        engine = LocalRollout.colocated(policy.model, engine_cfg, compute_dtype).engine

        def bare(n_threads: int) -> tuple[list[DecodePoint], float]:
            """The engine in this process, on `n_threads` threads."""
            torch.set_num_threads(n_threads)
            return _decode_points(
                lambda b, t: _generate(engine, b, prompt_tokens, t, vocab), batches, new_tokens, prompt_tokens, repeats
            )

        try:  # the trainer's own engine (its threads); a worker's too when not served
            trainer_points, trainer_prefill = bare(threads)
            if not served:
                same = engine_threads == threads
                points, prefill = (trainer_points, trainer_prefill) if same else bare(engine_threads)
                if context:
                    torch.set_num_threads(engine_threads)
                    kv_s, prefill = kv_slope(lambda b, p, t: _generate(engine, b, p, t, vocab))
        finally:
            torch.set_num_threads(threads)
        engine.sleep()  # frees its KV cache (and graphs): the learner below runs without them, as in a run
        if trainer_points == points:
            trainer_points = None
        tcfg = cfg.trainer
        per_mini = tcfg.ppo_mini_batch_size * cfg.rollout.n
        lengths = learner_lengths or tuple([prompt_tokens + cfg.rollout.max_new_tokens] * per_mini)
        learner = build_learner(cfg, policy.model, init_path=init, pad_id=policy.pad_id, blob=None, dp=DataParallel())
        rng = random.Random(0)
        items = [
            SeqItem(
                [rng.randrange(3, vocab) for _ in range(n)],
                prompt_tokens,
                [-5.0] * (n - prompt_tokens),
                rng.uniform(-1, 1),
            )
            for n in lengths
        ]

        def mini_batch_s(times: int) -> float:
            """The fastest of `times` timed mini-batches."""
            best = math.inf
            for _ in range(times):
                _sync(device)
                t0 = time.perf_counter()
                learner.train_mini_batch(items, weights_as_sampled=True)
                _sync(device)
                best = min(best, time.perf_counter() - t0)
            return best

        first_s = mini_batch_s(1)  # warm-up (compiles on a GPU)
        best_s = mini_batch_s(repeats)
        learner_tps = sum(lengths) / best_s
        compile_s = max(0.0, first_s - best_s)
        log.info("learner: %.0f tokens/s (its first mini-batch %.1f s longer)", learner_tps, compile_s)
        one_thread_tps = None
        if device.type == "cpu" and threads > 1:  # where the thread governor puts it beside a busy worker
            torch.set_num_threads(1)
            try:
                one_thread_tps = sum(lengths) / mini_batch_s(repeats)
            finally:
                torch.set_num_threads(threads)
            log.info("learner on one thread: %.0f tokens/s", one_thread_tps)
        slowdowns = None
        if worker is not None:
            try:
                if corun and device.type == "cuda":
                    batch, prompt = (ctx_batch, prompt_tokens + context) if context else (max(batches), prompt_tokens)
                    slowdowns = _corun(worker, learner, items, batch, prompt, new_tokens, learner_tps, repeats)
            finally:
                worker.close()
        published = engine_dtype(policy.model, compute_dtype)  # what the trainer publishes
        publish_s = _publish_s(policy.model, published, repeats) if served else 0.0
        version_bytes = sum(
            p.numel() * (published.itemsize if p.is_floating_point() else p.element_size())
            for p in policy.model.parameters()
        )
    cpu = device.type == "cpu"
    engine_cores = float(engine_threads)
    reader = 0.0
    if worker is not None and cpu:
        engine_cores, reader = served_cores, served_reader
        log.info("served: the worker used %.2f cores, the reader %.1f us a token", engine_cores, reader * 1e6)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()}-core CPU"
    return Calibration(
        device=name,
        model=cfg.model.path or "tiny: " + ", ".join(f"{k}={v}" for k, v in cfg.model.tiny.model_dump().items()),
        decode=points,
        trainer_decode=trainer_points,
        prefill_tokens_per_s=prefill,
        learner_tokens_per_s=learner_tps,
        learner_compile_s=compile_s,
        version_bytes=version_bytes,
        host_cores=float(os.cpu_count() or 1) if cpu else None,
        engine_cores=engine_cores if cpu else 1.0,
        learner_cores=float(threads) if cpu else 1.0,
        learner_one_thread_tokens_per_s=one_thread_tps,
        stream_cpu_s_per_token=reader,
        decode_context=prompt_tokens + new_tokens / 2 if context else 0.0,
        decode_kv_s_per_token=kv_s,
        shared_gpu=slowdowns is not None,
        gpu_clients=_mps_clients() if slowdowns is not None else None,
        learner_slowdown_per_engine=slowdowns[0] if slowdowns else 0.0,
        engine_slowdown_beside_learner=slowdowns[1] if slowdowns else 0.0,
        worker_start_s=worker.start_s if worker is not None else 0.0,
        pull_gbps=pull_gbps,
        publish_s=publish_s,
        prefill_step_s=prefill_step,
    )


def _prefill_step_s(
    worker: _ServedWorker, batch: int, prompt_tokens: int, new_tokens: int, repeats: int
) -> tuple[float, list[float]]:
    """What a step that also computes prompt tokens costs beyond a decode step, at
    `batch` sequences: on CUDA such a step runs eagerly, outside the captured decode graphs
    and the overlap of one step's launch with the last one's read-back. Times the worker's
    call of `batch` samples alone, then again while an I/O thread sends one small group
    after another (`engine.admit_batch` samples of a 16-token prompt, one token each, so
    each is admitted at once); the worker's own counters (`num_prefill_steps`) say how
    many steps the arrivals made eager. After a preemption the trainer's engine re-prefills
    the moved samples one or a few at a time, on step after step: this is what each
    costs, beyond its tokens (BENCHMARKS.md, the MPS kill row). Returns it, and the eager
    steps the arrivals added to each fed call."""
    import threading

    def counted(fn: Callable[[], float]) -> tuple[float, int]:
        before = worker.info()["num_prefill_steps"]
        wall = fn()
        return wall, worker.info()["num_prefill_steps"] - before

    call = lambda: worker.time(batch, prompt_tokens, new_tokens)  # noqa: E731
    alone = [counted(call) for _ in range(repeats)]
    arrivals = worker.cfg.engine.admit_batch
    stop = threading.Event()

    def arrive() -> None:
        while not stop.is_set():
            worker.time(arrivals, 16, 1, n=arrivals)

    thread = threading.Thread(target=arrive, name="polyrl-calibrate-arrivals", daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        fed = [counted(call) for _ in range(repeats)]
    finally:
        stop.set()
        thread.join()
    base_s, base_steps = min(t for t, _ in alone), statistics.median(k for _, k in alone)
    added = [k - base_steps for _, k in fed]
    each = [(t - base_s) / extra for (t, _), extra in zip(fed, added, strict=True) if extra >= 1]
    cost = max(0.0, statistics.median(each)) if each else 0.0
    log.info(
        "a step with a prefill chunk: +%.2f ms over a decode step at batch %d (%s eager steps a call fed)",
        cost * 1e3,
        batch,
        ", ".join(f"{x:.0f}" for x in added),
    )
    return cost, added


def _publish_s(model: torch.nn.Module, dtype: torch.dtype, repeats: int) -> float:
    """Seconds the trainer's loop spends publishing a version for the workers to pull: its
    weights in the engines' dtype handed to a real publisher (`RemoteRollout.publish`'s
    host snapshot: the copy out of the device, the checksums), the fastest of `repeats`."""
    from polyrl.transfer.publisher import WeightPublisher

    weights = {k: t.to(dtype) if t.is_floating_point() else t for k, t in learner_weights(model).items()}
    publisher = WeightPublisher().start()
    try:
        best = math.inf
        for version in range(1, repeats + 2):  # the first: warm-up (the shared memory is new)
            t0 = time.perf_counter()
            publisher.publish(weights, version)
            if version > 1:
                best = min(best, time.perf_counter() - t0)
    finally:
        publisher.stop()
    log.info(
        "publish: %.3f s a version (%.0f MB)", best, sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
    )
    return best


def _mps_clients() -> float | None:
    """How many clients' shares of the SMs one GPU holds under this process's MPS cap
    (None without one)."""
    pct = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    try:
        return 100.0 / float(pct) if pct else None
    except ValueError:
        return None


def _corun(
    worker: _ServedWorker,
    learner,
    items: list,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    learner_tps: float,
    repeats: int = 3,
) -> tuple[float, float]:
    """Two clients of one GPU, both busy: the worker decoding `batch` sequences of
    `prompt_tokens`-token prompts, call after call (an I/O thread drives its HTTP
    stream), while the learner trains `repeats` mini-batches or more in this thread,
    until two of the worker's calls have run wholly beside it. Only those calls and those
    mini-batches count (an earlier version timed the worker over the learner's first
    mini-batch only and read the learner 7% slower, where the MPS rows' learner ran
    20-30% slower: BENCHMARKS.md). Returns what each lost against its speed alone (the
    learner's, the worker's: 0.05 is 5% slower)."""
    import threading

    alone = min(worker.time(batch, prompt_tokens, new_tokens) for _ in range(2))
    stop, calls, trained = threading.Event(), [], []

    def decode() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            worker.time(batch, prompt_tokens, new_tokens)
            calls.append((t0, time.perf_counter()))

    thread = threading.Thread(target=decode, name="polyrl-calibrate-corun", daemon=True)
    thread.start()
    try:
        time.sleep(0.5)  # the worker's first call is under way
        start = time.perf_counter()
        while len(trained) < repeats or sum(1 for t0, _ in calls if t0 >= start) < 2:
            t0 = time.perf_counter()
            learner.train_mini_batch(items, weights_as_sampled=True)
            torch.cuda.synchronize()
            trained.append(time.perf_counter() - t0)
            if time.perf_counter() - start > 300 or not thread.is_alive():
                break
    finally:
        stop.set()
        thread.join()
    inside = [t1 - t0 for t0, t1 in calls if t0 >= start]
    if not inside:
        raise RuntimeError("calibrate --corun: no worker call ran beside the learner")
    tokens = sum(len(it.token_ids) for it in items)
    learner_beside = statistics.median(trained)
    learner_x, decode_x = learner_beside * learner_tps / tokens, min(inside) / alone
    log.info("both busy: the worker's decoding %.2fx as long, the learner's %.2fx", decode_x, learner_x)
    return max(0.0, learner_x - 1), max(0.0, decode_x - 1)
