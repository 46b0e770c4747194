"""The engine's Triton experts (`polyrl.engine.fused_moe`) against transformers' own
Qwen3-MoE block, their routing and grouping, and the residual add that sums their parts
(on CPU in Triton's interpreter, which tests/conftest.py switches on; on a GPU compiled,
with CUDA tensors)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from polyrl.engine import fused_moe, triton_ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_ops.available(DEVICE.type), reason="Triton is not installed")


def _moe_block(num_experts: int, top_k: int, hidden: int, inter: int, renormalize: bool = True) -> torch.nn.Module:
    config = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=renormalize,
    )
    mlp = AutoModelForCausalLM.from_config(config, dtype=torch.float32).model.layers[0].mlp.to(DEVICE)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.2)  # clear winners among the experts, outputs of order 1
    return mlp


@pytest.mark.parametrize(
    ("num_experts", "top_k", "hidden", "inter", "tokens", "renormalize"),
    [(4, 2, 64, 48, 5, True), (16, 4, 32, 80, 37, False), (128, 8, 32, 32, 24, True)],
)
def test_the_triton_experts_equal_transformers_block(
    num_experts: int, top_k: int, hidden: int, inter: int, tokens: int, renormalize: bool
) -> None:
    """Output and routes, on shapes with partial tiles (48 and 80 wide experts) and with
    Qwen3-30B-A3B's 128 experts and top 8."""
    torch.manual_seed(num_experts)
    mlp = _moe_block(num_experts, top_k, hidden, inter, renormalize)
    x = torch.randn(tokens, hidden, device=DEVICE)
    routes: list[torch.Tensor] = []
    with torch.no_grad():
        want = mlp(x[None])[0]
        got = fused_moe.moe_forward(mlp, x, routes)
        _, _, want_ids = mlp.gate(x)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())
    assert len(routes) == 1 and torch.equal(routes[0].long(), want_ids)


def test_routing_takes_the_lowest_index_among_ties_and_renormalises() -> None:
    """Equal logits: the first k experts, each with 1/k after renormalising (torch.topk
    and transformers' router agree); without renormalising, each keeps its 1/E. Each
    expert counts its picks."""
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, 5] = 2.0  # one clear winner, the rest tied
    routed = fused_moe.route(logits, 3, True)
    assert routed.expert_ids[0].tolist() == [0, 1, 2] and routed.expert_ids[1].tolist() == [5, 0, 1]
    assert torch.allclose(routed.weights[0].cpu(), torch.full((3,), 1 / 3))
    assert torch.allclose(routed.weights.sum(dim=1).cpu(), torch.ones(3))
    assert routed.counts.tolist() == [3, 3, 2, 0, 0, 1, 0, 0]
    raw = fused_moe.route(logits, 3, False).weights
    assert torch.allclose(raw[0].cpu(), torch.full((3,), 1 / 8))


@pytest.mark.parametrize("block_m", [16, 32])
def test_grouping_puts_the_pairs_in_expert_order_cut_into_blocks(block_m: int) -> None:
    """The order is a permutation of the pairs with their experts ascending; the blocks
    cover each expert's pairs in order, at most `block_m` each, with unused rows marked
    -1; experts with no pairs (the last two here) get no block."""
    g = torch.Generator().manual_seed(block_m)
    num_experts, top_k = 12, 3
    logits = torch.randn(41, num_experts, generator=g)
    logits[:, -2:] = -1e4
    routed = fused_moe.route(logits.to(DEVICE), top_k, True)
    order, blocks = fused_moe.group_by_expert(routed, block_m)
    order, blocks, flat = order.cpu(), blocks.cpu(), routed.expert_ids.flatten().cpu()
    assert sorted(order.tolist()) == list(range(flat.numel()))
    assert torch.equal(flat[order.long()], flat.sort().values)
    assert torch.equal(routed.counts.long().cpu(), torch.bincount(flat.long(), minlength=num_experts))
    used = blocks[blocks[:, 0] >= 0]
    assert (blocks[len(used) :, 0] == -1).all()
    covered = []
    for expert, first, end in used.tolist():
        assert 0 < end - first <= block_m
        assert (flat[order[first:end].long()] == expert).all()
        covered.extend(range(first, end))
    assert covered == list(range(flat.numel()))
    assert len(used) == sum(-(-c // block_m) for c in routed.counts.tolist())


# bfloat16 on a GPU only: Triton's interpreter does not round float32 to bfloat16 as the GPU does.
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
def test_the_residual_add_sums_the_experts_parts(dtype: torch.dtype) -> None:
    """The engine's next RMSNorm takes the k weighted expert outputs unsummed ([T, k, N]):
    the same residual and output as summing them first (float32, then the residual's
    dtype, as transformers does), up to the order of the float32 sum."""
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(5, 8, 48, generator=g).to(DEVICE)  # float32, the experts' dtype under autocast
    residual = torch.randn(5, 48, generator=g).to(DEVICE, dtype)
    weight = torch.rand(48, generator=g).to(DEVICE, dtype)
    want_residual = residual.clone()
    want = triton_ops.rmsnorm(parts.sum(dim=1).to(dtype), weight, 1e-6, want_residual)
    got = triton_ops.rmsnorm(parts, weight, 1e-6, residual)
    assert got.shape == (5, 48) and got.dtype == dtype
    tol = {"atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}  # bf16: an ulp or so
    assert torch.allclose(residual.float(), want_residual.float(), **tol)
    assert torch.allclose(got.float(), want.float(), **tol)
