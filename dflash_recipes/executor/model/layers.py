"""The drafter's layers: KV-injection attention (dense, split and flex kernels), the SwiGLU MLP
and the pre-norm decoder layer every drafter kind builds on.

:class:`DraftDecoderLayer` is plain DFlash's layer; a kind whose layers differ (DFlash 2's
convolutions around each sublayer) subclasses it in its kind module
(:meth:`~dflash_recipes.executor.kinds.protocol.KindModules.build_layer`), and
:class:`~dflash_recipes.executor.model.draft.DFlashDraftModel` stacks whichever the kind builds.
Parameter names are the z-lab checkpoint keys under ``layers.{i}.``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash_recipes.executor.model.masks import DraftMask, SplitBlockMask
from dflash_recipes.plan.draft_spec import ResolvedDraft

#: Cached decoding: given the block's keys and values ``[B, kv_heads, Q, d]``, the keys and
#: values of the kept context followed by the block.
KVJoin = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, heads, S, d]`` by ``cos``/``sin [B, S, d]`` (HF's rotate-half layout)."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


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

    def reset_kind_parameters(self) -> None:
        """Initialise what a kind adds to the layer, after the drafter's own initialisation of
        every linear and norm (nothing in a plain DFlash layer)."""

    def forward_cached(
        self, x: Tensor, join: KVJoin, cos: Tensor, sin: Tensor, mask: Tensor
    ) -> Tensor:
        """:meth:`forward` with the context's keys and values kept (cached decoding)."""
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), join, cos, sin, mask)
        result: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


__all__ = [
    "DraftAttention",
    "DraftDecoderLayer",
    "DraftMLP",
    "KVJoin",
    "apply_rope",
]
