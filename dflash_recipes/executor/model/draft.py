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

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflash_recipes.executor.kinds.protocol import KindHead
from dflash_recipes.executor.kinds.registry import kind_modules
from dflash_recipes.executor.model.layers import (
    DraftAttention,
    DraftDecoderLayer,
    DraftMLP,
    KVJoin,
    apply_rope,
)
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


# ---------------------------------------------------------------------------------------------
# taps
# ---------------------------------------------------------------------------------------------


def taps_from_hidden_states(
    hidden_states: Sequence[Tensor], target_layer_ids: Sequence[int]
) -> Tensor:
    """Concatenate the outputs of target layers ``target_layer_ids`` on the feature axis.

    ``hidden_states`` is Hugging Face's ``output_hidden_states`` tuple (index 0 is the
    embedding output), so layer ``k``'s output is ``hidden_states[k + 1]``, except the last
    layer's: Hugging Face's last entry is after the final norm, while a DFlash tap is the
    layer's own output (what serving engines feed the drafter). A tap on the last layer is
    refused here; :func:`~dflash_recipes.executor.model.target_states.target_states` takes
    every tap as training does.
    """
    n_layers = len(hidden_states) - 1
    bad = [k for k in target_layer_ids if not 0 <= k < n_layers]
    if bad:
        msg = (
            f"target_layer_ids {list(target_layer_ids)} reach outside the target's {n_layers} "
            f"decoder layers (ids {bad}); valid ids are 0..{n_layers - 1}"
        )
        raise ValueError(msg)
    if n_layers - 1 in target_layer_ids:
        msg = (
            f"tap {n_layers - 1} is the target's last layer: output_hidden_states[{n_layers}] "
            "is after the final norm, not the layer's output that training and serving engines "
            "use; take the taps with dflash_recipes.executor.model.target_states.target_states"
        )
        raise ValueError(msg)
    return torch.cat([hidden_states[k + 1] for k in target_layer_ids], dim=-1)


class DFlashDraftModel(nn.Module):
    """The drafter of a resolved plan; ``state_dict()`` is the z-lab export.

    Build it from ``plan.resolved_draft()``. ``generator`` seeds the initialisation (normal
    0.02 for linear and embedding weights, ones for norms, zeros for sinks; head output layers
    start at zero so a fresh head leaves the backbone logits unchanged).
    """

    _head: KindHead | None
    #: Recompute each decoder layer in the backward instead of keeping its activations
    #: (``training.activation_checkpointing``; only while training with gradients on).
    activation_checkpointing: bool = False

    def __init__(self, spec: ResolvedDraft, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.spec = spec
        hidden = spec.hidden_size
        n_taps = len(spec.target_layer_ids)
        self.fc = nn.Linear(n_taps * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=spec.rms_norm_eps)
        kind = kind_modules(spec.projector_type)
        self.layers = nn.ModuleList(kind.build_layer(spec) for _ in range(spec.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=spec.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(rope_config(spec))
        head = kind.build_head(spec)
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
        for layer in self.layers:
            assert isinstance(layer, DraftDecoderLayer)
            layer.reset_kind_parameters()
        if self._head is not None:
            self._head.reset_parameters(generator)

    def fuse_context(self, tapped: Tensor) -> Tensor:
        """``[B, T, n_taps * H]`` tapped target states (the target's dtype) -> ``[B, T, H]``
        (fc, then hidden_norm), in the module's parameter dtype.

        Under autocast the taps go to ``fc`` as they are (autocast runs the matmul in its own
        dtype, the target's): no float32 copy of the largest step input. Without autocast they
        are cast to the parameters' dtype first."""
        if not torch.is_autocast_enabled(tapped.device.type):
            tapped = tapped.to(self.fc.weight.dtype)
        fused: Tensor = self.hidden_norm(self.fc(tapped))
        return fused

    def block_states(self, block_embeds: Tensor) -> Tensor:
        """The first layer's input: the block's target embeddings ``[B, Q, H]`` in the module's
        parameter dtype, times ``input_embedding_scale`` when the drafter has one (DFlash 2)."""
        x = block_embeds.to(self.fc.weight.dtype)
        scale = self.spec.input_embedding_scale
        return x if scale is None or scale == 1.0 else x * scale

    def layer_masks(
        self, mask: DraftMask, q_positions: Tensor, ctx_positions: Tensor
    ) -> list[DraftMask]:
        """Each layer's mask: `mask` (full attention) for a full-attention layer, narrowed to its
        window for a ``sliding_attention`` one (built once per distinct window), causal inside
        the block unless the kind's sliding layers are not (``ResolvedDraft.sliding_causal``)."""
        masks: dict[int | None, DraftMask] = {None: mask}
        out: list[DraftMask] = []
        for index in range(len(self.layers)):
            window = self.spec.layer_window(index)
            if window not in masks:
                assert window is not None
                masks[window] = sliding_window_mask(
                    mask, q_positions, ctx_positions, window, causal=self.spec.sliding_causal
                )
            out.append(masks[window])
        return out

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
        x = self.block_states(block_embeds)
        context = context.to(x.dtype)
        positions = torch.cat([ctx_positions, q_positions], dim=1)
        cos, sin = self.rotary_emb(x, positions)
        # Sliding-window layers get the mask narrowed to their window, built once per forward.
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer, layer_mask in zip(
            self.layers, self.layer_masks(mask, q_positions, ctx_positions), strict=True
        ):
            if recompute:  # keep only the layer's input; its backward runs it again
                x = checkpoint(layer, x, context, cos, sin, layer_mask, use_reentrant=False)
            else:
                x = layer(x, context, cos, sin, layer_mask)
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
