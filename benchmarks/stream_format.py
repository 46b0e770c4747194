"""Long generations through the manager: incremental stream chunks vs SGLang's cumulative
snapshots, with a real `polyrl worker` on a tiny model.

A cumulative snapshot repeats every token so far, so a sample of L tokens streamed one
step at a time costs O(L^2) bytes to encode, send and parse. polyrl workers announce
`incremental_stream` at registration and the manager asks for deltas; this measures
the end-to-end rate both ways in one run (alternating, `--repeats` each).

    python benchmarks/stream_format.py --new-tokens 1000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polyrl.config import ManagerConfig, TinyModelConfig
from polyrl.manager.main import ManagerThread
from polyrl.models.tiny import save_tiny_model
from polyrl.protocol.manager_api import BatchPrompt, BatchRequest
from polyrl.protocol.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(
            Path(tmp) / "model",
            TinyModelConfig(hidden_size=64, intermediate_size=128, max_position_embeddings=args.new_tokens + 64),
        )
        with ManagerThread(ManagerConfig(port=0, token="bench")) as mt:
            cmd = [
                sys.executable,
                "-m",
                "polyrl.cli",
                "worker",
                "--model",
                str(model),
                "--manager",
                mt.url,
                "--token",
                "bench",
                "--port",
                "0",
                "--worker-id",
                "w",
                f"engine.max_num_seqs={args.prompts * args.n}",
            ]
            worker = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 120
                while not any(w.state == "active" for w in mt.call(mt.manager.worker_list).workers):
                    if time.monotonic() > deadline or worker.poll() is not None:
                        raise RuntimeError("the worker did not become active")
                    time.sleep(0.2)
                rates: dict[str, list[float]] = {"incremental": [], "cumulative": []}
                for _ in range(args.repeats):
                    for mode in rates:
                        rates[mode].append(run_once(mt, args, incremental=mode == "incremental"))
            finally:
                worker.terminate()
                worker.wait(timeout=30)

    print(f"\n{args.prompts} prompts x {args.n} samples x {args.new_tokens} tokens, one tiny-model worker (CPU)")
    print(f"{'stream chunks':<14} {'tokens/s':>10}  runs")
    for mode, values in rates.items():
        print(f"{mode:<14} {statistics.median(values):>10.0f}  {', '.join(f'{v:.0f}' for v in values)}")
    speedup = statistics.median(rates["incremental"]) / statistics.median(rates["cumulative"])
    print(f"incremental / cumulative: {speedup:.2f}x")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "tokens_per_s": rates, "speedup": speedup}, indent=2)
        )


def run_once(mt: ManagerThread, args: argparse.Namespace, incremental: bool) -> float:
    def set_mode() -> None:
        record = mt.manager.registry.get("w")
        assert record is not None
        record.incremental_stream = incremental

    mt.call(set_mode)
    prompts = [BatchPrompt(id=str(i), input_ids=[1, 2, 3], seed=i) for i in range(args.prompts)]
    sampling = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, ignore_eos=True)
    request = BatchRequest(prompts=prompts, sampling=sampling)
    t0 = time.perf_counter()
    num_tokens = sum(len(s.output_ids) for g in mt.generate(request) for s in g.samples)
    return num_tokens / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
