"""The fused decode matmuls (`engine/projections.py`): q/k/v and gate/up laid side by side
in one buffer and run as one matmul each, on the parameters' own memory."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from polyrl.config import EngineConfig, TinyModelConfig
from polyrl.engine import projections
from polyrl.engine.engine import Engine
from polyrl.models.tiny import save_tiny_model
from polyrl.transfer.manifest import flatten, unflatten


def tiny(tmp_path, **cfg):
    path = save_tiny_model(tmp_path / "m", TinyModelConfig(**cfg))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_pack_lays_the_projections_side_by_side_and_the_fused_matmul_equals_the_linears(tmp_path):
    model = tiny(tmp_path).requires_grad_(False)
    attn = model.model.layers[0].self_attn
    q_before = attn.q_proj.weight
    x = torch.randn(5, model.config.hidden_size)
    expected = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    assert all(p.qkv is None for p in projections.fused(model))  # loaded tensor by tensor: apart
    assert projections.pack(model) == 2 * len(model.model.layers)
    assert attn.q_proj.weight is q_before  # the same Parameter: a version's copy_ still lands in it
    layers = projections.fused(model)
    assert all(p.qkv is not None and p.gate_up is not None for p in layers)
    for got, want in zip(layers[0].qkv(x), expected, strict=True):
        assert torch.equal(got, want)
    # A version written into the parameters is what the fused matmul reads.
    with torch.no_grad():
        attn.k_proj.weight.copy_(torch.randn_like(attn.k_proj.weight))
    assert torch.equal(layers[0].qkv(x)[1], attn.k_proj(x))
    mlp = model.model.layers[1].mlp
    gate, up = layers[1].gate_up(x)
    assert torch.equal(gate, mlp.gate_proj(x)) and torch.equal(up, mlp.up_proj(x))
    assert projections.pack(model) == 0  # already side by side


def test_pack_leaves_a_model_that_trains_as_it_is(tmp_path):
    model = tiny(tmp_path)  # parameters require grad: a learner's model
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert projections.pack(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_weights_read_in_place_from_a_flat_buffer_fuse_without_a_copy(tmp_path):
    """The trainer's published buffer (the transfer manifest's layout) already holds a
    layer's projections in order: views of it fuse as they are."""
    model = tiny(tmp_path).requires_grad_(False)
    buffer, manifest = flatten(model.state_dict(), 1)
    views = unflatten(buffer, manifest)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied names alias one
    for name, t in views.items():
        params[name].data = t
    layer = projections.fused(model)[0]
    assert layer.qkv is not None and layer.gate_up is not None
    start = layer.qkv.weight.untyped_storage().data_ptr()
    assert start == buffer.untyped_storage().data_ptr()  # the buffer itself, not a copy


def test_the_engine_packs_its_own_weights_and_keeps_them_packed_after_a_version(tmp_path):
    path = save_tiny_model(tmp_path / "m", TinyModelConfig())
    engine = Engine.from_pretrained(str(path), EngineConfig(device="cpu", max_model_len=64))
    assert all(p.qkv is not None for p in engine.runner.projections)
    version = {k: v.clone() + 0.01 for k, v in engine.model.state_dict().items()}
    engine.update_weights(version, 1)
    assert all(p.qkv is not None for p in projections.fused(engine.model))
    q = engine.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, version["model.layers.0.self_attn.q_proj.weight"])
