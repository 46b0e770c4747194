"""Multi-turn episodes through one engine, with and without automatic prefix caching
(`engine.enable_prefix_caching`), in one run on the same model.

E episodes run at once, each T turns. Turn 1's prompt is the episode's own opening
(`--opening` tokens); every later turn's prompt is the whole history: the turns before,
the engine's replies as sampled (token ids, as an agent's client keeps them), and an
observation of `--observation` tokens from the environment. With `--group G`, episodes
come in groups of G that share their opening, as a GRPO step's `rollout.n` episodes of
one item (its system prompt and task) do. Replies are `--reply`
tokens (EOS ignored) at temperature 0, so both rows make the same tokens and their
agreement is checked. The turns run in lockstep: turn t+1 starts when every episode's
turn t is done, so each turn's prefill is counted apart.

Columns: prompt tokens submitted; prefill tokens computed (submitted minus those whose
KV the cache supplied, from the engine's counters); for turns 2+ the share of their
prompt tokens computed; generated tokens/s and wall time over all turns (prefill and
decode; the first run of each row compiles and captures, so each row runs twice and the
second is reported).

    python benchmarks/agentic.py [--preset tiny|qwen3-0.6b] [--episodes 256] [--turns 4] [--group 16] [--json PATH]
    # GPU: python benchmarks/agentic.py --device cuda --preset qwen3-0.6b --episodes 256 --turns 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_model, sync  # noqa: E402  (benchmarks/engine.py: the model presets)

from polyrl.config import EngineConfig  # noqa: E402
from polyrl.engine.engine import Engine  # noqa: E402
from polyrl.engine.types import EngineRequest  # noqa: E402
from polyrl.protocol.sampling import SamplingParams  # noqa: E402


def play(engine: Engine, args: argparse.Namespace, vocab: int) -> dict:
    """Every episode's turns in lockstep; returns the counts and the replies."""
    g = torch.Generator().manual_seed(0)
    openings = [torch.randint(3, vocab, (args.opening,), generator=g).tolist() for _ in range(args.episodes)]
    histories = [list(openings[e - e % args.group]) for e in range(args.episodes)]  # a group shares its opening
    observations = torch.randint(3, vocab, (args.turns, args.episodes, args.observation), generator=g).tolist()
    sampling = SamplingParams(max_new_tokens=args.reply, temperature=0.0, ignore_eos=True)
    blocks = engine.blocks
    turns, replies = [], []
    device = engine.device
    sync(device)
    t0 = time.perf_counter()
    for t in range(args.turns):
        hits_before = blocks.num_hit_tokens
        submitted = sum(len(h) for h in histories)
        for e, history in enumerate(histories):
            engine.add_request(EngineRequest(f"{t}-{e}", list(history), sampling))
        out: dict[str, list[int]] = {}
        while engine.has_work:
            for d in engine.step():
                out.setdefault(d.rid, []).extend(d.token_ids)
        hits = blocks.num_hit_tokens - hits_before
        turns.append({"turn": t + 1, "submitted": submitted, "computed": submitted - hits})
        for e in range(args.episodes):
            reply = out[f"{t}-{e}"]
            replies.append(reply)
            histories[e] = histories[e] + reply + observations[t][e]
    sync(device)
    wall = time.perf_counter() - t0
    generated = args.episodes * args.turns * args.reply
    later = turns[1:]
    return {
        "wall_s": wall,
        "generated_tok_s": generated / wall,
        "submitted": sum(r["submitted"] for r in turns),
        "computed": sum(r["computed"] for r in turns),
        "later_turns_computed_share": (
            sum(r["computed"] for r in later) / sum(r["submitted"] for r in later) if later else None
        ),
        "turns": turns,
        "replies": replies,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default=None, help="benchmarks/engine.py's (default: qwen3-0.6b on CUDA, tiny on CPU)")
    p.add_argument("--episodes", type=int, default=None, help="default: 256 on CUDA, 16 on CPU")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--opening", type=int, default=128, help="tokens of each episode's first prompt")
    p.add_argument(
        "--group",
        type=int,
        default=1,
        help="episodes that share their opening, as GRPO's rollout.n episodes of one item do (default 1: none)",
    )
    p.add_argument("--observation", type=int, default=32, help="tokens the environment adds each turn")
    p.add_argument("--reply", type=int, default=None, help="tokens per reply (default: 128 on CUDA, 32 on CPU)")
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.preset = args.preset or ("qwen3-0.6b" if gpu else "tiny")
    args.episodes = args.episodes or (256 if gpu else 16)
    args.reply = args.reply or (128 if gpu else 32)
    if args.group < 1 or args.episodes % args.group:
        p.error("--group must be at least 1 and divide --episodes")
    model = build_model(args.preset, device, torch.bfloat16 if gpu else torch.float32)
    vocab = model.config.vocab_size
    longest = args.opening + args.turns * (args.reply + args.observation)
    rows = {}
    for caching in (False, True):
        name = "prefix cache" if caching else "no cache"
        print(f"{name} ...", flush=True)
        engine = Engine(
            model,
            EngineConfig(
                max_num_seqs=args.episodes,
                max_num_batched_tokens=8192 if gpu else 2048,
                max_model_len=longest + 16,
                kv_cache_memory_fraction=0.4,
                enable_prefix_caching=caching,
            ),
        )
        play(engine, args, vocab)  # compiles, captures, warms the allocator; a cache it left is emptied
        engine.update_weights(None, version=1)
        rows[name] = play(engine, args, vocab)
        engine.sleep()
        del engine
    same = rows["no cache"]["replies"] == rows["prefix cache"]["replies"]
    agree = sum(
        a == b for x, y in zip(rows["no cache"]["replies"], rows["prefix cache"]["replies"]) for a, b in zip(x, y)
    ) / sum(len(x) for x in rows["no cache"]["replies"])
    machine = (
        torch.cuda.get_device_name(device)
        if gpu
        else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    ) + f", torch {torch.__version__}"
    print(
        f"\npreset {args.preset}, {args.episodes} episodes x {args.turns} turns in groups of {args.group}: "
        f"opening {args.opening}, "
        f"observation {args.observation}, reply {args.reply} tokens; {machine}"
    )
    print("| row | prompt tokens | prefill computed | turns 2+ computed | generated tok/s | wall s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        share = f"{r['later_turns_computed_share']:.1%}" if r["later_turns_computed_share"] is not None else "-"
        print(
            f"| {name} | {r['submitted']} | {r['computed']} | {share} | {r['generated_tok_s']:.0f} | {r['wall_s']:.2f} |"
        )
    speedup = rows["prefix cache"]["generated_tok_s"] / rows["no cache"]["generated_tok_s"]
    print(f"prefix cache / no cache: {speedup:.2f}x tokens/s; replies identical: {same} (token agreement {agree:.4f})")
    if args.json:
        out = {
            "machine": machine,
            "args": vars(args),
            "speedup": speedup,
            "token_agreement": agree,
            "rows": {k: {kk: vv for kk, vv in v.items() if kk != "replies"} for k, v in rows.items()},
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
