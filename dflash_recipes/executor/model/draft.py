"""The DFlash draft module (docs/dflash.md, "The drafter in one paragraph") and its masks.

Parameter names are the z-lab checkpoint keys, so ``state_dict()`` of a
:class:`DFlashDraftModel` is exactly what an engine loads: no prefix, no embeddings, no
``lm_head``, no rotary buffers (they are not persistent). A kind's head (Domino, DSpark;
:mod:`dflash_recipes.executor.kinds`) puts its submodules at the top level (``prefix_gru.*``,
``markov_w1.*``, ...), as in reference section 6.

Shapes used below: ``B`` batch, ``N`` blocks per sequence, ``bs`` block size, ``Q = N * bs``
packed block positions, ``T`` context length (target positions), ``H`` hidden size.

Masks (docs/dflash.md, "The training objective", step 3): a query in block ``b`` with anchor
``a_b`` sees the context
positions ``j < a_b`` (not the anchor's own context state, nothing later) and every position
of its own block (bidirectional); nothing of other blocks. A padded block (``valid`` False)
sees only its own block, so no attention row is ever empty and no NaN appears. Two
representations with the same semantics: a dense boolean tensor ``[B, 1, Q, T + Q]`` (CPU and
tests, via SDPA) and a flex-attention :class:`BlockMask` built from tile arithmetic, without
materialising the dense mask (the CUDA path).

``sliding_attention`` layers (``spec.layer_types``) narrow whichever mask they are given to a
causal window of positions (:func:`sliding_window_mask`): a query at position ``t`` keeps the
keys at positions ``p`` with ``0 <= t - p < sliding_window``, as the reference implementations
serve them (docs/dflash.md, "Sliding-window layers"). The forward builds that mask once per
distinct window, so callers keep passing the full-attention mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash_recipes.executor.kinds.protocol import KindHead
from dflash_recipes.executor.kinds.registry import kind_modules
from dflash_recipes.executor.model.masks import (
    DraftMask,
    SplitBlockMask,
    build_dense_block_mask,
    build_flex_block_mask,
    build_split_block_mask,
    sliding_window_mask,
)
from dflash_recipes.plan.attention_chunks import (
    MAX_CHUNK_QUERIES,
    MAX_SPLIT_SCORES,
    split_chunk_count,
)
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RopePlan, RopeValue

#: Cached decoding: given the block's keys and values ``[B, kv_heads, Q, d]``, the keys and
#: values of the kept context followed by the block.
KVJoin = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]

#: Standard deviation of the normal initialisation of linear and embedding weights (HF default).
INIT_STD = 0.02


# ---------------------------------------------------------------------------------------------
# RoPE: always the target's settings, carried by the plan
# ---------------------------------------------------------------------------------------------


def rope_parameters(rope: RopePlan) -> dict[str, RopeValue]:
    """The transformers-5 ``rope_parameters`` dict of a plan's RoPE settings.

    ``rope_theta`` and ``rope_type`` come from the plan's own fields; a legacy ``type`` key or
    a stray ``rope_theta`` inside ``rope_scaling`` never overrides them.
    """
    params: dict[str, RopeValue] = {"rope_type": rope.rope_type, "rope_theta": rope.rope_theta}
    for key, value in (rope.rope_scaling or {}).items():
        if key not in ("rope_type", "type", "rope_theta"):
            params[key] = value
    return params


def rope_config(spec: ResolvedDraft) -> Qwen3Config:
    """A Qwen3 config carrying only what the rotary embedding reads (dims and RoPE settings)."""
    return Qwen3Config(
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters=rope_parameters(spec.rope),
    )


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, heads, S, d]`` by ``cos``/``sin [B, S, d]`` (HF's rotate-half layout)."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# sliding-window layers: the block mask narrowed to a causal window of positions
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# taps
# ---------------------------------------------------------------------------------------------


def taps_from_hidden_states(
    hidden_states: Sequence[Tensor], target_layer_ids: Sequence[int]
) -> Tensor:
    """Concatenate the outputs of target layers ``target_layer_ids`` on the feature axis.

    ``hidden_states`` is Hugging Face's ``output_hidden_states`` tuple (index 0 is the
    embedding output), so layer ``k``'s output is ``hidden_states[k + 1]``.
    """
    n_layers = len(hidden_states) - 1
    bad = [k for k in target_layer_ids if not 0 <= k < n_layers]
    if bad:
        msg = (
            f"target_layer_ids {list(target_layer_ids)} reach outside the target's {n_layers} "
            f"decoder layers (ids {bad}); valid ids are 0..{n_layers - 1}"
        )
        raise ValueError(msg)
    return torch.cat([hidden_states[k + 1] for k in target_layer_ids], dim=-1)


# ---------------------------------------------------------------------------------------------
# attention kernels
# ---------------------------------------------------------------------------------------------


_compiled_flex: Callable[..., object] | None = None


def _flex_kernel(device: torch.device) -> Callable[..., object]:
    """flex_attention, compiled on CUDA (the fused kernel); eager elsewhere (tests)."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        # Default dynamism: one static compile, then a dynamic one if lengths vary by batch.
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sink: Tensor | None) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
    # A learnable sink is one extra logit per head with a zero value vector.
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    sink_col = sink.float().view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _split_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: SplitBlockMask, sink: Tensor | None
) -> Tensor:
    """Attention per chunk of blocks over [visible context ; the chunk's blocks] (see the mask)."""
    batch, heads, q_len, dim = q.shape
    bs = mask.block_size
    if not mask.chunks:
        return q.new_zeros(batch, heads, q_len, dim)
    ctx_len = k.shape[2] - q_len
    if len(mask.chunks) == 1 and mask.chunks[0][2] == ctx_len:
        # One chunk over the whole context: the keys and values are k and v as they are.
        return _dense_attention(q, k, v, mask.masks[0], sink)
    sizes = [(end - first) * bs for first, end, _ in mask.chunks]
    k_ctx, *k_blocks = torch.split(k, [ctx_len, *sizes], dim=2)
    v_ctx, *v_blocks = torch.split(v, [ctx_len, *sizes], dim=2)
    outputs = []
    for (_, _, visible), q_c, k_c, v_c, mask_c in zip(
        mask.chunks, torch.split(q, sizes, dim=2), k_blocks, v_blocks, mask.masks, strict=True
    ):
        keys = torch.cat([k_ctx[:, :, :visible], k_c], dim=2)
        values = torch.cat([v_ctx[:, :, :visible], v_c], dim=2)
        outputs.append(_dense_attention(q_c, keys, values, mask_c, sink))
    return torch.cat(outputs, dim=2)


def _flex_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, sink: Tensor | None
) -> Tensor:
    kernel = _flex_kernel(q.device)
    gqa = q.shape[1] != k.shape[1]
    if sink is None:
        out = kernel(q, k, v, block_mask=mask, enable_gqa=gqa)
        assert isinstance(out, Tensor)
        return out
    result = kernel(q, k, v, block_mask=mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    assert isinstance(result, tuple)
    out, aux = result
    assert isinstance(out, Tensor) and isinstance(aux.lse, Tensor)
    # sum_j e^s_j v_j / (Z + e^b) = out * sigmoid(log Z - b)
    scale = torch.sigmoid(aux.lse - sink.float().view(1, -1, 1))
    return out * scale.unsqueeze(-1).to(out.dtype)


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------


class DraftAttention(nn.Module):
    """KV-injection attention: queries from the block, keys/values over [context ; block]."""

    def __init__(self, spec: ResolvedDraft) -> None:
        super().__init__()
        if spec.num_attention_heads % spec.num_key_value_heads != 0:
            msg = (
                f"num_attention_heads {spec.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {spec.num_key_value_heads}"
            )
            raise ValueError(msg)
        hidden, head_dim = spec.hidden_size, spec.head_dim
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_key_value_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(head_dim, eps=spec.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=spec.rms_norm_eps)
        self.attention_sink_bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(self.num_heads)) if spec.attention_sink else None
        )

    def forward(
        self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor, mask: DraftMask
    ) -> Tensor:
        """``x [B, Q, H]`` (normed block states), ``context [B, T, H]``, cos/sin ``[B, T+Q, d]``."""
        batch, q_len, _ = x.shape
        ctx_len = context.shape[1]
        kv_in = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(batch, q_len, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(batch, ctx_len + q_len, -1, self.head_dim))
        v = self.v_proj(kv_in).view(batch, ctx_len + q_len, -1, self.head_dim)
        q = apply_rope(q.transpose(1, 2), cos[:, ctx_len:], sin[:, ctx_len:])
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        if isinstance(mask, BlockMask):
            out = _flex_attention(q, k, v, mask, self.attention_sink_bias)
        elif isinstance(mask, SplitBlockMask):
            out = _split_attention(q, k, v, mask, self.attention_sink_bias)
        else:
            out = _dense_attention(q, k, v, mask, self.attention_sink_bias)
        out = out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)
        result: Tensor = self.o_proj(out)
        return result

    def context_kv(self, states: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (normed, rotated) and values ``[B, kv_heads, T, d]`` of ``states [B, T, H]`` at
        the positions of ``cos``/``sin`` ``[B, T, d]``, as :meth:`forward` computes them.

        Per position, so the context's part can be computed once and kept (cached decoding).
        """
        batch, length, _ = states.shape
        k = self.k_norm(self.k_proj(states).view(batch, length, -1, self.head_dim))
        v = self.v_proj(states).view(batch, length, -1, self.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward_cached(
        self, x: Tensor, join: KVJoin, cos: Tensor, sin: Tensor, mask: Tensor
    ) -> Tensor:
        """:meth:`forward` with the context's keys and values kept (:meth:`context_kv`):
        ``join(block_k, block_v)`` returns the keys and values of context then block;
        ``cos``/``sin [B, Q, d]`` of the block positions only; a dense mask."""
        batch, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, q_len, self.num_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k, v = join(*self.context_kv(x, cos, sin))
        out = _dense_attention(q, k, v, mask, self.attention_sink_bias)
        out = out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)
        result: Tensor = self.o_proj(out)
        return result


class DraftMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class DraftDecoderLayer(nn.Module):
    """Pre-norm residual layer: attention with KV injection, then the SwiGLU MLP."""

    def __init__(self, spec: ResolvedDraft) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = DraftAttention(spec)
        self.post_attention_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = DraftMLP(spec.hidden_size, spec.intermediate_size)

    def forward(
        self, x: Tensor, context: Tensor, cos: Tensor, sin: Tensor, mask: DraftMask
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        result: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result

    def forward_cached(
        self, x: Tensor, join: KVJoin, cos: Tensor, sin: Tensor, mask: Tensor
    ) -> Tensor:
        """:meth:`forward` with the context's keys and values kept (cached decoding)."""
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), join, cos, sin, mask)
        result: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class DFlashDraftModel(nn.Module):
    """The drafter of a resolved plan; ``state_dict()`` is the z-lab export.

    Build it from ``plan.resolved_draft()``. ``generator`` seeds the initialisation (normal
    0.02 for linear and embedding weights, ones for norms, zeros for sinks; head output layers
    start at zero so a fresh head leaves the backbone logits unchanged).
    """

    _head: KindHead | None

    def __init__(self, spec: ResolvedDraft, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.spec = spec
        hidden = spec.hidden_size
        n_taps = len(spec.target_layer_ids)
        self.fc = nn.Linear(n_taps * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=spec.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(spec) for _ in range(spec.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=spec.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(rope_config(spec))
        head = kind_modules(spec.projector_type).build_head(spec)
        # The head's submodules are registered here, at the top level, so their keys carry no
        # prefix (as Domino and DSpark exports do); the head object itself is kept outside the
        # module tree.
        object.__setattr__(self, "_head", head)
        if head is not None:
            for name, child in head.named_children():
                self.add_module(name, child)
        self.reset_parameters(generator)

    @property
    def head(self) -> KindHead | None:
        """The kind's head (sharing this module's parameters; built by its ``KindModules``),
        or None for plain DFlash."""
        return self._head

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Fresh initialisation of every parameter (see the class docstring)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD, generator=generator)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, DraftAttention) and module.attention_sink_bias is not None:
                nn.init.zeros_(module.attention_sink_bias)
        if self._head is not None:
            self._head.reset_parameters(generator)

    def fuse_context(self, tapped: Tensor) -> Tensor:
        """``[B, T, n_taps * H]`` tapped target states -> ``[B, T, H]`` (fc, then hidden_norm),
        in the module's parameter dtype."""
        fused: Tensor = self.hidden_norm(self.fc(tapped.to(self.fc.weight.dtype)))
        return fused

    def forward(
        self,
        block_embeds: Tensor,
        context: Tensor,
        q_positions: Tensor,
        ctx_positions: Tensor,
        mask: DraftMask,
    ) -> Tensor:
        """Draft states ``[B, Q, H]`` after the final norm (apply the target's lm_head next),
        in the module's parameter dtype.

        ``block_embeds [B, Q, H]``: embedded packed blocks; ``context [B, T, H]``: the fused
        context (:meth:`fuse_context`); ``q_positions [B, Q]`` and ``ctx_positions [B, T]``:
        RoPE positions; ``mask``: :func:`build_dense_block_mask`, :func:`build_split_block_mask`
        or :func:`build_flex_block_mask` (full attention; ``sliding_attention`` layers narrow it
        with :func:`sliding_window_mask`).
        """
        # Inputs follow the weights (float32 master weights under a bf16 target); autocast,
        # when on, still runs the matmuls in low precision.
        dtype = self.fc.weight.dtype
        x = block_embeds.to(dtype)
        context = context.to(dtype)
        positions = torch.cat([ctx_positions, q_positions], dim=1)
        cos, sin = self.rotary_emb(x, positions)
        # Sliding-window layers get the mask narrowed to their window, built once per forward.
        masks: dict[int | None, DraftMask] = {None: mask}
        for index, layer in enumerate(self.layers):
            window = self.spec.layer_window(index)
            if window not in masks:
                assert window is not None
                masks[window] = sliding_window_mask(mask, q_positions, ctx_positions, window)
            x = layer(x, context, cos, sin, masks[window])
        result: Tensor = self.norm(x)
        return result


__all__ = [
    "INIT_STD",
    "MAX_CHUNK_QUERIES",
    "MAX_SPLIT_SCORES",
    "DFlashDraftModel",
    "DraftAttention",
    "DraftDecoderLayer",
    "DraftMLP",
    "DraftMask",
    "KVJoin",
    "SplitBlockMask",
    "apply_rope",
    "build_dense_block_mask",
    "build_flex_block_mask",
    "build_split_block_mask",
    "rope_config",
    "rope_parameters",
    "sliding_window_mask",
    "split_chunk_count",
    "taps_from_hidden_states",
]
