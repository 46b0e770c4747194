"""Typed run configuration: TOML file + dotted CLI overrides, validated once at start.

Each component receives only its own section. Every error names the offending key, so
the CLI can print one line and exit 2 instead of a traceback.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from polyrl.protocol.sampling import SamplingParams

SwapPolicy = Literal["recompute", "continue", "abort"]
"""What an engine's weight update does to its running requests (`EngineConfig.swap_policy`)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Section):
    """Shape of the offline model built when `model.path` is not given."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must be divisible by num_heads, and num_heads by num_kv_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok must be at most num_experts")
        return self

    arch: Literal["qwen3", "qwen2", "llama", "qwen3_moe"] = "qwen3"
    """qwen3_moe: Qwen3-MoE's layers (every MLP a mixture of `num_experts` experts, each
    token routed to `num_experts_per_tok` of them, the weights renormalised over those
    as in Qwen3-30B-A3B)."""
    hidden_size: int = Field(96, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(192, ge=8)
    num_experts: int = Field(4, ge=1)
    """qwen3_moe only, as the three below."""
    num_experts_per_tok: int = Field(2, ge=1)
    moe_intermediate_size: int = Field(96, ge=8)
    max_position_embeddings: int = Field(256, ge=16)
    seed: int = 0
    chat_template: bool = False
    """Give the tokenizer a chat template (`polyrl.models.tiny.CHAT_TEMPLATE`), for chat
    endpoints and clients that apply one (Atropos' chat path). Off by default: with a
    template, `data.apply_chat_template`'s automatic mode wraps the tasks' prompts in it."""


class LoraConfig(_Section):
    """Train LoRA adapters instead of every weight (PEFT), and ship only them to workers
    (`polyrl.engine.lora`, README "LoRA")."""

    enabled: bool = False
    rank: int = Field(16, ge=1, le=4096)
    alpha: float = Field(32.0, gt=0)
    """The update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training. Keep 0 for RL: with dropout the
    training forward is not the policy the engine samples from."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """all-linear: every linear layer of the decoder (not the LM head); or module names'
    last parts, e.g. ["q_proj", "v_proj"]."""
    save_merged: bool = False
    """Also write the base with the final adapter merged in, as a plain HF model
    (RUN_DIR/final_model_merged); the final adapter is always RUN_DIR/final_model."""

    @model_validator(mode="after")
    def _names(self) -> LoraConfig:
        if isinstance(self.target_modules, list):
            if not self.target_modules:
                raise ValueError('target_modules is empty: name modules or use "all-linear"')
            bad = [m for m in self.target_modules if not m.replace("_", "a").isalnum()]
            if bad:
                raise ValueError(f'target_modules: {bad[0]!r} is not a module name (e.g. "q_proj")')
        return self


class ModelConfig(_Section):
    path: str | None = None
    """A local HF model directory. When empty, a tiny model for the task is built offline."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (autocast). Master weights and optimizer state stay float32."""
    tiny: TinyModelConfig = TinyModelConfig()
    lora: LoraConfig = LoraConfig()


class AtroposConfig(_Section):
    """The Atropos API server that `data.source = "atropos"` takes its groups from."""

    url: str | None = None
    """The API's base URL, e.g. http://127.0.0.1:8000 (`run-api --port 8000`)."""
    timeout_s: float = Field(10.0, gt=0)
    """Timeout of each HTTP call to the API."""
    poll_interval_s: float = Field(0.2, gt=0)
    """First wait between `/batch` polls that find no batch; doubles up to `max_poll_interval_s`."""
    max_poll_interval_s: float = Field(2.0, gt=0)
    unreachable_timeout_s: float = Field(300.0, gt=0)
    """How long the trainer keeps retrying an API that does not answer (it may be
    restarting) before the run fails."""
    batch_timeout_s: float = Field(0.0, ge=0)
    """A step fails if no batch arrives within this long (0: wait as long as it takes,
    as environments may be slow to start)."""
    max_token_len: int = Field(0, ge=0)
    """Told to the API at registration; 0: the model's max_position_embeddings."""
    wandb_group: str = "polyrl"
    wandb_project: str = "polyrl"

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError("not an http:// or https:// URL")
        return url

    @model_validator(mode="after")
    def _poll_bounds(self) -> AtroposConfig:
        if self.max_poll_interval_s < self.poll_interval_s:
            raise ValueError("max_poll_interval_s must not be below poll_interval_s")
        return self


SCORED_SOURCES = ("agent", "atropos")
"""Data sources whose groups arrive scored (an agent's episodes return their rewards, an
Atropos environment sends its scores): a run on one starts no reward functions."""


class DataConfig(_Section):
    source: Literal["local", "atropos", "agent"] = "local"
    """local: prompts from `task` (or `path`), generated by polyrl's rollout and scored by
    `reward`; atropos: scored groups from the Atropos API at `atropos.url` (its
    environments generate through polyrl's manager or workers and score themselves);
    agent: multi-turn episodes played by `agent` on the records of `path`."""
    atropos: AtroposConfig = AtroposConfig()
    agent: str | None = None
    """data.source = "agent": `module:function`, an async function (client, item) -> reward
    that plays one episode. `client` has `openai.AsyncOpenAI`'s chat interface
    (`polyrl.agent.client`), `item` is one record of `path`; `rollout.n` episodes per item
    make a GRPO group, each trained on as one sequence (README, "Agent episodes")."""
    agent_max_turns: int = Field(8, ge=1)
    """Engine calls per episode; one more raises `polyrl.agent.EpisodeLimit` in the function."""
    agent_max_tokens: int | None = Field(None, ge=2)
    """Tokens per episode, prompt, replies and the environment's all counted (default: the
    workers' context, `engine.max_model_len` or the model's); a call's reply is cut to fit,
    and a call with no room left raises `EpisodeLimit`."""
    agent_tool_parser: Literal["hermes", "none"] = "hermes"
    """How tool calls are read from a reply's text (`polyrl.agent.tool_calls`): hermes is
    Qwen2.5/Qwen3's `<tool_call>{json}</tool_call>`; none leaves every reply as text."""
    task: str = "copy"
    """A built-in synthetic task (see `polyrl.data.tasks`), or `dataset` to read `path`."""
    path: str | None = None
    """Local parquet/jsonl/json/csv file read through `datasets` (when task = "dataset")."""
    format: Literal["auto", "gsm8k", "openr1", "plain"] = "auto"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    prompt_template: str = "{prompt}"
    apply_chat_template: bool | None = None
    """None: apply the tokenizer's chat template when it has one."""
    max_prompt_tokens: int = Field(512, ge=1)
    max_new_tokens_key: str | None = None
    """A column of `path` that gives each prompt its own generation budget (a positive
    integer, capped by `rollout.max_new_tokens`; the column is not passed to rewards).
    Unset: every prompt gets `rollout.max_new_tokens`."""

    @model_validator(mode="after")
    def _budget_column_needs_a_file(self) -> DataConfig:
        if self.max_new_tokens_key is not None and self.task != "dataset":
            raise ValueError(f"data.max_new_tokens_key needs data.task = 'dataset' (got {self.task!r})")
        if self.source == "agent" and (not self.agent or ":" not in self.agent):
            raise ValueError("data.source = 'agent' needs data.agent = 'module:function' (the episode function)")
        if self.source == "agent" and not self.path:
            raise ValueError("data.source = 'agent' needs data.path: the items, one episode's input per record")
        return self


class OverlongBufferConfig(_Section):
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`): a sample
    whose length falls within the last `len` tokens of its budget (`rollout.max_new_tokens`,
    or the prompt's own) loses up to `penalty_factor` of reward, linearly: 0 at
    budget - len tokens, `penalty_factor` at the budget."""

    enable: bool = False
    len: int = Field(4, ge=1)
    """Tokens before the budget where the penalty ramps up (DAPO used 4096 of 20480)."""
    penalty_factor: float = Field(1.0, ge=0)


class RewardConfig(_Section):
    functions: list[str] = []
    """`module:function` paths, TRL convention fn(prompts, completions, **columns) -> list[float].
    Empty: the task's own reward."""
    weights: list[float] | None = None
    num_workers: int = Field(1, ge=1)
    timeout_s: float = Field(10.0, gt=0)
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()

    @model_validator(mode="after")
    def _weights_match(self) -> RewardConfig:
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(
                f"reward.weights has {len(self.weights)} entries but reward.functions has {len(self.functions)}"
            )
        return self


class RolloutConfig(_Section):
    mode: Literal["local", "remote", "hybrid"] = "remote"
    """local: the trainer's own engine on its own weights (colocated baseline); remote:
    every sample from rollout workers through the manager (the trainer's engine only when
    no worker is left); hybrid: the trainer's engine also generates while workers sync
    each new version, then hands its unfinished samples to them."""
    hybrid_max_window_s: float = Field(30.0, gt=0)
    """Hybrid, window until "synced": the local window never stays open longer than this
    (its usual length follows the measured sync time of the fleet)."""
    hybrid_local_until: Literal["auto", "synced", "learner", "idle", "always"] = "auto"
    """Hybrid: how long the trainer's engine generates each step. synced: only while the
    workers sync the new version (then its samples move to them); learner: as a peer of
    the workers, with its share of the batch, until the learner starts. auto: learner
    when the trainer is on CUDA (its GPU would idle until then), synced on CPU (where the
    local engine takes the cores the workers and the learner need) and when
    `max_staleness` > 0 (the learner keeps the trainer's GPU busy: no idle time to fill).
    With `fully_async` only: idle: while the learner waits, for the groups it waits for;
    always: all the time, beside the learner, as one more worker taking what the remote
    workers have no slot for (its batch is `engine.max_num_seqs`): for a fleet slower than
    the learner; it slows the learner (README, "Fully asynchronous training"). auto with
    fully_async: idle."""
    max_staleness: int = Field(0, ge=0, le=4)
    """0: on-policy, each step's batch is generated after the previous step's update. k > 0
    (remote and hybrid): the batches of the next k steps are submitted ahead, so workers
    generate them while the learner trains, with weights up to k versions old. The loss's
    truncated importance weight (algo.rollout_correction) corrects for the lag; every token carries
    its version. Resuming repeats the batches that were in flight, with the saved weights.
    With `fully_async`: no token the learner trains on is more than k versions older than
    the weights it updates (admission control plus a deadline, see `fully_async`)."""
    fully_async: bool = False
    """Remote and hybrid: the fleet never drains. Up to (max_staleness + 1) steps' worth of
    prompts stay in flight; each step trains on the first `train_batch_size` groups to
    finish, whatever step submitted them; workers take each new version between two decode
    steps and keep their running samples, which continue under the new weights (a sample
    may span versions; each token keeps its own). A group whose oldest token would lag more
    than max_staleness versions at the next update is trained on now, waited for if need
    be (`async/due_groups`). Needs max_staleness >= 1 (README, "Fully asynchronous
    training")."""
    async_admission: Literal["bound", "fresh"] = "bound"
    """With `fully_async`, what the trainer submits after each update. bound: prompts up to
    (max_staleness + 1) steps' worth in flight (AReaL's rule). fresh: the same, but nothing
    while a step's worth of finished groups already waits for the learner: where the fleet
    is faster than the learner, groups then wait less before they are trained on (lower
    `rollout/version_lag/mean`) and the fleet idles instead (`async/admission_paused`)."""
    n: int = Field(16, ge=1)
    """Samples per prompt (the GRPO group size)."""
    max_new_tokens: int = Field(6, ge=1)
    max_new_tokens_schedule: list[tuple[int, int]] = []
    """A length curriculum, [[step, tokens], ...]: from `step` on, samples get at most
    `tokens` (ThinkPrune's shrinking budgets, DeepScaleR's growing ones). `max_new_tokens`
    stays the most any step gets, which the engines plan for. Empty: `max_new_tokens`
    every step."""
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, lt=2**63)
    """0 disables top-k."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Sample only tokens at least min_p times as likely as the most likely one (vLLM's and
    SGLang's min_p). 0 disables it. Log-probs are those of the untruncated distribution,
    for the engines and the learner alike (README, "Log-probs")."""
    ignore_eos: bool = False
    """Generate every sample to its budget (`max_new_tokens`, or the prompt's own), past the
    model's end-of-sequence tokens (vLLM's and SGLang's `ignore_eos`): for benchmarks that
    need known lengths, such as `benchmarks/spot_gpu.py`'s learning rows."""
    deterministic: bool = False
    """Remote and hybrid: two runs with the same seed and config train on the same data in
    the same order, so they give the same losses and (on CPU) bit-identical weights. The
    learner takes a step's groups in submission order (a group that finishes early waits
    for those before it) instead of completion order, and CPU engines that the run starts
    compute in float64 with logits rounded to 2**-20 (`engine.dtype = "auto"` becomes
    float64), so a sample's log-probs do not depend on the batch it shared a step with.
    Cost: the default main job's median step +1.6% on 2 CPU cores (within noise); a
    float64 engine alone is 1.8x slower, and waiting in order costs more when completion
    times spread (long generations). On GPUs the data repeats but the kernels' bits do
    not (README, "Reproducible runs"). Local mode is reproducible without it."""

    def budget_at(self, step: int) -> int:
        """The generation budget of step `step`'s samples (`max_new_tokens_schedule`)."""
        budget = self.max_new_tokens
        for start, tokens in self.max_new_tokens_schedule:
            if step >= start:
                budget = tokens
        return budget

    def local_window(self, on_cuda: bool) -> str:
        """`hybrid_local_until` with `auto` resolved, for a trainer on CUDA or not; `off`
        outside hybrid mode (the manager's `local_window`)."""
        if self.mode != "hybrid":
            return "off"
        if self.fully_async:
            # auto: the trainer's engine fills the learner's waits only. `always` (beside
            # the learner) helps where the fleet is the bottleneck (one H100 split by MPS:
            # it made 47% of the tokens) and costs where the learner is (2 H200s: the spot
            # idled 30% of the time while the learner's updates took 1.5x as long per
            # token); see BENCHMARKS.md.
            return "idle" if self.hybrid_local_until == "auto" else self.hybrid_local_until
        if self.hybrid_local_until == "auto":
            return "learner" if on_cuda and not self.max_staleness else "synced"
        return self.hybrid_local_until

    def sampling(self, stop_token_ids: Sequence[int]) -> SamplingParams:
        """How the run's samples are drawn: these settings, ending on `stop_token_ids`
        (the EOS tokens the run wants; the model's own are not added), or on none with
        `ignore_eos`."""
        return SamplingParams(
            n=self.n,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop_token_ids=() if self.ignore_eos else tuple(stop_token_ids),
            ignore_eos=True,
        )

    @model_validator(mode="after")
    def _staleness_needs_workers(self) -> RolloutConfig:
        if self.fully_async:
            if self.mode == "local":
                raise ValueError(
                    "rollout.fully_async needs rollout.mode remote or hybrid: local rollout samples with the "
                    "learner's own weights, so generation cannot go on while it trains"
                )
            if self.deterministic:
                raise ValueError(
                    "rollout.fully_async and rollout.deterministic exclude each other: each step trains on the "
                    "groups that finish first, and samples take new weights mid-generation, so two runs cannot "
                    "see the same data"
                )
            if self.hybrid_local_until in ("synced", "learner"):
                raise ValueError(
                    f"rollout.hybrid_local_until={self.hybrid_local_until} needs the step-synchronous loop; with "
                    "rollout.fully_async use auto, idle or always"
                )
            if not self.max_staleness:
                raise ValueError(
                    "rollout.fully_async needs rollout.max_staleness >= 1: the versions a token may lag behind "
                    "the weights it trains (0 would wait for every response, as the synchronous loop does; try 2)"
                )
        steps = [start for start, _ in self.max_new_tokens_schedule]
        if steps != sorted(set(steps)) or any(start < 1 for start in steps):
            raise ValueError(f"rollout.max_new_tokens_schedule: steps must rise from 1 or more (got {steps})")
        if any(not 1 <= tokens <= self.max_new_tokens for _, tokens in self.max_new_tokens_schedule):
            raise ValueError(
                f"rollout.max_new_tokens_schedule: budgets must lie in 1..rollout.max_new_tokens ({self.max_new_tokens})"
            )
        if self.max_new_tokens_schedule and self.fully_async:
            raise ValueError(
                "rollout.max_new_tokens_schedule needs the step-synchronous loop: with rollout.fully_async a "
                "sample belongs to no one step"
            )
        if self.async_admission != "bound" and not self.fully_async:
            raise ValueError(f"rollout.async_admission={self.async_admission} is for rollout.fully_async")
        if self.hybrid_local_until in ("idle", "always") and not self.fully_async:
            raise ValueError(
                f"rollout.hybrid_local_until={self.hybrid_local_until} is for rollout.fully_async; the "
                "step-synchronous loop takes auto, synced or learner"
            )
        if self.max_staleness and self.mode == "local":
            raise ValueError(
                f"rollout.max_staleness ({self.max_staleness}) needs rollout.mode remote or hybrid: local rollout "
                f"samples with the learner's own weights, so nothing can be generated ahead of an update"
            )
        if self.max_staleness and self.deterministic:
            raise ValueError(
                f"rollout.deterministic needs rollout.max_staleness = 0 (got {self.max_staleness}): a batch "
                f"generated ahead takes whichever weight version a worker holds when it runs"
            )
        return self


class EngineConfig(_Section):
    """The embedded continuous-batching engine (workers and the trainer's local rollout)."""

    @model_validator(mode="after")
    def _fp8_needs_a_gpu(self) -> EngineConfig:
        for key in ("weight_dtype", "kv_cache_dtype"):
            if getattr(self, key) == "fp8" and (self.device == "cpu" or self.dtype in ("float32", "float64")):
                raise ValueError(
                    f"engine.{key} = 'fp8' needs a CUDA engine computing in bfloat16 "
                    f"(engine.device = {self.device!r}, engine.dtype = {self.dtype!r})"
                )
        if self.attention_backend == "cuda" and self.device == "cpu":
            raise ValueError("engine.attention_backend = 'cuda' needs a CUDA engine (engine.device = 'cpu')")
        return self

    block_size: int = Field(16, ge=1)
    """Tokens per KV-cache block."""
    num_kv_blocks: int = Field(0, ge=0)
    """0: sized automatically (CUDA: `kv_cache_memory_fraction` of free memory, at most
    twice what `max_num_seqs` full-length sequences take; CPU: enough for `max_num_seqs`
    full-length sequences, capped at `cpu_kv_cache_gib`)."""
    kv_cache_memory_fraction: float = Field(0.5, gt=0, le=0.95)
    cpu_kv_cache_gib: float = Field(2.0, gt=0)
    max_num_seqs: int = Field(256, ge=1)
    """Sequences decoded together (the running batch)."""
    max_num_batched_tokens: int = Field(2048, ge=16)
    """Token budget of one step: decode tokens first, then prefill chunks."""
    max_model_len: int = Field(0, ge=0)
    """Prompt + completion limit; 0: the model's max_position_embeddings."""
    max_queued_requests: int = Field(4096, ge=1)
    """Requests waiting beyond this are refused (HTTP 429)."""
    swap_policy: SwapPolicy = "recompute"
    """What a weight update does to requests in flight (see README, "Weight hot-swap")."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching (vLLM's option of the same name): a request whose tokens
    start with full blocks another request computed under the same weights reuses their
    KV instead of computing it (a conversation's next turn, a shared system prompt, a
    preempted sequence coming back). A new weight version empties the cache."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """auto: bfloat16 on CUDA, float32 on CPU (float64 for engines that a
    `rollout.deterministic` run starts on CPU). A float64 engine rounds its logits to
    2**-20 before sampling: a sample's log-probs are then the same whatever batch computed
    them (float32 matmuls round differently with the number of rows)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """vLLM's option. auto: the engine's `dtype`. fp8: keys and values are stored as e4m3
    with a float32 scale per token and KV head (set when the token is written, so no
    calibration), and read back by the attention kernels: about twice the tokens in the
    same memory. At 512 x 1024 on an H200 it was 1.29-1.33x bf16 with both caches holding
    the batch, and more where the bf16 cache cannot hold it (README, "The generation
    engine"). Same requirements as `weight_dtype = "fp8"`."""
    weight_dtype: Literal["auto", "fp8"] = "auto"
    """auto: the engine's `dtype`. fp8: the decoder layers' projections multiply in FP8
    (e4m3, a scale per output channel, activations scaled per token), quantized again
    from each version the engine receives; the trainer is unchanged, and the behaviour
    log-probs are the FP8 model's (`polyrl/engine/fp8.py`). Needs a CUDA GPU of compute
    capability 8.9+ (Ada, Hopper) and bfloat16 compute; anything else is refused."""
    attention_backend: Literal["auto", "triton", "cuda"] = "triton"
    """SGLang's and vLLM's option, for the decode steps' attention over the paged cache.
    triton: the engine's Triton kernel (`polyrl/engine/triton_ops.py`). cuda: its CUDA C++
    kernel (`polyrl/engine/cuda_ops.py`), compiled by NVRTC when the engine starts; it
    serves head size 128, up to 8 query heads a KV head and bf16 or FP8 caches, and the
    engine refuses to start where it cannot. auto: cuda where it can serve the model, else
    triton. Prefills and CPU engines use neither. The CUDA kernel has not yet been run on
    a GPU (README, `cuda_ops.py`), hence the default."""
    moe_runner_backend: Literal["auto", "model"] = "auto"
    """SGLang's option, for a mixture of experts. auto: on CUDA (with Triton) the decode
    step runs the experts as the engine's Triton kernels (routing, grouping by expert and
    the expert GEMMs with SwiGLU fused; `polyrl/engine/fused_moe.py`), and prefill chunks
    of more than 16384 token-expert pairs as the model's own blocks; model: always the
    model's own blocks (transformers' experts implementation)."""
    cuda_graphs: bool = True
    """On CUDA (with Triton), replay decode steps as CUDA graphs with the Triton paged-attention
    kernel; off: every step runs eagerly on the PyTorch path (for debugging)."""
    overlap_decode: Literal["auto", "on", "off"] = "auto"
    """Launch each decode step before reading the previous one back, feeding its sampled
    tokens on the device, so host scheduling hides behind the GPU. auto: on for CUDA."""
    admit_wait_steps: int = Field(16, ge=0)
    """With the overlapped decode: overlapped decode steps a waiting request may wait
    before a busy batch stops to admit it. Admitting breaks the chain of captured decode
    steps for one eager step that also prefills; a worker kept topped up (a new request
    for each one that finishes) would otherwise pay that on almost every step, about 40%
    of its throughput on an H100. The idea is TGI's `max_waiting_tokens`. 0: admit at once."""
    admit_batch: int = Field(8, ge=1)
    """Samples waiting that are admitted at once, without `admit_wait_steps`; a batch
    with fewer than this many running sequences also admits at once."""


def is_none_word(value: Any) -> bool:
    """None, or how a command line or TOML file spells it (TOML has no null)."""
    return value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))


class RolloutCorrectionConfig(_Section):
    """Correction for the gap between the engine's behaviour policy (pi_rollout) and the
    trainer's proximal policy (pi_old): importance weights (IS) and rejection sampling (RS)
    on the ratio rho = pi_old / pi_rollout, named as verl's `algorithm.rollout_correction`
    (docs/algo/rollout_corr.md there; Liu, Li et al. 2025, "When Speed Kills Stability",
    https://richardli.xyz/rl-collapse). Formulas: `polyrl/trainer/rollout_correction.py`.

    One departure from verl: polyrl's default keeps its earlier token-level truncated IS at
    2.0 (verl's default is none)."""

    @model_validator(mode="after")
    def _rs_band(self) -> RolloutCorrectionConfig:
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            raise ValueError(
                f"algo.rollout_correction.rollout_rs={self.rollout_rs!r} needs "
                "algo.rollout_correction.rollout_rs_threshold (the band's upper bound)"
            )
        upper, lower = self.rollout_rs_threshold, self.rollout_rs_threshold_lower
        if upper is not None and lower is not None and lower > upper:
            raise ValueError(
                f"algo.rollout_correction.rollout_rs_threshold_lower={lower} is above "
                f"algo.rollout_correction.rollout_rs_threshold={upper}"
            )
        return self

    @field_validator("rollout_rs", mode="before")
    @classmethod
    def _none_from_cli(cls, value: Any) -> Any:
        """TOML has no null: `rollout_rs=none` (or "null") on the command line is None."""
        return None if is_none_word(value) else value

    @field_validator("rollout_is", mode="before")
    @classmethod
    def _is_off(cls, value: Any) -> Any:
        """None (verl's null), "null" or "none" are stored as "none": a None would not survive
        a saved config (`save_config` drops them), and "token" is the default."""
        return "none" if is_none_word(value) else value

    rollout_is: Literal["token", "sequence", "none"] = "token"
    """Importance weight of each token (rho_t) or of its whole sequence (prod_t rho_t,
    broadcast over its tokens), truncated at `rollout_is_threshold`; "none" (or null): no weight."""
    rollout_is_threshold: float = Field(2.0, gt=0)
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Drop from the loss the tokens (token), or whole sequences (sequence: prod_t rho_t;
    geometric: exp(mean_t log rho_t)), whose ratio leaves [rollout_rs_threshold_lower,
    rollout_rs_threshold]; None: drop nothing."""
    rollout_rs_threshold: float | None = Field(None, gt=0)
    rollout_rs_threshold_lower: float | None = Field(None, gt=0)
    """None: 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float | None = Field(None, gt=0)
    """Drop a whole sequence when any of its tokens has rho_t below this (e.g. 1e-4)."""


class FilterGroupsConfig(_Section):
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups`): a group whose rewards
    are all equal has no advantage to learn from, so it is dropped, and the trainer asks for
    more prompts (rounds of `trainer.train_batch_size`) until the step has
    `train_batch_size` groups with a reward spread. Once it has them, the rest of the round
    is cancelled; its prompts are used up (the data cursor moves past them)."""

    enable: bool = False
    metric: Literal["seq_final_reward", "seq_reward"] = "seq_final_reward"
    """What must vary within a group. Both of verl's names mean the sample's reward here
    (with any overlong penalty; polyrl puts no KL term into rewards); verl's `acc` has no
    counterpart (rewards are not split into an accuracy)."""
    max_num_gen_batches: int = Field(10, ge=0)
    """Rounds of generation a step may take, the first included; at the cap the step
    trains on the groups it has (fewer) and logs why. 0: no cap (verl's 0)."""


class GiGPOConfig(_Section):
    """Group-in-group advantages for multi-call agent episodes (Feng et al. 2025, "Group-in-
    Group Policy Optimization for LLM Agent Training"; verl-agent's `algorithm.gigpo`),
    used with `algo.adv_estimator = "gigpo"`."""

    step_advantage_w: float = Field(1.0, ge=0)
    """Weight of the step-level advantage added to the episode's. A call's step group is
    the calls of the same GRPO group that saw exactly the same context (token for token),
    so the calls that follow one tool answer are compared with each other rather than with
    episodes that never got there; a call whose context no other episode shares adds 0.
    Normalised by the step group's std when `algo.norm_adv_by_std` (verl-agent's
    `gigpo.mode`: true is mean_std_norm, false mean_norm)."""


class AlgoConfig(_Section):
    @model_validator(mode="before")
    @classmethod
    def _tis_cap_is_token_is(cls, data: Any) -> Any:
        """`tis_cap` (kept from before `rollout_correction`) is shorthand: c > 0 is
        rollout_is="token" with rollout_is_threshold=c, 0 is rollout_is="none". Written into
        `rollout_correction` here, so a saved config reloads the same; set both ways, they
        must agree."""
        if not isinstance(data, dict) or data.get("tis_cap") is None:
            return data
        cap = float(data["tis_cap"])
        rc = data.get("rollout_correction") or {}
        given = rc.model_dump(exclude_unset=True) if isinstance(rc, BaseModel) else dict(rc)
        implied: dict[str, Any] = (
            {"rollout_is": "token", "rollout_is_threshold": cap} if cap > 0 else {"rollout_is": "none"}
        )
        for key, value in implied.items():
            if key in given and ("none" if is_none_word(given[key]) else given[key]) != value:
                raise ValueError(
                    f"algo.tis_cap={data['tis_cap']} contradicts algo.rollout_correction.{key}={given[key]!r}: "
                    "tis_cap=c is rollout_is='token' with rollout_is_threshold=c (0: rollout_is='none'); set only one"
                )
        return {**data, "rollout_correction": {**given, **implied}}

    @model_validator(mode="after")
    def _correction_has_a_gap(self) -> AlgoConfig:
        rc = self.rollout_correction
        chosen = [
            f"rollout_correction.{key}"
            for key, is_on in (
                ("rollout_is='sequence'", rc.rollout_is == "sequence"),
                ("rollout_rs", rc.rollout_rs is not None),
                ("rollout_token_veto_threshold", rc.rollout_token_veto_threshold is not None),
            )
            if is_on
        ]
        if chosen and not self.recompute_old_logprobs:
            raise ValueError(
                f"algo.{chosen[0]} compares the trainer's old log-probs with the engine's, but with "
                "algo.recompute_old_logprobs=false the engine's serve as the old ones: it would do nothing"
            )
        return self

    adv_estimator: Literal["grpo", "gigpo", "turn_grpo"] = "grpo"
    """verl's `algorithm.adv_estimator`. grpo: one advantage per sequence from its group.
    gigpo: for agent episodes of several calls, each call's tokens also get a step-level
    advantage from the calls that saw the same context (`algo.gigpo`). A first call's
    context is its group's prompt, so single-call groups get (1 + step_advantage_w)
    times GRPO's advantage, as in GiGPO. turn_grpo: for agent episodes whose function
    rewards each call (it returns a list, README "Agent episodes"), call k's tokens get
    GRPO's advantage of its return among the group's k-th calls; an episode that returns
    one number gives it to its last call. `trainer/step_groups.py`."""
    gamma: float = Field(1.0, ge=0, le=1)
    """verl's `algorithm.gamma`; with turn_grpo, a call's return is its reward plus gamma
    times the next call's return (1: everything after it counts, as when a tool call
    earns only through the answer it enables; 0: its own reward only)."""
    gigpo: GiGPOConfig = GiGPOConfig()
    norm_adv_by_std: bool = True
    """False gives Dr.GRPO's unnormalised group advantage."""
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.28, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = Field(0.003, ge=0)
    """A small bonus keeps a from-scratch tiny model exploring; use 0 for pretrained models."""
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"
    """Mixture-of-experts models (verl's `router_replay.mode`; `trainer/router_replay.py`).
    R2 replays, in every training forward, the experts each token went through in the
    proximal (old log-prob) forward, so that the PPO ratio compares the same sub-network;
    it acts from `ppo_epochs = 2` on. R3 replays the rollout engine's experts in every
    forward of the learner (the proximal one too), so the learner's policy is the one
    that sampled, however an update moved the routers (engines report them with
    `return_routed_experts`, through migrations too). Logged:
    `actor/router_replay_changed_frac`."""
    router_aux_loss_coef: float = Field(0.0, ge=0)
    """Mixture-of-experts models: the weight of Switch Transformer's load-balancing loss
    (transformers' name; `trainer/router_aux.py`), logged as `actor/router_aux_loss`. 0:
    off, as RL recipes mostly run; dense models ignore it."""
    recompute_old_logprobs: bool = True
    """Recompute old log-probs with the trainer before each mini-batch's update (the proximal
    policy); otherwise the engine's behaviour log-probs serve as the old ones."""
    policy_loss: Literal["vanilla", "gspo", "cispo"] = "vanilla"
    """verl's `policy_loss.loss_mode` names. vanilla: PPO's clipped surrogate per token;
    gspo: the sequence's length-normalised ratio, clipped per sequence (Zheng et al. 2025,
    wants clip ratios ~3e-4 / 4e-4); cispo: REINFORCE weighted by the clipped, detached
    ratio (MiniMax-M1, 2025). All use clip_ratio_low / clip_ratio_high (`trainer/grpo.py`)."""
    tis_cap: float | None = Field(None, ge=0)
    """Shorthand kept from before `rollout_correction`: truncated importance weight
    min(exp(old - behaviour), tis_cap) per token, i.e. rollout_correction.rollout_is="token"
    with rollout_is_threshold=tis_cap; 0 turns it off. Unset: rollout_correction decides
    (by default the same token weight capped at 2.0)."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    filter_zero_variance_groups: bool = False
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    overlong_filter: bool = False
    """DAPO's overlong filtering: samples cut at their length budget (finish reason
    "length") are left out of the loss; they still count in their group's advantages."""
    ppo_epochs: int = Field(1, ge=1)


class TrainerConfig(_Section):
    total_steps: int = Field(150, ge=1)
    train_batch_size: int = Field(64, ge=1)
    """Prompts per step."""
    ppo_mini_batch_size: int = Field(32, ge=1)
    """Prompts per optimizer step."""
    micro_batch_max_tokens: int = Field(4096, ge=16)
    lr: float = Field(1e-3, gt=0)
    """The default suits the tiny from-scratch model; pretrained LLMs want ~1e-6."""
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(5, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int = Field(0, ge=0)
    """torch intra-op threads of a CPU learner; 0: up to one per core, fewer while other
    processes keep cores busy (`polyrl/cpu_threads.py`; metric `perf/cpu_threads`), except
    in local mode and with `rollout.deterministic`, whose bits must not depend on it (they
    keep torch's count)."""
    save_every: int = Field(50, ge=0)
    """Checkpoint every K steps (and always at the end); 0 saves only at the end."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them: less memory for longer micro-batches, at the cost of about one more forward."""
    learner_impl: Literal["auto", "packed", "padded"] = "auto"
    """packed: micro-batches filled by tokens into one padding-free row, log-probs straight
    from the hidden states chunk by chunk (trainer/packing.py, lm_head.py); padded: one row
    per sequence and full logits, the earlier path (kept as the baseline). auto: packed on
    CUDA with 16-bit compute (fused varlen or flex attention); padded on CPU and for float32
    on CUDA, where packed attention is an exact loop of one attention call per
    sequence, which costs more than the padding it saves on short sequences (the default
    main job's learner: 0.66 s a step packed, 0.27 s padded, on 2 cores)."""
    packed_attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """How packed attention keeps to each sequence. auto: torch's varlen flash attention for
    bf16 on CUDA (flex if torch lacks it), else a loop of SDPA calls per sequence (exact)."""
    working_copy: Literal["auto"] | bool = "auto"
    """Forward and backward run on a bf16 copy of the weights, refreshed from the float32
    masters once per optimizer step, instead of autocast casting every master weight again
    for every micro-batch; gradients are summed into float32 before the (fused) AdamW step,
    and the residual stream is bf16 too. Needs 16-bit compute (`model.dtype`) and one rank.
    auto: on for the packed learner on one CUDA device with 16-bit compute, where it was
    measured (Qwen3-0.6B's shape, one 64k-token mini-batch on an H100: 2.09 s a step against
    2.31, 47 GiB peak against 53; pg loss within 3e-4 and grad norm within 7e-4, relative, of
    the padded path over 3 steps); off on CPU, which stays exact float32. With LoRA
    (`model.lora`) there is no copy: the frozen base itself is stored in 16 bits, the
    adapters stay float32 masters."""
    compile_layers: Literal["auto"] | bool = "auto"
    """torch.compile each decoder layer's forward and, packed, the LM head's per-chunk softmax
    math: the float32 elementwise tails and norms (RMSNorm, RoPE, SwiGLU, the head's
    log-softmax) become a few fused kernels instead of a memory round trip per op. The first
    steps pay the compile time (about 15 s at that shape). auto: on where `working_copy`'s
    auto is (and Triton is installed): with the copy, 0.93 s a step against 2.09 on equal
    lengths, 1.24 against 2.55 on a long tail, 33 GiB peak against 47, i.e. 2.35x and 4.9x
    the padded path's tokens/s. Off on CPU (exact already, and compiling would slow the
    tests) and on several ranks, where FSDP with compiled layers is not measured yet."""

    @model_validator(mode="after")
    def _mini_batch_divides(self) -> TrainerConfig:
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError(
                f"trainer.train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"trainer.ppo_mini_batch_size ({self.ppo_mini_batch_size})"
            )
        return self


class AutoscaleConfig(_Section):
    """`fleet.autoscale`: the launched fleet's size follows what the steps measure
    (`launch/autoscale.py`), one worker at a time, within `min_workers`..`max_workers`."""

    enabled: bool = False
    min_workers: int = Field(1, ge=0)
    max_workers: int = Field(8, ge=1)
    target_step_s: float | None = Field(None, gt=0)
    """Keep the step at or under this many seconds with the fewest workers (None: the
    size with the most tokens per dollar)."""
    interval_steps: int = Field(4, ge=1)
    """Steps at one size, after the first, that a decision averages."""
    min_gain: float = Field(0.05, ge=0)
    """A change must be predicted to raise tokens per dollar by this fraction; one that
    measures this much worse is undone."""
    probe_loss: float = Field(0.1, ge=0)
    """One worker fewer is tried when predicted to cost less than this fraction."""
    hold_steps: int = Field(16, ge=0)
    """Steps a size that a measurement refuted is not tried again."""
    calibration: str | None = None
    """A calibration file (`polyrl plan calibrate`): predict each size with the fleet model
    (`polyrl plan`) over the steps' own workload, and move toward the best. None: Amdahl's
    law over the fleet's measured busy time (it cannot see a batch's decode curve, the
    long tail, or cores the workers share)."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers={self.min_workers} is over max_workers={self.max_workers}")
        return self


class FleetConfig(_Section):
    """Rollout workers the trainer starts itself, as `polyrl worker` subprocesses on this
    machine (remote and hybrid modes). Workers on other machines join with
    `polyrl worker --manager URL --token-file F` at any time, on top of these."""

    num_workers: int = Field(2, ge=0)
    """Workers launched at start (with churn: the most alive at once)."""
    worker_threads: int = Field(1, ge=1)
    """torch threads per worker process."""
    ready_timeout_s: float = Field(180.0, gt=0)
    """Training waits this long at start for the launched workers (and `min_workers`),
    then goes on without the missing ones."""
    min_workers: int = Field(0, ge=0)
    """Training starts once this many workers are active, launched here or joined from
    elsewhere (waiting at most `ready_timeout_s`). With workers of your own, e.g. ones that
    outlived a trainer you `--resume`, this keeps the first steps off the trainer's engine
    while they register."""
    churn_interval_s: float = Field(0.0, ge=0)
    """Spot churn as in the seeds' launch_sglang_step.sh: add a worker every T seconds up
    to `num_workers`, then retire the oldest (SIGTERM: drain and hand back) every T down
    to `churn_min_workers`, and again. 0: no churn."""
    churn_min_workers: int = Field(0, ge=0)
    kill_interval_s: float = Field(0.0, ge=0)
    """Mean seconds between kill -9 of a random worker (exponential gaps); 0: never."""
    kill_seed: int = 0
    drain_timeout_s: float = Field(5.0, ge=0)
    """A retired worker's in-flight requests get this long before they are handed back."""
    usd_per_hour: float = Field(21.28 / 8, ge=0)
    """Price each launched worker declares (default: one GPU of the seeds' spot H100x8)."""
    launcher: Literal["local", "ray"] = "local"
    """Where the launched workers run. `local`: subprocesses on this machine. `ray`: one
    Ray actor per worker on a Ray cluster (`pip install 'polyrl[ray]'`); each actor runs
    `polyrl worker` on its node, and Ray starts it again elsewhere when the node is lost,
    so `num_workers` stay alive (`polyrl.launch.ray_fleet`)."""
    ray_address: str | None = None
    """The Ray cluster to join: "HOST:6379", "auto" (the one `ray start` left on this
    machine), or None: the RAY_ADDRESS variable, else that one, else a new local cluster
    that listens on loopback only (Ray's single-machine mode, `launch/ray_fleet.py`)."""
    ray_num_cpus: float = Field(1.0, ge=0)
    """Ray CPUs each worker reserves."""
    ray_num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs each worker reserves; 1 on a GPU cluster gives every worker a GPU of its
    own (Ray sets CUDA_VISIBLE_DEVICES)."""
    ray_resources: dict[str, float] = {}
    """Custom Ray resources each worker reserves, e.g. {"spot": 1} to place workers only
    on nodes started with `ray start --resources='{"spot": 8}'`."""
    ray_max_restarts: int = Field(-1, ge=-1)
    """How many times Ray starts a worker again after its node or process died (-1: no limit)."""
    ray_model_path: str | None = None
    """The model as the workers' nodes see it (default: the trainer's `model.path`, or its
    generated init_model directory): a shared filesystem or a hub name on other machines."""
    ray_usd_per_hour: dict[str, float] = {}
    """Price by instance type: a worker on a node of a listed type declares it instead of
    `usd_per_hour`. A node's type is its POLYRL_INSTANCE_TYPE variable, else the
    autoscaler's node type (RAY_NODE_TYPE_NAME)."""
    autoscale: AutoscaleConfig = AutoscaleConfig()
    """Grow and shrink the launched fleet from the steps' measurements (off by default)."""

    @model_validator(mode="after")
    def _autoscale_or_churn(self) -> FleetConfig:
        if self.autoscale.enabled and (self.churn_interval_s > 0 or self.kill_interval_s > 0):
            raise ValueError(
                "fleet.autoscale decides the fleet's size: it cannot run with churn_interval_s or kill_interval_s"
            )
        return self

    @model_validator(mode="after")
    def _ray_keys_need_ray(self) -> FleetConfig:
        defaults = FleetConfig.model_fields
        set_keys = {k for k in defaults if k.startswith("ray_") and getattr(self, k) != defaults[k].get_default()}
        if set_keys and self.launcher != "ray":  # a saved config holds every key: only changed ones count
            raise ValueError(f"{', '.join(sorted(f'fleet.{k}' for k in set_keys))} need fleet.launcher=ray")
        return self


class CostConfig(_Section):
    """Prices for `cost/*` metrics (defaults: the seeds' H100x8 prices, per GPU)."""

    trainer_usd_per_hour: float = Field(83.79 / 8, ge=0)
    """The trainer's reserved (on-demand) capacity, per trainer GPU: FSDP on N ranks costs N times it."""
    worker_usd_per_hour: float = Field(21.28 / 8, ge=0)
    """For workers that do not declare a price (`worker.usd_per_hour`)."""


class LoggingConfig(_Section):
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "polyrl"
    console: bool = True


class TlsConfig(_Section):
    """TLS for a service's HTTP API and the clients that call it (`polyrl.tls`). A
    service serves HTTPS when `cert_file` is set; every client in the process (worker ->
    manager, manager -> workers, trainer -> manager) verifies the peer against `ca_file`.
    Plain HTTP stays the default: the HMAC tokens and checksums protect integrity, not
    confidentiality, so turn this on where links cross networks you do not own."""

    cert_file: str | None = None
    """PEM certificate (chain) this service presents; set with `key_file` to serve HTTPS."""
    key_file: str | None = None
    """PEM private key of `cert_file`."""
    ca_file: str | None = None
    """PEM CA bundle clients verify the peers' certificates against (a self-signed CA);
    None: the system's trust store."""

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    @field_validator("cert_file", "key_file", "ca_file")
    @classmethod
    def _is_file(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_file():
            raise ValueError("not a file")
        return path

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (a certificate and its key)")
        return self


class HttpLimitsConfig(_Section):
    """Bounds on what clients may hold of a service (`polyrl.serving.GuardedProtocol`):
    uvicorn has no request-receive timeout, so a client that sends a header a byte a
    minute keeps its connection, and its file descriptor, for good."""

    max_connections: int = Field(0, ge=0)
    """Open client connections at most; one more is answered 503 and closed. 0: half of
    the process's open-file limit (RLIMIT_NOFILE), the other half left for its own
    outbound connections and files. The manager holds one connection per sample in flight
    on a worker (`manager.max_inflight_per_worker`), so keep a worker's above that."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A request's headers must arrive within this long (from the connection or, kept
    alive, from its first byte), else the connection is closed (408)."""
    body_timeout_s: float = Field(120.0, gt=0)
    """Then its whole body within this long (a manager batch may be 64 MiB on a slow link)."""
    keep_alive_s: int = Field(5, ge=1)
    """An idle kept-alive connection is closed after this long (uvicorn's timeout_keep_alive)."""


class WorkerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    """0 picks a free port (printed at start)."""
    manager_url: str | None = None
    """Register with this rollout manager and heartbeat; without it the worker serves alone."""
    token: str | None = None
    """Shared secret for the manager (default: the POLYRL_TOKEN environment variable)."""
    token_file: str | None = None
    """A file that holds `token` instead: the token alone, or a run's manager.json. A token
    on a command line is visible to every user of the machine (`ps`); a file or the
    environment is not. Default: the file the POLYRL_TOKEN_FILE environment variable names."""
    worker_id: str | None = None
    """Default: <hostname>-<port>."""
    advertise_url: str | None = None
    """The URL the manager should call; default http://<host>:<port>."""
    heartbeat_interval_s: float = Field(2.0, gt=0)
    manager_request_timeout_s: float = Field(10.0, gt=0)
    """Timeout of each call to the manager (before this key existed, `manager_timeout_s`
    meant this)."""
    manager_timeout_s: float | None = Field(None, ge=0)
    """Give up (exit 1, one line) when the manager stays unreachable this long, at start or
    later. None or 0: retry forever, so that a restarting manager finds its workers again.
    Either way, "cannot reach the manager at URL: <reason>; retrying" is logged when an
    outage starts and every 15 s while it lasts."""
    stream_interval_s: float = Field(0.0, ge=0, le=5)
    """A streamed generation sends at most one chunk per request this often, a finished
    sample at once (0: one per engine step). The manager asks for its own interval with
    each request (`manager.stream_interval_s`); the longer of the two applies."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM/SIGINT: in-flight requests get this long to finish, then are aborted and
    handed back with their partial tokens."""
    usd_per_hour: float | None = Field(None, ge=0)
    """This worker's price, told to the manager for cost accounting (None: the trainer's
    `cost.worker_usd_per_hour`)."""
    node: str | None = None
    """The machine this worker runs on, as operators know it (default: its hostname; a Ray
    worker reports its Ray node)."""
    instance_type: str | None = None
    """The machine's kind, e.g. "g6e.xlarge" or "spot-h100" (default: the POLYRL_INSTANCE_TYPE
    variable), told to the manager with the price so that costs can be read per node type."""
    relay_port: int | None = Field(0, ge=0, le=65535)
    """Serve the versions this worker holds to other workers on this port, when the
    manager relays versions (`manager.transfer.relay_fan_out`): 0 picks a free port, None
    serves none. It binds `host`, and speaks TLS with `tls`'s certificate when set."""
    local: bool = False
    """The trainer's own engine (`polyrl train` starts it on the trainer's device): it
    registers as `local`, and the manager gives it work only in the local window, when no
    other worker is left, or for a batch stalled past `manager.local_fallback_s`."""
    tls: TlsConfig = TlsConfig()
    """HTTPS for this worker's API (`cert_file`, `key_file`), and the CA it verifies the
    manager and the weight publisher against (`ca_file`)."""
    http: HttpLimitsConfig = HttpLimitsConfig()


class WorkerRunConfig(_Section):
    """`polyrl worker`: one engine behind the HTTP API."""

    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    worker: WorkerConfig = WorkerConfig()


class TransferConfig(_Section):
    """How workers pull weight versions (consumed by the transfer layer)."""

    streams_per_group: int = Field(8, ge=1, le=64)
    """Parallel TCP streams per pull (one stream is far from a link's ceiling; 8 was the
    best measured on a 16-core host, see BENCHMARKS.md)."""
    num_groups: int = Field(1, ge=1, le=64)
    """Publisher groups (the seeds' sender groups): each is a listener of its own, and each
    worker is assigned the group with the fewest workers and pulls only from it. Pays with
    several network interfaces (`group_hosts`), where each group's pulls use its own link."""
    group_hosts: list[str] = []
    """One bind address per group (e.g. one per NIC); empty: every group on the manager's
    host. Workers are told the same address, so it must be one they can reach."""
    port: int = Field(0, ge=0, le=65535)
    """The trainer's weight publisher port (0: any free one); group g listens on port + g."""
    advertise_host: str | None = None
    """The address workers use to reach the publisher (default: the manager's host); with
    `group_hosts`, those are advertised instead."""
    codec: Literal["auto", "raw", "delta", "zstd", "int8"] = "auto"
    """auto: raw on a fast link; after a raw pull below ~2 Gbit/s, a lossless delta against
    the worker's version (zstd when it has none). zstd: lossless, about 70% of raw for bf16.
    int8: LOSSY per-row int8 (about half of bf16's bytes); workers log that they serve it."""
    gpu_paths: bool = True
    """Workers on the trainer's host get versions from its GPU when the trainer holds them
    there (`WeightPublisher.device`): NCCL from another GPU, CUDA IPC on the same one. A
    worker whose GPU path fails falls back to TCP (logged once) and stays on TCP."""
    single_copy: bool = True
    """A worker on the trainer's own GPU (the local worker) decodes from the trainer's
    published bf16 buffer in place instead of copying it into weights of its own: the
    GPU holds one copy of the weights fewer, and a new version costs no copy. Each
    version is then written into that buffer while the engine pauses between two steps
    (README, "Weight transfer"). Needs `gpu_paths`; LoRA versions are copied as before."""
    send_mode: Literal["sendfile", "sendall"] = "sendfile"
    """How the publisher sends a chunk: sendfile has the kernel send from the shared
    buffer (no copy in the publisher process), sendall copies it into the socket.
    sendfile was faster in 18 of 20 pairs at 8-16 streams on a 16-core GPU host (by up
    to 17 points of the link's ceiling), sendall on a 2-core AMD box (BENCHMARKS.md,
    "Weight pulls: the receiver's check"). TLS always uses sendall."""
    max_send_gbps: float | None = Field(None, gt=0)
    """A cap on the publisher's sending, all pulls together, in Gbit/s (None: as fast as
    the link). For a trainer whose link carries other traffic too (checkpoints, data,
    other jobs): pulls then take longer, and nothing else waits behind them. Pulls over
    the GPU paths are not capped."""
    relay_fan_out: int | None = Field(None, ge=1, le=64)
    """Relayed versions: workers that run a relay (`worker.relay_port`) pull each version
    from a tree of one another, `relay_fan_out` children per sender (1: a chain), in the
    order they joined, and serve each chunk on as soon as it checks out; the publisher
    sends a version `relay_fan_out` times, however many workers there are. A receiver
    whose relay dies goes on from the relay above it, then the publisher, keeping what it
    has. None: every worker pulls from the publisher (`manager/relay_plan.py`)."""
    tls: bool = False
    """Encrypt weight pulls (TLS over each TCP stream) with `manager.tls`'s certificate
    and key; workers verify it against their `worker.tls.ca_file`. Costs CPU on both ends
    (BENCHMARKS.md, "Weight transfer over TLS"); the GPU paths are off with it."""

    @model_validator(mode="after")
    def _one_host_per_group(self) -> TransferConfig:
        if self.group_hosts and len(self.group_hosts) != self.num_groups:
            raise ValueError(f"group_hosts names {len(self.group_hosts)} addresses for num_groups={self.num_groups}")
        if self.port and self.port + self.num_groups - 1 > 65535:
            raise ValueError(f"ports {self.port}..{self.port + self.num_groups - 1} run past 65535")
        return self


class ManagerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(5000, ge=0, le=65535)
    """0 picks a free port (printed at start)."""
    advertise_host: str | None = None
    """The address workers on other machines reach this manager (and the trainer's
    publisher, unless `transfer.advertise_host` says otherwise) at. Default: `host`, or
    this machine's hostname when `host` is a wildcard such as 0.0.0.0."""
    token: str | None = None
    """Shared secret for every mutating endpoint (default: the POLYRL_TOKEN environment
    variable). Required when `host` is not a loopback address."""
    token_file: str | None = None
    """A file that holds `token` instead (kept off command lines, which `ps` shows to every
    user): the token alone, or a run's manager.json. Default: POLYRL_TOKEN_FILE."""
    read_token: str | None = None
    """A second token that may only read the fleet (`GET /`, `/v1/fleet`, `/v1/workers`,
    `/metrics`): for dashboards and Prometheus. Those also accept `token`."""
    read_token_file: str | None = None
    """A file that holds `read_token` instead."""
    allowed_worker_cidrs: list[str] = ["0.0.0.0/0", "::/0"]
    """Address ranges a worker may register from (the seeds' `allowed_sender_ips`)."""
    heartbeat_interval_s: float = Field(2.0, gt=0)
    """Told to workers at registration."""
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    """A worker silent this long is declared gone and its requests migrate."""
    readiness_timeout_s: float = Field(60.0, gt=0)
    """A new worker must answer /health_generate within this long, or it is dropped."""
    connect_timeout_s: float = Field(5.0, gt=0)
    stall_timeout_s: float = Field(30.0, gt=0)
    """A generation stream that sends nothing for this long counts as a hung worker."""
    stream_interval_s: float = Field(0.2, ge=0, le=5)
    """polyrl workers send each request's tokens at most this often (a finished sample at
    once). A worker killed mid-stream loses up to this much generation, which its
    samples' next worker redoes. The trainer no longer pays for chunks (it reads finished
    groups: 0.6 us of CPU per token either way, benchmarks/ingest_interference.py), but
    the manager's one event loop does: one chunk per engine step cost it 42 us per
    token, most of a core for one GPU worker at 17k tokens/s; 0.2 s chunks cost 7.
    0: one chunk per engine step."""
    batch_calls: bool = True
    """Send the calls placed on a polyrl worker at once as one batched `/generate`
    (README, "Batched requests"); false: one request per call. An agent run's many short
    calls spent about 1.3 of the 2-core box's cores on per-call HTTP without it."""
    max_inflight_per_worker: int = Field(256, ge=1)
    """Samples in flight on one worker (also capped by the worker's own max_num_seqs)."""
    retry_budget: int = Field(5, ge=0)
    """Failures one sample may meet (worker died, stalled, errored) before its batch fails;
    hand-backs from a draining worker do not count."""
    local_fallback_s: float = Field(10.0, gt=0)
    """With a local engine (the trainer's): a batch waiting this long while no remote worker
    serves its weight version goes to the local engine, so a fleet stuck syncing never
    stalls training."""
    batch_deadline_s: float = Field(3600.0, gt=0)
    """A batch unfinished after this long fails with an error instead of hanging."""
    max_body_bytes: int = Field(64 * 2**20, ge=1024)
    """Largest request body (a batch of prompts); control messages are capped at 64 KiB."""
    local_window: Literal["off", "synced", "learner", "idle", "always"] = "off"
    """Hybrid mode's local window (RLBoost's adaptive local rollout): after each published
    version the `local` worker (the trainer's own engine) takes work while the others sync.
    `synced`: it closes when every other worker serves the version, after twice the
    measured sync time (at most `local_window_max_s`), or when the trainer says its
    learner started; the local worker's unfinished samples then move on, token for token.
    `learner`: the local worker is a peer of the others (its share of each batch) until
    the learner starts, then finishes what it holds. `idle` (fully asynchronous training):
    it opens whenever the learner waits for groups, for those groups only, and closes
    when the learner trains; the local worker finishes what it holds. `always`: the local worker is a peer from
    the start, beside the learner, and never hands work back. `polyrl train` sets it from `rollout.mode`,
    `rollout.hybrid_local_until` and `rollout.fully_async`."""
    local_window_max_s: float = Field(30.0, gt=0)
    swap_policy: SwapPolicy | None = None
    """What a worker does with its running samples when it takes a new version (sent with
    each sync request; see `engine.swap_policy`). None: each worker's own setting.
    `polyrl train` sets `continue` for `rollout.fully_async`: a sample keeps its KV cache
    and goes on under the new weights, so no version update costs a re-prefill."""
    tokenizer: str | None = None
    """A local tokenizer directory for the OpenAI- and vLLM-compatible endpoints (chat
    templates, text in and out). Default: the model path the workers registered with, when
    that directory exists on the manager's machine too."""
    inference_wait_s: float = Field(30.0, gt=0)
    """An OpenAI/vLLM request that arrives while no worker serves waits this long for one,
    then gets a 503."""
    url: str | None = None
    """`polyrl train` only: use the manager already serving at this URL (a standalone
    `polyrl manager`, with `token`) instead of starting one."""
    tls: TlsConfig = TlsConfig()
    """HTTPS for the manager's API (`cert_file`, `key_file`); `ca_file`: what it verifies
    workers against. `polyrl train` also gives these files to the workers it starts,
    verifies the manager with `ca_file` and serves encrypted weight pulls with them when
    `transfer.tls` is on."""
    http: HttpLimitsConfig = HttpLimitsConfig()
    transfer: TransferConfig = TransferConfig()

    @model_validator(mode="after")
    def _tls_for_weights(self) -> ManagerConfig:
        if self.transfer.tls and not self.tls.enabled:
            raise ValueError(
                "manager.transfer.tls needs manager.tls.cert_file and key_file (the publisher's certificate)"
            )
        return self

    @model_validator(mode="after")
    def _cidrs_parse(self) -> ManagerConfig:
        import ipaddress

        for cidr in self.allowed_worker_cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"allowed_worker_cidrs: {cidr!r} is not an address range") from None
        return self


class ManagerRunConfig(_Section):
    """`polyrl manager`: the standalone rollout manager."""

    manager: ManagerConfig = ManagerConfig()


class RunConfig(_Section):
    run_name: str | None = None
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    engine: EngineConfig = EngineConfig()
    algo: AlgoConfig = AlgoConfig()
    trainer: TrainerConfig = TrainerConfig()
    logging: LoggingConfig = LoggingConfig()
    manager: ManagerConfig = ManagerConfig()
    """The in-process rollout manager (remote and hybrid modes)."""
    fleet: FleetConfig = FleetConfig()
    cost: CostConfig = CostConfig()

    @model_validator(mode="after")
    def _scored_sources_take_no_reward_functions(self) -> RunConfig:
        if self.data.source in SCORED_SOURCES and self.reward.functions:
            raise ValueError(
                f"reward.functions: data.source = '{self.data.source}' brings its groups scored (an agent's episode "
                "function or an Atropos environment gives the rewards), so these would never run"
            )
        return self

    @model_validator(mode="after")
    def _atropos_needs_a_fleet(self) -> RunConfig:
        if self.data.source != "atropos":
            return self
        if not self.data.atropos.url:
            raise ValueError("data.atropos.url: required when data.source = 'atropos' (the API server's URL)")
        if self.rollout.mode == "local":
            raise ValueError(
                "rollout.mode: local has no manager or workers for Atropos environments to call; with "
                "data.source = 'atropos' use remote or hybrid"
            )
        return self

    @model_validator(mode="after")
    def _agent_needs_the_fleet(self) -> RunConfig:
        if self.data.source != "agent":
            return self
        if self.rollout.mode == "local":
            raise ValueError(
                "rollout.mode: local has no manager for agent episodes to call; with data.source = 'agent' use "
                "remote or hybrid"
            )
        if self.algo.router_replay == "R3":
            raise ValueError("algo.router_replay = 'R3': not built for agent episodes yet (R2 works)")
        return self

    @model_validator(mode="after")
    def _churn_bounds(self) -> RunConfig:
        if self.fleet.churn_min_workers > self.fleet.num_workers:
            raise ValueError("fleet.churn_min_workers must not exceed fleet.num_workers")
        if self.fleet.min_workers and self.rollout.mode == "local":
            raise ValueError(f"fleet.min_workers ({self.fleet.min_workers}) needs rollout.mode remote or hybrid")
        if self.model.lora.enabled and self.trainer.working_copy is True:
            raise ValueError(
                "trainer.working_copy needs full fine-tuning: with model.lora the adapters train on the model itself"
            )
        return self

    @model_validator(mode="after")
    def _one_budget_rule(self) -> RunConfig:
        if self.rollout.max_new_tokens_schedule and self.data.max_new_tokens_key is not None:
            raise ValueError(
                "rollout.max_new_tokens_schedule and data.max_new_tokens_key both set budgets: use one of them"
            )
        if self.rollout.max_new_tokens_schedule and self.reward.overlong_buffer.enable:
            raise ValueError(
                "rollout.max_new_tokens_schedule with reward.overlong_buffer: the penalty ramps up to "
                "rollout.max_new_tokens, not to each step's budget; use one of them"
            )
        if self.rollout.max_new_tokens_schedule and self.data.source in ("atropos", "agent"):
            raise ValueError(
                f"rollout.max_new_tokens_schedule: with data.source = {self.data.source!r} the "
                "environments set their own budgets"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> RunConfig:
        buffer = self.reward.overlong_buffer
        if buffer.enable and buffer.len > self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer.len ({buffer.len}) must not exceed rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}): the penalty ramps up over the last len tokens of the budget"
            )
        return self

    @model_validator(mode="after")
    def _filter_groups_fits(self) -> RunConfig:
        """Dynamic sampling takes more prompts mid-step: only where a step's batch is the
        last thing taken from the prompt stream (the resumed cursor stays exact)."""
        if not self.algo.filter_groups.enable:
            return self
        if self.rollout.fully_async:
            raise ValueError(
                "algo.filter_groups needs the step-synchronous loop: with rollout.fully_async each step takes the "
                "first groups to finish of those in flight; drop zero-variance groups there with "
                "algo.filter_zero_variance_groups"
            )
        if self.rollout.max_staleness:
            raise ValueError(
                f"algo.filter_groups needs rollout.max_staleness = 0 (got {self.rollout.max_staleness}): the extra "
                "prompts of a step would come after those of the batches already submitted ahead"
            )
        if self.data.source == "atropos":
            raise ValueError("algo.filter_groups: with data.source = 'atropos' the environments choose the groups")
        return self


_Config = TypeVar("_Config", bound=BaseModel)


class ConfigError(ValueError):
    """A bad configuration; `str()` is one line naming the key."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value); the value is read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def _set_dotted(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _section_fields(schema: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the section that `loc` (a key path) sits in."""
    section: Any = schema
    for part in loc[:-1]:
        field = section.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        section = field.annotation
    return list(section.model_fields)


def _did_you_mean(schema: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The message for an unknown key: with the closest real key of its section, if one
    is close enough (difflib), since most unknown keys are typos."""
    name = str(loc[-1])
    close = difflib.get_close_matches(name, _section_fields(schema, loc), n=1, cutoff=0.6)
    if not close:
        return "unknown key"
    return f"unknown key; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?"


def _format_error(err: ValidationError, schema: type[BaseModel]) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = _did_you_mean(schema, first["loc"])
    elif "input" in first and first["type"] not in ("missing",):
        msg = f"{msg} (got {first['input']!r})"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if not first["loc"] and first["type"] == "value_error":  # a whole-config check names its own keys
        return f"config error: {first['msg'].removeprefix('Value error, ')}{more}"
    return f"config error: {key}: {msg}{more}"


def load_config(
    path: str | Path | None = None, overrides: list[str] = (), schema: type[_Config] = RunConfig
) -> _Config:
    """Read `path` (TOML), apply dotted overrides, validate against `schema`. Raises ConfigError."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            tree = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config error: file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config error: {path}: invalid TOML: {e}") from None
    for text in overrides:
        parts, value = parse_override(text)
        _set_dotted(tree, parts, value)
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e, schema)) from None


def save_config(cfg: BaseModel, path: str | Path) -> None:
    # TOML has no null: every None-able key defaults to None, so dropping them round-trips.
    Path(path).write_text(tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True)))
