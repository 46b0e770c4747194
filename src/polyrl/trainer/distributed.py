"""Data-parallel training on several ranks (torchrun, FSDP2).

Rank 0 runs the program: rollout, rewards, logging, checkpoints. The other ranks hold a
shard of the same model and optimizer and do what rank 0 tells them: train on their share
of a mini-batch, or join the gathering of whole weights or state. Rank 0 sends each
command (with its data, e.g. the mini-batch's SeqItems) over a gloo group of its own with
a long timeout, because between commands the others wait while rank 0 generates.

With one process every helper here is the plain single-process call or a no-op, so the
learner and the run have one code path.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

from polyrl.trainer.batching import SeqItem
from polyrl.trainer.batching import pack_micro_batches as _pack_padded

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = timedelta(hours=2)
"""How long the other ranks wait for rank 0's next command: longer than a step's generation
(`manager.batch_deadline_s` is an hour by default)."""

_FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


class DataParallel:
    """This process's place among the trainer's ranks (one process: rank 0 of 1)."""

    def __init__(self, rank: int = 0, world_size: int = 1, control: dist.ProcessGroup | None = None) -> None:
        self.rank, self.world_size, self.control = rank, world_size, control
        self.is_broken = False
        """A command failed on rank 0: the others may be inside a collective, not listening."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _broadcast(self, message: list[Any]) -> list[Any]:
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    @contextmanager
    def command(self, name: str, *args: Any) -> Iterator[None]:
        """Rank 0 of several tells the others to run `name(*args)`: the body is collective,
        every rank runs it (the others from `receive`). Elsewhere a no-op."""
        if self.is_main and self.world_size > 1:
            self._broadcast([name, args])
        try:
            yield
        except BaseException:
            self.is_broken = True
            raise

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        """Ranks > 0: rank 0's next command."""
        name, args = self._broadcast([None, ()])
        return name, args

    def stop(self) -> None:
        """Rank 0: release the others (unless a failed command may have left them stuck in a
        collective; then torchrun stops them when rank 0 exits)."""
        if not (self.is_main and self.world_size > 1) or self.is_broken:
            return
        try:
            self._broadcast(["stop", ()])
        except (RuntimeError, OSError) as e:  # they are gone already (torchrun stopping everyone)
            log.warning("could not tell the other ranks to stop: %s", e)

    def micro_batches(
        self, items: list[SeqItem], max_tokens: int, pad_id: int, pack: Callable | None = None
    ) -> list[list[SeqItem]]:
        """This rank's micro-batches of a mini-batch: a token-balanced share, packed, then
        filled up with empty micro-batches to the busiest rank's count, because every FSDP
        forward and backward is a collective that all ranks must join. `pack`: how to split
        a share (default: padded micro-batches, `pack_micro_batches`)."""
        pack_micro_batches = pack or _pack_padded
        if self.world_size == 1:
            return pack_micro_batches(items, max_tokens)
        packed = [pack_micro_batches(share, max_tokens) for share in split_items(items, self.world_size)]
        count = max(len(p) for p in packed)
        idle = [SeqItem([pad_id, pad_id], 2, [], 0.0)]  # no completion token: zero loss, zero gradient
        return packed[self.rank] + [idle] * (count - len(packed[self.rank]))

    def sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over the ranks (every rank passes the same keys)."""
        if self.world_size == 1:
            return dict(values)
        keys = sorted(values)
        total = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(total, group=self.control)
        return dict(zip(keys, total.tolist(), strict=True))


def split_items(items: list[SeqItem], world_size: int) -> list[list[SeqItem]]:
    """Token-balanced shares: longest first, each to the rank with the fewest tokens so far."""
    shares: list[list[SeqItem]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for item in sorted(items, key=lambda it: -len(it.token_ids)):
        rank = loads.index(min(loads))
        shares[rank].append(item)
        loads[rank] += len(item.token_ids)
    return shares


@contextmanager
def data_parallel() -> Iterator[DataParallel]:
    """Under torchrun (WORLD_SIZE > 1) join the process group for the duration: NCCL for CUDA
    tensors (device cuda:LOCAL_RANK), gloo for CPU ones. Otherwise one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        yield DataParallel()
        return
    is_cuda = torch.cuda.is_available()
    if is_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if is_cuda else "gloo")
    dp = DataParallel(dist.get_rank(), world_size, dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT))
    if dp.is_main:
        # torchrun stops every rank with SIGTERM when one fails: as an exception, rank 0's
        # clean-up still runs (the rollout workers it launched are stopped, not orphaned).
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield dp
    finally:
        dp.stop()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ FSDP


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(model: PreTrainedModel, compute_dtype: torch.dtype, cast_params: bool = True) -> torch.dtype:
    """FSDP2 over all ranks: each decoder layer, then the root (embeddings, final norm, head).

    Gradients are summed over ranks, not averaged: each rank's loss already divides by the
    whole mini-batch's token count, so the sum is the single-process gradient. With a lower
    compute dtype and `cast_params`, FSDP gathers the parameters in that dtype (half the
    bytes of float32, no per-forward casts) and reduces gradients in float32; the master
    weights stay float32 either way. Returns the dtype the learner should autocast to.
    """
    mesh = init_device_mesh(model.device.type, (dist.get_world_size(),))
    cast = cast_params and compute_dtype != torch.float32
    policy = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if cast else MixedPrecisionPolicy()
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return torch.float32 if cast else compute_dtype


@torch.no_grad()
def full_parameters(model: PreTrainedModel) -> dict[str, torch.Tensor] | None:
    """Every parameter whole, by HF name, on rank 0 (for publishing); None when the model is
    not sharded (the rollout reads it itself). Collective: each rank joins every gather."""
    if not is_sharded(model):
        return None
    keep = dist.get_rank() == 0
    weights = {}
    for name, param in model.named_parameters():
        whole = param.full_tensor()
        if keep:
            weights[name] = whole
    return weights


def model_state(model: PreTrainedModel) -> dict[str, torch.Tensor] | None:
    """The whole state dict in rank 0's memory (empty elsewhere); None when not sharded."""
    return get_model_state_dict(model, options=_FULL_ON_RANK0) if is_sharded(model) else None


def optimizer_state(model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state as one process's `optimizer.state_dict()` holds it (parameters by
    index), whatever the number of ranks: a checkpoint resumes on any number. Whole on rank 0."""
    if not is_sharded(model):
        return optimizer.state_dict()
    by_name = get_optimizer_state_dict(model, optimizer, options=_FULL_ON_RANK0)
    if not by_name:
        return {}
    index = {name: i for i, name in enumerate(_param_names(model))}
    return {
        "state": {index[name]: s for name, s in by_name["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]],
    }


def load_optimizer_state(model: PreTrainedModel, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Inverse of `optimizer_state` (every rank passes the whole state)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    names = _param_names(model)
    by_name = {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _param_names(model: PreTrainedModel) -> list[str]:
    """In `model.parameters()` order: the index of a parameter in a one-group optimizer."""
    return [name for name, _ in model.named_parameters()]


def gather_weights(model: PreTrainedModel, dp: DataParallel) -> dict[str, torch.Tensor] | None:
    """`full_parameters` on every rank (rank 0's call tells the others)."""
    with dp.command("weights"):
        return full_parameters(model)


def gather_state(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, dp: DataParallel
) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
    """(model_state, optimizer_state) on every rank (rank 0's call tells the others)."""
    with dp.command("state"):
        return model_state(model), optimizer_state(model, optimizer)
