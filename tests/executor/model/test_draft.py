"""The draft module: z-lab names, numerics against a per-block reference, visibility, RoPE, taps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from testkit.numerics import assert_equal_up_to_rounding
from testkit.tiny import randomize, tiny_plan, tiny_target
from torch import Tensor

from dflash_recipes.checkpoint.tensor_layout import expected_layout
from dflash_recipes.executor.model.draft import DFlashDraftModel, taps_from_hidden_states
from dflash_recipes.executor.model.masks import build_dense_block_mask
from dflash_recipes.executor.model.warmstart import layout_spec
from dflash_recipes.executor.training.anchors import block_positions

BLOCK = 4
CTX = 14
# Two sequences, three blocks each; the last block of sequence 1 is padding.
ANCHORS = torch.tensor([[3, 7, 10], [0, 5, 0]])
VALID = torch.tensor([[True, True, True], [True, True, False]])


def inputs(model: DFlashDraftModel, seed: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, n_blocks = ANCHORS.shape
    hidden = model.spec.hidden_size
    block_embeds = torch.randn(batch, n_blocks * BLOCK, hidden, generator=gen)
    context = torch.randn(batch, CTX, hidden, generator=gen)
    q_positions = block_positions(ANCHORS, BLOCK)
    ctx_positions = torch.arange(CTX).expand(batch, CTX)
    return block_embeds, context, q_positions, ctx_positions


def packed_forward(model: DFlashDraftModel, block_embeds: Tensor, context: Tensor) -> Tensor:
    mask = build_dense_block_mask(ANCHORS, BLOCK, CTX, VALID)
    q_positions = block_positions(ANCHORS, BLOCK)
    ctx_positions = torch.arange(CTX).expand(ANCHORS.shape[0], CTX)
    with torch.no_grad():
        out: Tensor = model(block_embeds, context, q_positions, ctx_positions, mask)
    return out


# --- the obviously-correct reference: one block at a time, basic tensor ops ------------------


def rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x [S, heads, d]: rotate dimension i with i + d/2 by position * theta^(-2i/d)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = (positions.double()[:, None] * inv_freq[None, :]).float()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)


def reference_block(
    model: DFlashDraftModel, block: Tensor, context: Tensor, anchor: int, theta: float
) -> Tensor:
    """Draft states of one block [bs, H]: attention over [context[:anchor] ; block]."""
    spec = model.spec
    eps = spec.rms_norm_eps
    n_heads, n_kv, d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    ctx = context[:anchor]
    k_positions = torch.cat([torch.arange(anchor), anchor + torch.arange(block.shape[0])])
    q_positions = anchor + torch.arange(block.shape[0])
    x = block
    for layer in model.layers:
        attn = layer.self_attn
        h = rms(x, layer.input_layernorm.weight, eps)
        kv_in = torch.cat([ctx, h])
        q = rms((h @ attn.q_proj.weight.T).view(-1, n_heads, d), attn.q_norm.weight, eps)
        k = rms((kv_in @ attn.k_proj.weight.T).view(-1, n_kv, d), attn.k_norm.weight, eps)
        v = (kv_in @ attn.v_proj.weight.T).view(-1, n_kv, d)
        q, k = rope(q, q_positions, theta), rope(k, k_positions, theta)
        heads = []
        for head in range(n_heads):
            kv_head = head // (n_heads // n_kv)
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(d)
            if attn.attention_sink_bias is not None:
                sink = attn.attention_sink_bias[head].expand(scores.shape[0], 1)
                probs = torch.softmax(torch.cat([scores, sink], -1), -1)[:, :-1]
            else:
                probs = torch.softmax(scores, -1)
            heads.append(probs @ v[:, kv_head])
        x = x + torch.cat(heads, -1) @ attn.o_proj.weight.T
        h = rms(x, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        gate = h @ mlp.gate_proj.weight.T
        x = x + (gate * torch.sigmoid(gate) * (h @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms(x, model.norm.weight, eps)


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "count"),
    [
        ({}, 3 + 11 * 2),
        ({"num_hidden_layers": 5}, 58),
        ({"attention_sink": True}, 3 + 12 * 2),
        ({"projector_type": "domino", "emb_dim": 16, "gru_hidden_dim": 8}, 25 + 4),
        ({"projector_type": "dspark", "markov_rank": 4, "use_confidence_head": True}, 25 + 4),
    ],
)
def test_state_dict_is_the_z_lab_layout(
    tmp_path: Path, overrides: dict[str, object], count: int
) -> None:
    plan = tiny_plan(tmp_path, **overrides)
    model = DFlashDraftModel(plan.resolved_draft())
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert len(shapes) == count
    assert shapes == expected_layout(layout_spec(plan.resolved_draft()))
    assert not any("embed_tokens" in n or "lm_head" in n or "rotary" in n for n in shapes)
    assert "rotary_emb.inv_freq" in dict(model.named_buffers())  # kept, but never saved


@pytest.mark.parametrize("sink", [False, True])
def test_packed_forward_matches_per_block_reference(tmp_path: Path, sink: bool) -> None:
    torch.manual_seed(0)
    plan = tiny_plan(tmp_path, attention_sink=sink, rope_theta=10_000.0)
    model = DFlashDraftModel(plan.resolved_draft())
    randomize(model)
    block_embeds, context, _, _ = inputs(model)
    out = packed_forward(model, block_embeds, context)
    assert torch.isfinite(out).all(), "padded blocks must not produce NaN"
    with torch.no_grad():
        for b in range(ANCHORS.shape[0]):
            for n in range(ANCHORS.shape[1]):
                if not VALID[b, n]:
                    continue
                rows = slice(n * BLOCK, (n + 1) * BLOCK)
                expected = reference_block(
                    model, block_embeds[b, rows], context[b], int(ANCHORS[b, n]), 10_000.0
                )
                assert_equal_up_to_rounding(out[b, rows], expected, what=f"block {b}, {n}")


def test_block_sees_only_earlier_context_and_its_own_block(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path)
    model = DFlashDraftModel(plan.resolved_draft())
    randomize(model)
    block_embeds, context, _, _ = inputs(model)
    base = packed_forward(model, block_embeds, context)
    b, n = 0, 1  # anchor 7
    anchor = int(ANCHORS[b, n])
    rows = slice(n * BLOCK, (n + 1) * BLOCK)

    def changed(embeds: Tensor, ctx: Tensor) -> bool:
        return not torch.allclose(packed_forward(model, embeds, ctx)[b, rows], base[b, rows])

    own_state = context.clone()
    own_state[b, anchor] += 5.0
    assert not changed(block_embeds, own_state), "the block saw its anchor's own context state"
    later = context.clone()
    later[b, anchor + 1 :] += 5.0
    assert not changed(block_embeds, later), "the block saw later context"
    others = block_embeds.clone()
    others[b, : n * BLOCK] += 5.0
    others[b, (n + 1) * BLOCK :] += 5.0
    assert not changed(others, context), "the block saw another block"
    other_sequence = context.clone()
    other_sequence[1] += 5.0
    assert not changed(block_embeds, other_sequence)

    earlier = context.clone()
    earlier[b, anchor - 1] += 5.0
    assert changed(block_embeds, earlier), "the block must see the context before its anchor"
    inside = block_embeds.clone()
    inside[b, n * BLOCK + BLOCK - 1] += 5.0
    first = packed_forward(model, inside, context)[b, n * BLOCK]
    assert not torch.allclose(first, base[b, n * BLOCK]), "attention inside a block is two-way"


def test_rope_theta_comes_from_the_plan(tmp_path: Path) -> None:
    low = DFlashDraftModel(tiny_plan(tmp_path, rope_theta=10_000.0).resolved_draft())
    high = DFlashDraftModel(tiny_plan(tmp_path, rope_theta=1_000_000.0).resolved_draft())
    randomize(low)
    high.load_state_dict(low.state_dict())
    d = low.spec.head_dim
    expected = 1.0 / 1_000_000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    torch.testing.assert_close(high.rotary_emb.inv_freq, expected, rtol=1e-6, atol=0)
    block_embeds, context, _, _ = inputs(low)
    assert not torch.allclose(
        packed_forward(low, block_embeds, context), packed_forward(high, block_embeds, context)
    )


def test_rope_scaling_of_the_target_is_used(tmp_path: Path) -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    plain = DFlashDraftModel(tiny_plan(tmp_path, rope_theta=500_000.0).resolved_draft())
    llama3 = DFlashDraftModel(
        tiny_plan(
            tmp_path, rope_theta=500_000.0, rope_type="llama3", rope_scaling=scaling
        ).resolved_draft()
    )
    # llama3 scaling divides the low frequencies by `factor` and keeps the high ones.
    assert llama3.rotary_emb.inv_freq[0] == plain.rotary_emb.inv_freq[0]
    torch.testing.assert_close(llama3.rotary_emb.inv_freq[-1], plain.rotary_emb.inv_freq[-1] / 8)


def test_padded_blocks_give_finite_outputs_and_gradients(tmp_path: Path) -> None:
    model = DFlashDraftModel(tiny_plan(tmp_path).resolved_draft())
    anchors = torch.tensor([[0, 0]])
    valid = torch.tensor([[False, False]])
    mask = build_dense_block_mask(anchors, BLOCK, 5, valid)
    embeds = torch.randn(1, 2 * BLOCK, 64)
    out = model(
        embeds, torch.randn(1, 5, 64), block_positions(anchors, BLOCK), torch.arange(5)[None], mask
    )
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_taps_are_outputs_of_target_decoder_layers(tmp_path: Path) -> None:
    plan = tiny_plan(tmp_path, target_layer_ids=(0, 2))
    target = tiny_target(plan)
    captured: dict[int, Tensor] = {}
    for k, layer in enumerate(target.model.layers):
        layer.register_forward_hook(
            lambda _m, _a, out, k=k: captured.__setitem__(
                k, out[0] if isinstance(out, tuple) else out
            )
        )
    with torch.no_grad():
        result = target(torch.randint(0, 100, (2, 9)), output_hidden_states=True)
    taps = taps_from_hidden_states(result.hidden_states, (0, 2))
    assert taps.shape == (2, 9, 2 * 64)
    assert torch.equal(taps[..., :64], captured[0])
    assert torch.equal(taps[..., 64:], captured[2])
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.3"):
        taps_from_hidden_states(result.hidden_states, (1, 4))


def test_fuse_context_is_fc_then_hidden_norm(tmp_path: Path) -> None:
    model = DFlashDraftModel(tiny_plan(tmp_path).resolved_draft())
    randomize(model)
    tapped = torch.randn(2, 5, 2 * 64)
    with torch.no_grad():
        fused = model.fuse_context(tapped)
        expected = rms(tapped @ model.fc.weight.T, model.hidden_norm.weight, 1e-6)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
