"""A small Atropos environment that runs offline: polyrl's `copy` task (repeat a 2-4
letter word) scored by its partial-credit reward, served by polyrl's manager or a worker.

    python examples/atropos_env.py --api http://127.0.0.1:8000 \
        --inference http://127.0.0.1:5000/v1 --model init_model --tokenizer RUN_DIR/init_model \
        --token-file RUN_DIR/manager.json

It subclasses atroposlib's `BaseEnv` and talks to polyrl through atroposlib's own server
classes: `--server-type vllm` (the default) goes through its ManagedServer to vLLM's
`/generate`, which returns token ids and their log-probs, so the groups carry
`inference_logprobs`; `--server-type openai` calls `/v1/completions` with the official
client and tokenizes the returned text itself (no log-probs: the trainer then uses its
own). atroposlib's `tokenize_for_trainer` is not used: with transformers 5 it returns
wrong tokens.

Two traps of atroposlib 0.4.0 are avoided here: `config_init` returns a list of server
configs (a single one loses its `base_url`), and health checks are off (an unhealthy
server would make the environment wait forever instead of failing its requests).

It stops by itself, with one line: exit code 0 once the trainer has taken its last batch
(the API's step reaches the trainer's `num_steps`), 1 when the API is gone (a restarted
API forgets its environments too). atroposlib's own loop stops only once the API holds a
batch more than the trainer will take, which nothing fills once the trainer (and its
inference server) are gone: it logged an error per failed group until killed. A failing
inference server is one line here, and one when it answers again; its groups are tried
again (a resumed trainer brings the manager back on the same port).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from tenacity import RetryError

from polyrl.data.tasks import char_match_reward, get_task, task_record
from polyrl.preflight import shared_token

TASK = get_task("copy")
log = logging.getLogger("atropos_env")


class Stop(Exception):
    """Leaves atroposlib's `env_manager` loop, with the process's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def reason(e: BaseException) -> str:
    """The error behind atroposlib's retries (tenacity wraps the last attempt's)."""
    if isinstance(e, RetryError) and e.last_attempt.exception() is not None:
        e = e.last_attempt.exception()  # type: ignore[assignment]
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Outage:
    """A failing inference server: one line when it starts and one when it ends, where
    atroposlib logs an ERROR per failed group."""

    def __init__(self, url: str) -> None:
        self.url, self.num_failed = url, 0

    def failed(self, e: BaseException) -> None:
        if not self.num_failed:
            log.warning(
                "the inference server at %s fails (%s); groups are tried again until it answers", self.url, reason(e)
            )
        self.num_failed += 1

    def answered(self) -> None:
        if self.num_failed:
            log.info("the inference server at %s answers again (%d groups failed meanwhile)", self.url, self.num_failed)
            self.num_failed = 0


class CopyEnvConfig(BaseEnvConfig):
    inference_url: str = "http://127.0.0.1:5000/v1"
    model_name: str = "init_model"
    api_key: str = ""
    server_type: str = "vllm"
    temperature: float = 1.0
    max_new_tokens: int = 6
    seed: int = 1


class CopyEnv(BaseEnv):
    name = "polyrl_copy"
    env_config_cls = CopyEnvConfig

    def __init__(self, config: CopyEnvConfig, server_configs: list[APIServerConfig], **kwargs: Any) -> None:
        super().__init__(config, server_configs, **kwargs)
        self.num_items = 0
        self.outage = Outage(config.inference_url)

    @classmethod
    def for_args(cls, args: argparse.Namespace) -> CopyEnv:
        config = CopyEnvConfig(
            tokenizer_name=args.tokenizer,
            group_size=args.group_size,
            use_wandb=False,
            wandb_name="polyrl_copy",
            rollout_server_url=args.api,
            total_steps=-1,  # the trainer's num_steps, from the API
            max_num_workers=args.max_num_workers,
            max_batches_offpolicy=args.max_batches_offpolicy,
            steps_per_eval=10**9,
            max_token_length=args.max_token_length,
            ensure_scores_are_not_same=False,
            include_messages=False,
            inference_url=args.inference,
            model_name=args.model,
            api_key=args.api_key,
            server_type=args.server_type,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
        server = APIServerConfig(
            model_name=args.model,
            tokenizer_name=args.tokenizer,
            base_url=args.inference,
            api_key=args.api_key,
            server_type=args.server_type,
            health_check=False,
            timeout=120,
            num_max_requests_at_once=64,
        )
        return cls(config, [server])  # a list: a single config would lose its base_url

    async def setup(self) -> None:
        pass

    async def get_status(self) -> None:
        """atroposlib's poll of the API (three tries), each turn of its loop; then whether
        to stop."""
        try:
            await super().get_status()
        except Exception as e:
            raise Stop(f"the Atropos API at {self.config.rollout_server_url} is gone ({reason(e)}): stopping", 1) from e
        step, total = self.status_dict["current_step"], self.config.total_steps
        queued = self.status_dict["queue_size"] * self.config.group_size // self.config.batch_size
        if step >= total or step + queued > total:  # taken, or (atroposlib's own rule) queued
            raise Stop(
                f"the trainer's batches are all taken or queued (step {step} of {total}, {queued} more "
                "queued): stopping",
                0,
            )

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def get_next_item(self) -> dict[str, str]:
        record = task_record(TASK, self.config.seed, self.num_items)
        self.num_items += 1
        return record

    async def collect_trajectories(self, item: dict[str, str]) -> tuple[ScoredDataGroup | None, list]:
        """A scored group; when the inference server fails, none, and the item goes back
        to the backlog."""
        try:
            group = await self._scored_group(item)
        except Exception as e:
            self.outage.failed(e)
            return None, [item]
        self.outage.answered()
        return group, []

    async def _scored_group(self, item: dict[str, str]) -> ScoredDataGroup:
        if self.config.server_type == "openai":
            sequences = await self._sample_by_text(item["prompt"])
        else:
            sequences = await self._sample_by_tokens(item["prompt"])
        completions = [self._completion_text(tokens, masks, reason) for tokens, masks, _, reason in sequences]
        reasons = [reason for *_, reason in sequences]
        scores = char_match_reward(
            [item["prompt"]] * len(sequences), completions, [item["answer"]] * len(sequences), finish_reason=reasons
        )
        group = ScoredDataGroup(tokens=[s[0] for s in sequences], masks=[s[1] for s in sequences], scores=scores)
        if all(s[2] is not None for s in sequences):
            group["inference_logprobs"] = [s[2] for s in sequences]
        return group

    def _sampling(self) -> dict[str, Any]:
        return {
            "n": self.config.group_size,
            "max_tokens": self.config.max_new_tokens,
            "temperature": self.config.temperature,
        }

    async def _sample_by_tokens(self, prompt: str) -> list[tuple[list[int], list[int], list[float] | None, str]]:
        """ManagedServer over vLLM's /generate: token ids, masks and log-probs as sampled."""
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(prompt=prompt, **self._sampling())
            nodes = managed.get_state()["nodes"]
        return [
            (n.tokens, n.masked_tokens, n.logprobs, (n.metadata or {}).get("finish_reason", "length")) for n in nodes
        ]

    async def _sample_by_text(self, prompt: str) -> list[tuple[list[int], list[int], None, str]]:
        """OpenAI's /v1/completions: text only, tokenized here (the stop token is put back
        when the sample stopped, so the policy learns to end)."""
        completion = await self.server.completion(prompt=prompt, **self._sampling())
        prompt_ids = self.tokenizer(prompt).input_ids
        out = []
        for choice in completion.choices:
            ids = self.tokenizer(choice.text, add_special_tokens=False).input_ids
            if choice.finish_reason == "stop":
                ids = ids + [self.tokenizer.eos_token_id]
            out.append((prompt_ids + ids, [-100] * len(prompt_ids) + ids, None, choice.finish_reason))
        return out

    def _completion_text(self, tokens: list[int], masks: list[int], reason: str) -> str:
        """As polyrl's own scorer decodes: the final stop token dropped, other special tokens kept visible."""
        ids = [t for t, m in zip(tokens, masks) if m != -100]
        if reason == "stop" and ids and ids[-1] == self.tokenizer.eos_token_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


async def run(env: CopyEnv) -> int:
    """The environment until `get_status` stops it (before atroposlib's own check, whose
    condition it includes); its exit code."""
    try:
        await env.env_manager()
    except Stop as e:
        log.log(logging.INFO if e.code == 0 else logging.ERROR, "%s", e)
        return e.code
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--api", required=True, help="the Atropos API server, e.g. http://127.0.0.1:8000")
    p.add_argument("--inference", required=True, help="polyrl's manager or worker, with /v1 (http://HOST:PORT/v1)")
    p.add_argument("--model", default="init_model", help="the served model's name (its directory's name)")
    p.add_argument("--tokenizer", required=True, help="the model's local directory")
    p.add_argument("--token", help="polyrl's bearer token (default: $POLYRL_TOKEN; shown by ps: prefer --token-file)")
    p.add_argument("--token-file", help="a file holding it, e.g. RUN_DIR/manager.json (default: $POLYRL_TOKEN_FILE)")
    p.add_argument("--server-type", choices=["vllm", "openai"], default="vllm")
    p.add_argument("--group-size", type=int, default=8, help="= the trainer's rollout.n")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--max-token-length", type=int, default=256, help="prompt + completion limit of a sequence")
    p.add_argument("--temperature", type=float, default=1.0, help="= the trainer's rollout.temperature")
    p.add_argument("--max-num-workers", type=int, default=8, help="groups in flight at once")
    p.add_argument(
        "--max-batches-offpolicy",
        type=int,
        default=1,
        help="batches queued ahead of the trainer (each one a weight version older)",
    )
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    try:
        args.api_key = shared_token(args.token, args.token_file, "--token-file") or ""
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("atroposlib.envs.base").setLevel(logging.WARNING)  # it logs its status ten times a second
    return asyncio.run(run(CopyEnv.for_args(args)))


if __name__ == "__main__":
    sys.exit(main())
