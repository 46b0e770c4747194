"""Does the rest of the trainer's process slow its learner? Issue 21's target: a learner
mini-batch step on the Qwen3-0.6B shape, while the fleet delivers at least 20k tokens/s
of finished groups to the trainer and two receivers pull every published version, is at
most 3% slower than the same step alone, in the same run.

One process per role, as `polyrl train` runs now: the rollout manager is `polyrl
manager` (`ManagerProcess`), the engines are tests/fake_fleet.py's fake engines in a
process of their own (`--role fleet`), and each receiver is a process (`--role
receiver`) that pulls every version from the trainer's `WeightPublisher` with 8 streams.
The trainer's process keeps what it keeps in a real run: the learner on the main thread,
the publisher's serving threads, and the batch threads that read finished groups from
the manager (`ManagerLink.open_batch`), here counted by consumer threads.

Phases A-B-A, each K timed steps of `Learner.train_mini_batch` (the real `build_learner`
from a RunConfig) each followed by a bf16 publish, as `rollout/remote.py` publishes:
A alone (no child process), B loaded (batches streaming, receivers pulling each version),
A again, so a drift shows. The slowdown is B's mean against the mean of both A phases.
Also reported: the loaded window's delivered tokens/s (tokens of finished groups), pulls
and their seconds, and the CPU time of the trainer's threads other than the learner's
per delivered token (process_time minus the main thread's thread_time).

The fake engines send each sample's tokens in chunks of `--chunk-tokens` (real polyrl
workers send at most every `manager.stream_interval_s`, 0.2 s); they reuse fake_fleet's
engine, only `_generate` differs. Each batch is `--prompts-per-batch` prompts x n=8
(default 64, `trainer.train_batch_size`'s default: what `polyrl train` submits each step),
each prompt with its own length, so groups finish steadily rather than in waves. Runs
1-18 in BENCHMARKS.md used batches of 4 prompts: 48 batches open at once and about 10
new ones a second, each with its own HTTP request and reading thread, where a run of
`polyrl train` opens one batch a step (a few with `rollout.max_staleness`).

    python benchmarks/learner_interference.py --device cpu         # tiny model, ~1 min, 2 cores

On one H100 (16 host cores), about 2 minutes (model build and warm-up ~40 s; each phase
K=4 steps of ~2.75 s, each followed by a publish; children start in ~10 s, then 8 s of
ramp); past `--timeout-s` (330 s) it stops every child and exits with an error:

    python benchmarks/learner_interference.py --device cuda --json $OUT/interference.json

`--pairs N` keeps the children up and alternates quiet and loaded phases, A0 B0 A1 ...
AN (for each A the stream is paused and its open batches drained; no pulls), and reads
each B against the A phases on either side, so a drift of the host cancels; the target
is read on the median of those N ratios. `--loads both stream pulls` gives the B phases
those loads in turn, to tell the stream's cost from the pulls':

    python benchmarks/learner_interference.py --device cuda --pairs 6 --ramp-s 4 --timeout-s 300 --json $OUT/pairs.json
    python benchmarks/learner_interference.py --device cuda --pairs 9 --loads both stream pulls --steps 8 \
        --ramp-s 5 --timeout-s 560 --json $OUT/loads.json   # (runs 33-36: 32 x 1024, 8k micro-batches)

CUDA defaults: 16 engines x 64 slots at 0.032 s per token = 32k tokens/s offered (at
0.04 s, 25.6k offered, the 2-core CPU box delivered 20k tokens/s to a starved trainer),
completions of 64-128 tokens. The learner's mini-batch is what `polyrl train` steps on by
default, `trainer.ppo_mini_batch_size` (32) prompts x 8 samples: 256 sequences of 1024
tokens (64 prompt + 960 completion), in 16k-token micro-batches, the learner benchmark's
`fast` row (~2.75 s a step). Runs 1-39 in BENCHMARKS.md used 32 sequences in 8k-token
micro-batches: a step of 0.36-0.43 s whose GPU waited on the host for a quarter of its
time, which measured how much host load a launch-bound step can absorb (little) more than
what a real step loses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
TOKEN = "bench-" + secrets.token_hex(8)
KEEP_VERSIONS = 3
"""One more than the trainer's default: a receiver one version behind still finds it."""

# Per device: the model shape, the mini-batch, and the offered token rate.
DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": dict(
        model=dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        ),
        seqs=256,
        prompt_tokens=64,
        completion_tokens=960,
        micro_batch_tokens=16384,
        steps=4,
        warmup=2,
        engines=16,
        slots=64,
        token_delay_s=0.032,
        chunk_tokens=5,
        new_tokens=128,
        ramp_s=8.0,
    ),
    "cpu": dict(
        model=dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        ),
        seqs=8,
        prompt_tokens=16,
        completion_tokens=112,
        micro_batch_tokens=512,
        steps=8,
        warmup=1,
        engines=4,
        slots=16,
        token_delay_s=0.03,
        chunk_tokens=5,
        new_tokens=32,
        ramp_s=2.0,
    ),
}


# ================================================================== child roles


def fleet_main(args: argparse.Namespace) -> None:
    """The fake engines, chunked; serves until stdin closes or the parent goes away."""
    import asyncio

    sys.path.insert(0, str(TESTS))
    from fake_fleet import FakeFleet, _chunk, sse_event  # tests/: the fake fleet is a test helper

    class AlwaysIncremental(random.Random):
        """fake_fleet draws each engine's stream format; a cumulative snapshot of a long
        sample resends every token at each chunk, which no polyrl worker does."""

        def random(self) -> float:
            return 0.0

    class ChunkedFleet(FakeFleet):
        async def _generate(self, engine: Any, body: dict[str, Any], receive: Any, send: Any) -> None:
            sp = body["sampling_params"]
            n, seed, budget, start = sp["n"], sp["sampling_seed"], sp["max_new_tokens"], len(body["input_ids"])
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            disconnected = asyncio.ensure_future(receive())
            engine.num_running += n
            try:
                sent = 0
                while sent < budget and not disconnected.done():
                    total = min(budget, sent + args.chunk_tokens)
                    await asyncio.sleep(self.token_delay_s * (total - sent))
                    finish = {"type": "length"} if total == budget else None
                    events = b"".join(
                        sse_event(_chunk(body["rid"], seed + j, j, start, sent, total, finish, True), True)
                        for j in range(n)
                    )
                    await send({"type": "http.response.body", "body": events, "more_body": True})
                    sent = total
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            finally:
                engine.num_running -= n
                disconnected.cancel()

    token = os.environ["POLYRL_TOKEN"]
    fleet = ChunkedFleet(args.manager, token, max_num_seqs=args.slots, token_delay_s=args.token_delay_s, seed=0)
    fleet.rng = AlwaysIncremental()
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    fleet.serve()


def receiver_main(args: argparse.Namespace) -> None:
    """Reads `version token` lines; pulls each version; answers `version seconds` or
    `version error ...` on stdout. Exits when stdin closes."""
    import torch

    from polyrl.transfer.receiver import pull
    from polyrl.transfer.wire import PullSource

    torch.set_num_threads(1)
    host, port = args.publisher.rsplit(":", 1)
    buffers: list[torch.Tensor] = []  # the version before last's buffer is reused
    print("ready", flush=True)
    for line in sys.stdin:
        version, token = line.split()
        try:
            pulled = pull(
                PullSource(host, int(port), args.worker_id, token),
                int(version),
                num_streams=8,
                into=buffers[0] if len(buffers) == 2 else None,
            )
            buffers = [*buffers[-1:], pulled.buffer]
            print(f"{version} {pulled.seconds:.4f}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which counts it
            print(f"{version} error {type(e).__name__}: {e}".replace("\n", " "), flush=True)


def consumer_main(args: argparse.Namespace) -> None:
    """The trainer's stream, read in this process instead (`--loads elsewhere`): the same
    lanes, paused until told `go`; `quiet` pauses and drains them, then answers
    `tokens seconds` delivered since `go`. Exits when stdin closes."""
    from polyrl.rollout.manager_link import ManagerLink

    link = ManagerLink(args.manager, os.environ["POLYRL_TOKEN"])
    stream = Stream(link, args, num_lanes=_num_lanes(args), paused=True)
    print("ready", flush=True)
    started = time.perf_counter()
    for line in sys.stdin:
        if line.strip() == "go":
            started = time.perf_counter()
            stream.paused.clear()
        else:
            stream.quiet(timeout_s=60)
            now = time.perf_counter()
            print(f"{stream.tokens_between(started, now)} {now - started:.4f}", flush=True)
    stream.stop()
    link.close()


def _num_lanes(args: argparse.Namespace) -> int:
    """Half again as many samples in open batches as there are slots (and at least two
    batches), so that queued samples take the slots a finished batch frees at once."""
    return max(2, -(-3 * args.engines * args.slots // (2 * args.prompts_per_batch * 8)))


def _exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


# ============================================================ the trainer's side


class Children:
    """Every child process, killed (with its process group) on close."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, role_args: list[str]) -> subprocess.Popen[str]:
        env = os.environ | {"POLYRL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, __file__, *role_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        self.procs.clear()


def read_line(proc: subprocess.Popen[str], what: str, timeout_s: float) -> str:
    """The child's next stdout line, or RuntimeError after timeout_s or if it exits."""
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"{what} said nothing within {timeout_s:.0f}s") from None
    if not line:
        raise RuntimeError(f"{what} exited with code {proc.wait(5)} before it was ready")
    return line.strip()


class Stream:
    """Lanes that each keep one batch open through the manager and count the tokens of
    the finished groups, with the time each group arrived."""

    def __init__(self, link: Any, args: argparse.Namespace, num_lanes: int, paused: bool = False) -> None:
        self.link, self.args = link, args
        self.arrivals: list[tuple[float, int]] = []  # (perf_counter, tokens of a finished group)
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.paused = threading.Event()  # lanes open no new batch (--pairs: the quiet phases)
        if paused:
            self.paused.set()
        self.open_batches = 0
        self._count = threading.Lock()
        self.lanes = [
            threading.Thread(target=self._lane, args=(i,), name=f"lane-{i}", daemon=True) for i in range(num_lanes)
        ]
        for lane in self.lanes:
            lane.start()

    def _lane(self, lane: int) -> None:
        from polyrl.protocol.manager_api import BatchPrompt, BatchRequest
        from polyrl.protocol.sampling import SamplingParams

        rng = random.Random(lane)
        for b in range(10**9):
            while self.paused.is_set() and not self.stopping.is_set():
                time.sleep(0.05)
            if self.stopping.is_set():
                return
            top = self.args.new_tokens
            prompts = [
                BatchPrompt(
                    id=f"{lane}-{b}-{i}",
                    input_ids=[1 + i % 50] * 16,
                    seed=rng.randrange(2**20),
                    max_new_tokens=rng.randint(top // 2, top),
                )
                for i in range(self.args.prompts_per_batch)
            ]
            request = BatchRequest(prompts=prompts, sampling=SamplingParams(n=8, max_new_tokens=top, ignore_eos=True))
            with self._count:
                self.open_batches += 1
            try:
                for group in self.link.open_batch(request):
                    self.arrivals.append((time.perf_counter(), sum(len(s.output_ids) for s in group.samples)))
            except Exception as e:  # noqa: BLE001 - reported; stopping closes the link under the lanes
                if not self.stopping.is_set():
                    self.errors.append(f"{type(e).__name__}: {e}")
                return
            finally:
                with self._count:
                    self.open_batches -= 1

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(n for t, n in list(self.arrivals) if t0 <= t < t1)

    def stop(self) -> None:
        self.stopping.set()

    def quiet(self, timeout_s: float) -> None:
        """No new batches, and wait until the open ones have finished."""
        self.paused.set()
        deadline = time.monotonic() + timeout_s
        while self.open_batches and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.open_batches:
            raise RuntimeError(f"{self.open_batches} batches still open after {timeout_s:.0f}s of quiet")


class Receivers:
    """Receiver processes, each told every version; a thread per receiver reads answers."""

    def __init__(self, children: Children, publisher: Any, count: int) -> None:
        self.publisher = publisher
        host, port = publisher.address
        self.procs = [
            children.start(["--role", "receiver", "--publisher", f"{host}:{port}", "--worker-id", f"r{i}"])
            for i in range(count)
        ]
        for i, proc in enumerate(self.procs):
            if (line := read_line(proc, f"receiver r{i}", 120)) != "ready":
                raise RuntimeError(f"receiver r{i}: {line}")
        self.pull_s: list[float] = []
        self.errors: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(p,), daemon=True) for p in self.procs]
        for reader in self.readers:
            reader.start()

    def tell(self, version: int) -> None:
        for i, proc in enumerate(self.procs):
            assert proc.stdin is not None
            proc.stdin.write(f"{version} {self.publisher.grant(f'r{i}', version)}\n")
            proc.stdin.flush()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            version, rest = line.strip().split(" ", 1)
            if rest.startswith("error"):
                self.errors.append(f"v{version}: {rest}")
            else:
                self.pull_s.append(float(rest))

    def wait_idle(self, num_pulls: int, timeout_s: float) -> None:
        """Until `num_pulls` pulls in all have answered (or `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while len(self.pull_s) + len(self.errors) < num_pulls and time.monotonic() < deadline:
            time.sleep(0.05)


# ================================================================== the learner


@dataclass
class Phase:
    name: str
    step_s: list[float] = field(default_factory=list)
    publish_s: list[float] = field(default_factory=list)
    window_s: float = 0.0
    other_threads_cpu_s: float = 0.0
    delivered_tokens: int = 0
    pulls: int = 0
    pull_s_mean: float = 0.0
    pull_errors: list[str] = field(default_factory=list)
    stream_errors: list[str] = field(default_factory=list)
    profile: str = ""
    """--profile-phases: one more step under torch.profiler: where the GPU sat idle (not counted in the phase)."""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, Qwen3Config

        from polyrl.config import load_config
        from polyrl.trainer.distributed import DataParallel
        from polyrl.trainer.policy import build_learner, prepare_process

        self.torch, self.args = torch, args
        self.device = torch.device(args.device)
        on_cuda = args.device == "cuda"
        cfg = load_config(
            None,
            [
                "model.dtype=" + ("bfloat16" if on_cuda else "float32"),
                f"trainer.device={args.device}",
                f"trainer.micro_batch_max_tokens={args.micro_batch_tokens}",
                "trainer.lr=1e-6",
                "trainer.save_every=0",
                f"trainer.ppo_mini_batch_size={args.seqs}",
                f"trainer.train_batch_size={args.seqs}",
                "algo.kl_coef=0.0",
                f"trainer.num_threads={0 if on_cuda else 1}",
            ],
        )
        prepare_process(cfg.trainer)
        shape = DEFAULTS[args.device]["model"]
        config = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096, pad_token_id=0)
        with self.device:  # random init on the GPU: on the host it took longer than the whole phase
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model = model
        self.learner = build_learner(cfg, model, init_path=Path("unused"), pad_id=0, blob=None, dp=DataParallel())
        self.publish_dtype = torch.bfloat16 if on_cuda else torch.float32
        self.items = self._items(shape["vocab_size"])
        self.version = 0

    def _items(self, vocab: int) -> list[Any]:
        from polyrl.trainer.batching import SeqItem

        rng = random.Random(0)
        a = self.args
        return [
            SeqItem(
                token_ids=[rng.randrange(1, vocab) for _ in range(a.prompt_tokens + a.completion_tokens)],
                prompt_len=a.prompt_tokens,
                behav_logp=[-rng.uniform(0.1, 3.0) for _ in range(a.completion_tokens)],
                advantage=rng.gauss(0.0, 1.0),
            )
            for _ in range(a.seqs)
        ]

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def step(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.learner.train_mini_batch(self.items, weights_as_sampled=False)
        self.sync()
        return time.perf_counter() - t0

    def publish(self, publisher: Any) -> float:
        """As `RemoteRollout.publish`: the parameters in the publish dtype, snapshotted."""
        self.sync()
        t0 = time.perf_counter()
        self.version += 1
        weights = {k: p.detach().to(self.publish_dtype) for k, p in self.model.named_parameters()}
        publisher.publish(weights, self.version)
        return time.perf_counter() - t0

    def run_phase(self, name: str, publisher: Any, receivers: Receivers | None = None, profiled: bool = False) -> Phase:
        phase = Phase(name)
        t0, cpu0, own0 = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(self.args.steps):
            phase.step_s.append(self.step())
            phase.publish_s.append(self.publish(publisher))
            if receivers is not None:
                receivers.tell(self.version)
        phase.window_s = time.perf_counter() - t0
        phase.other_threads_cpu_s = (time.process_time() - cpu0) - (time.thread_time() - own0)
        if profiled:  # under the same load: the last version's pulls are still running
            phase.profile = self.profiled_step()
        return phase

    def profiled_step(self) -> str:
        """One step under torch.profiler, not counted in the phase: the GPU's idle time
        inside it and what the host was doing in its largest gaps (`benchmarks/learner.py`'s
        reading)."""
        from torch.profiler import ProfilerActivity, profile

        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        from learner import _host_side  # benchmarks/learner.py

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step_s = self.step()
        return f"step {step_s:.3f} s under the profiler; " + _host_side(prof)


# ==================================================================== the run


def _loaded(
    bench: Bench, publisher: Any, stream: Stream, receivers: Receivers | None, name: str, profiled: bool = False
) -> Phase:
    """A phase with the stream flowing (unless paused) and the receivers, if given, told
    every version; returns once their pulls are done."""
    answered = len(receivers.pull_s) + len(receivers.errors) if receivers is not None else 0
    pulls_before = len(receivers.pull_s) if receivers is not None else 0
    phase = bench.run_phase(name, publisher, receivers, profiled)
    t_end = time.perf_counter()
    phase.delivered_tokens = stream.tokens_between(t_end - phase.window_s, t_end)
    phase.stream_errors = stream.errors[:10]
    if receivers is None:
        return phase
    receivers.wait_idle(answered + bench.args.receivers * bench.args.steps, timeout_s=30)
    new = receivers.pull_s[pulls_before:]
    phase.pulls = len(new)
    phase.pull_s_mean = statistics.mean(new) if new else 0.0
    phase.pull_errors = receivers.errors[:10]
    return phase


def loaded_phases(
    bench: Bench, publisher: Any, children: Children, run_dir: Path
) -> tuple[list[Phase], dict[str, Any]]:
    """Start the manager, the fleet and the receivers; stream; run the loaded phase (or,
    with --pairs, quiet and loaded phases in turn, the children staying up); stop them."""
    from polyrl.config import ManagerConfig
    from polyrl.launch.manager_process import ManagerProcess
    from polyrl.rollout.manager_link import ManagerLink

    args = bench.args
    manager = ManagerProcess(ManagerConfig(port=0, token=TOKEN), TOKEN, run_dir)
    link = stream = None
    info: dict[str, Any] = {}
    try:
        url = manager.start()
        link = ManagerLink(url, TOKEN)
        fleet = children.start(
            [
                "--role",
                "fleet",
                "--manager",
                url,
                "--slots",
                str(args.slots),
                "--token-delay-s",
                str(args.token_delay_s),
                "--chunk-tokens",
                str(args.chunk_tokens),
            ]
        )
        info["fleet_url"] = read_line(fleet, "the fake fleet", 60).split()[-1]
        import httpx

        httpx.post(f"{info['fleet_url']}/_fleet/join", json={"count": args.engines}, timeout=30).raise_for_status()
        wait_active(link, args.engines, timeout_s=60)
        receivers = Receivers(children, publisher, args.receivers)
        stream = Stream(link, args, num_lanes=_num_lanes(args))
        consumer = None
        if args.pairs and "elsewhere" in args.loads:
            consumer = children.start(
                [
                    "--role",
                    "consumer",
                    "--device",
                    args.device,
                    "--manager",
                    url,
                    "--prompts-per-batch",
                    str(args.prompts_per_batch),
                ]
            )
            if (line := read_line(consumer, "the consumer", 60)) != "ready":
                raise RuntimeError(f"consumer: {line}")
        isolate(args.isolate_cores)  # every child is running now
        renice_children(args.nice_children)
        if not args.pairs:
            time.sleep(args.ramp_s)  # every slot streaming, groups finishing
            phase = _loaded(bench, publisher, stream, receivers, "B loaded")
            t_end = time.perf_counter()
            info["ramp_tokens_per_s"] = stream.tokens_between(
                t_end - phase.window_s - args.ramp_s / 2, t_end - phase.window_s
            ) / (args.ramp_s / 2)
            return [phase], info
        phases = []
        default_interval = sys.getswitchinterval()
        variants = [(load, ms) for ms in args.switch_intervals_ms for load in args.loads]
        for i in range(args.pairs):  # the quiet phase, then the loaded one; a last quiet one closes
            load, interval_ms = variants[i % len(variants)]
            stream.quiet(timeout_s=60)
            sys.setswitchinterval(default_interval)
            profiled = i < args.profile_phases
            phases.append(bench.run_phase(f"A{i}", publisher, profiled=profiled))
            sys.setswitchinterval(interval_ms / 1000 if interval_ms else default_interval)
            if load in ("both", "stream"):
                stream.paused.clear()
            elif load == "elsewhere":
                consumer.stdin.write("go\n")  # type: ignore[union-attr]
                consumer.stdin.flush()  # type: ignore[union-attr]
            if load != "pulls":
                time.sleep(args.ramp_s)
            label = f"{load}@{interval_ms:g}ms" if interval_ms else load
            pulling = receivers if load in ("both", "pulls") else None
            phase = _loaded(bench, publisher, stream, pulling, f"B{i}:{label}", profiled)
            if load == "elsewhere":
                consumer.stdin.write("quiet\n")  # type: ignore[union-attr]
                consumer.stdin.flush()  # type: ignore[union-attr]
                tokens, seconds = read_line(consumer, "the consumer", 90).split()  # type: ignore[arg-type]
                phase.delivered_tokens = int(float(tokens) / float(seconds) * phase.window_s)
            phases.append(phase)
        sys.setswitchinterval(default_interval)
        stream.quiet(timeout_s=60)
        phases.append(bench.run_phase(f"A{args.pairs}", publisher))
        return phases, info
    finally:
        if stream is not None:
            stream.stop()
        if link is not None:
            link.close()  # ends the lanes' reads
        children.close()
        manager.stop()


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _pin(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` onto `cores` (threads started later inherit their creator's)."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            os.sched_setaffinity(int(task.name), cores)
        except OSError:  # the thread ended
            pass


def split_cores(n: int) -> tuple[set[int], set[int]]:
    """--isolate-cores: the trainer's process on the first `n` cores it may use, the rest for
    everything it started (manager, publisher, fleet, receivers)."""
    cores = sorted(os.sched_getaffinity(0))
    return set(cores[:n]), set(cores[n:])


def renice_children(n: int) -> None:
    """--nice-children: every thread of every process the trainer started runs at nice `n`
    (the learner's launch thread then gets a core first when the host is busy)."""
    if n <= 0:
        return
    for pid in _descendants(os.getpid()):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(task.name), n)
            except OSError:  # the thread ended
                pass


def isolate(n: int) -> None:
    if n <= 0:
        return
    mine, rest = split_cores(n)
    _pin(os.getpid(), mine)
    for pid in _descendants(os.getpid()):
        _pin(pid, rest)


def wait_active(link: Any, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(w.state == "active" for w in link.workers().workers) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} fake engines active after {timeout_s:.0f}s")
        time.sleep(0.2)


def summarize(phases: list[Phase]) -> dict[str, Any]:
    a1, b, a2 = phases
    alone = statistics.mean(a1.step_s + a2.step_s)
    loaded = statistics.mean(b.step_s)
    tokens_per_s = b.delivered_tokens / b.window_s
    alone_cpu_per_s = (a1.other_threads_cpu_s + a2.other_threads_cpu_s) / (a1.window_s + a2.window_s)
    return {
        "alone_step_s_mean": alone,
        "loaded_step_s_mean": loaded,
        "slowdown_pct": 100 * (loaded / alone - 1),
        "slowdown_median_pct": 100 * (statistics.median(b.step_s) / statistics.median(a1.step_s + a2.step_s) - 1),
        "drift_pct": 100 * (statistics.mean(a2.step_s) / statistics.mean(a1.step_s) - 1),
        "delivered_tokens_per_s": tokens_per_s,
        "other_threads_cpu_us_per_token": 1e6 * b.other_threads_cpu_s / max(b.delivered_tokens, 1),
        # what the A phases' other threads used (torch's, CUDA's) at the same rate, taken out
        "other_threads_cpu_us_per_token_net": 1e6
        * (b.other_threads_cpu_s - b.window_s * alone_cpu_per_s)
        / max(b.delivered_tokens, 1),
        "pulls": b.pulls,
        "pull_s_mean": b.pull_s_mean,
        "target_met": loaded <= 1.03 * alone and tokens_per_s >= 20000 and b.pulls >= 2 * len(b.step_s),
    }


def summarize_pairs(phases: list[Phase]) -> dict[str, Any]:
    """A0 B0 A1 B1 ... An: each B against the mean of the quiet phases on either side of
    it, so a drift of the host over the run cancels; the target is read on the median."""
    quiet, loaded = phases[0::2], phases[1::2]
    pair_pct = [
        100 * (statistics.mean(b.step_s) / statistics.mean(quiet[i].step_s + quiet[i + 1].step_s) - 1)
        for i, b in enumerate(loaded)
    ]
    alone = statistics.mean([t for p in quiet for t in p.step_s])
    under_load = statistics.mean([t for p in loaded for t in p.step_s])
    streaming = [b for b in loaded if ":pulls" not in b.name]
    window = sum(b.window_s for b in streaming)  # the rate of the phases that streamed
    tokens = sum(b.delivered_tokens for b in streaming)
    read_here = [b for b in streaming if ":elsewhere" not in b.name]  # the trainer's threads read the stream
    read_window, read_tokens = sum(b.window_s for b in read_here), sum(b.delivered_tokens for b in read_here)
    quiet_cpu_per_s = sum(p.other_threads_cpu_s for p in quiet) / sum(p.window_s for p in quiet)
    other_cpu = sum(b.other_threads_cpu_s for b in read_here)
    pulls = sum(b.pulls for b in loaded)
    median = statistics.median(pair_pct)
    by_load: dict[str, list[float]] = {}
    for b, pct in zip(loaded, pair_pct):
        by_load.setdefault(b.name.partition(":")[2] or "both", []).append(pct)
    return {
        "pair_slowdown_by_load_pct": by_load,
        "alone_step_s_mean": alone,
        "loaded_step_s_mean": under_load,
        "slowdown_pct": 100 * (under_load / alone - 1),
        "pair_slowdown_pct": pair_pct,
        "slowdown_pair_median_pct": median,
        "slowdown_median_pct": 100
        * (
            statistics.median([t for p in loaded for t in p.step_s])
            / statistics.median([t for p in quiet for t in p.step_s])
            - 1
        ),
        "drift_pct": 100 * (statistics.mean(quiet[-1].step_s) / statistics.mean(quiet[0].step_s) - 1),
        "delivered_tokens_per_s": tokens / max(window, 1e-9),
        "other_threads_cpu_us_per_token": 1e6 * other_cpu / max(read_tokens, 1),
        "other_threads_cpu_us_per_token_net": 1e6 * (other_cpu - read_window * quiet_cpu_per_s) / max(read_tokens, 1),
        "pulls": pulls,
        "pull_s_mean": statistics.mean([b.pull_s_mean for b in loaded]),
        "target_met": median <= 3
        and tokens / max(window, 1e-9) >= 20000
        and pulls >= 2 * sum(len(b.step_s) for b in loaded)
        and set(by_load) <= {"both"},
    }


def print_table(phases: list[Phase], summary: dict[str, Any]) -> None:
    print(
        f"\n{'phase':10} {'step mean s':>11} {'median':>8} {'min':>8} {'publish s':>9} {'tokens/s':>9} "
        f"{'pulls':>6} {'pull s':>7} {'other CPU s':>11}"
    )
    for p in phases:
        print(
            f"{p.name:10} {statistics.mean(p.step_s):11.4f} {statistics.median(p.step_s):8.4f} {min(p.step_s):8.4f} "
            f"{statistics.mean(p.publish_s):9.4f} {p.delivered_tokens / p.window_s:9.0f} {p.pulls:>6} "
            f"{p.pull_s_mean:7.3f} {p.other_threads_cpu_s:11.2f}"
        )
    s = summary
    if "pair_slowdown_pct" in s:
        print(
            f"\neach B against the A phases either side: {', '.join(f'{x:+.1f}%' for x in s['pair_slowdown_pct'])}; "
            f"median {s['slowdown_pair_median_pct']:+.2f}% (the target, <= 3%)"
        )
        for load, pcts in s["pair_slowdown_by_load_pct"].items():
            print(f"  load {load:>6}: {', '.join(f'{x:+.1f}%' for x in pcts)}; median {statistics.median(pcts):+.2f}%")
    print(
        f"\nloaded vs alone (mean of the A phases): {s['slowdown_pct']:+.2f}% (target <= 3%; medians "
        f"{s['slowdown_median_pct']:+.2f}%), A drift {s['drift_pct']:+.2f}%; "
        f"{s['delivered_tokens_per_s']:.0f} tokens/s of finished groups (target >= 20000); "
        f"{s['other_threads_cpu_us_per_token']:.2f} us of other threads' CPU per delivered token "
        f"({s['other_threads_cpu_us_per_token_net']:.2f} net of the A phases' rate)"
    )
    print(
        f"issue 21's target (<= 3% slower at >= 20k tokens/s, every version pulled twice): "
        f"{'met' if s['target_met'] else 'NOT met'}"
    )
    if "ramp_tokens_per_s" in s:
        print(f"the stream before the loaded phase: {s['ramp_tokens_per_s']:.0f} tokens/s")
    for p in phases:
        if p.profile:
            print(f"\nprofile of {p.name}: {p.profile}")
    for p in phases:
        for e in p.pull_errors + p.stream_errors:
            print(f"  ! {p.name}: {e}")


def machine() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "cpu_cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def trainer_main(args: argparse.Namespace) -> None:
    from polyrl.transfer.publisher import WeightPublisher

    t_start = time.perf_counter()
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(args.timeout_s)  # the handler raises in the main thread: the finally blocks run
    isolate(args.isolate_cores)
    bench = Bench(args)
    print(f"model built in {time.perf_counter() - t_start:.1f}s; warming up", flush=True)
    for _ in range(args.warmup):
        bench.step()
    publisher = WeightPublisher("127.0.0.1", 0, keep_versions=KEEP_VERSIONS).start()
    children = Children()
    try:
        isolate(args.isolate_cores)  # the publisher's process
        for _ in range(KEEP_VERSIONS + 1):  # every host buffer allocated: later versions reuse them
            bench.publish(publisher)
        with tempfile.TemporaryDirectory() as run_dir:
            if args.pairs:
                phases, info = loaded_phases(bench, publisher, children, Path(run_dir))
            else:
                a1 = bench.run_phase("A alone", publisher)
                print(f"A: {statistics.mean(a1.step_s):.4f}s a step", flush=True)
                loaded, info = loaded_phases(bench, publisher, children, Path(run_dir))
                print(f"B: {statistics.mean(loaded[0].step_s):.4f}s a step", flush=True)
                phases = [a1, loaded[0], bench.run_phase("A again", publisher)]
    finally:
        children.close()
        publisher.stop()
    summary = (summarize_pairs(phases) if args.pairs else summarize(phases)) | info
    print_table(phases, summary)
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if args.json:
        result = {
            "machine": machine(),
            "args": vars(args),
            "summary": summary,
            "loaded_info": info,
            "phases": [asdict(p) for p in phases],
            "total_s": time.perf_counter() - t_start,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))


def _out_of_time(signum: int, frame: Any) -> None:
    raise TimeoutError("the benchmark ran past --timeout-s; stopping every child process")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["trainer", "fleet", "receiver", "consumer"], default="trainer")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--json", help="write every number, the machine and the args here")
    for name in (
        "seqs",
        "prompt-tokens",
        "completion-tokens",
        "micro-batch-tokens",
        "steps",
        "warmup",
        "engines",
        "slots",
        "chunk-tokens",
        "new-tokens",
    ):
        p.add_argument(f"--{name}", type=int, help="default: per device, see DEFAULTS")
    p.add_argument("--token-delay-s", type=float, help="per token per fake sample")
    p.add_argument("--ramp-s", type=float, help="streaming before the loaded phase's timing starts")
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--prompts-per-batch", type=int, default=64, help="prompts (of 8 samples) in each streamed batch")
    p.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="N > 0: A0 B0 A1 ... AN with the children kept up (the stream paused and drained for each "
        "A), each B against the A phases either side; 0: A, B, A with no child in the A phases",
    )
    p.add_argument(
        "--loads",
        nargs="+",
        choices=["both", "stream", "pulls", "elsewhere"],
        default=["both"],
        help="with --pairs, the B phases take these loads in turn: both (the target's), the stream of "
        "finished groups only, the receivers' pulls only (the stream paused), or the same stream read "
        "by another process instead of the trainer's (the host as loaded, the trainer's process idle)",
    )
    p.add_argument(
        "--switch-intervals-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="with --pairs, the trainer's GIL switch interval in the B phases, taken in turn with --loads "
        "(0: Python's default, 5 ms); the A phases keep the default",
    )
    p.add_argument(
        "--profile-phases",
        type=int,
        default=0,
        help="with --pairs, the first N quiet and N loaded phases end with one more step, not counted, "
        "under torch.profiler: the GPU's idle time and what the host did in its largest gaps",
    )
    p.add_argument(
        "--isolate-cores",
        type=int,
        default=0,
        help="keep the trainer's process on this many cores and its children off them (0: no pinning)",
    )
    p.add_argument(
        "--nice-children",
        type=int,
        default=0,
        help="every process the trainer starts (the fake fleet and receivers, which stand for "
        "other machines, too) at this nice level",
    )
    p.add_argument("--timeout-s", type=int, default=330, help="the whole run; past it, children are killed")
    p.add_argument("--manager", help="(fleet and consumer roles)")
    p.add_argument("--publisher", help="host:port (receiver role)")
    p.add_argument("--worker-id", help="(receiver role)")
    args = p.parse_args()
    for key, value in DEFAULTS[args.device].items():
        if key != "model" and getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    if args.role == "fleet":
        fleet_main(args)
    elif args.role == "receiver":
        receiver_main(args)
    elif args.role == "consumer":
        consumer_main(args)
    else:
        trainer_main(args)


if __name__ == "__main__":
    main()
