"""DFlash drafter for `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`.

Written by dflash-recipes next to an exported drafter (`model.safetensors` + `config.json`, whose
`auto_map` names `dflash.DFlashDraftModel`). Self-contained: it imports only torch and
transformers. It computes what the dflash-recipes drafter computes, tensor for tensor:

- `fc` fuses the concatenated tapped target states (`dflash_config.target_layer_ids`; id `k` is
  decoder layer `k`'s output, `output_hidden_states[k + 1]`, before the final norm for the last
  layer), then `hidden_norm`;
- every layer: queries from the block, keys and values over `[context ; block]` with its own
  projections, per-head `q_norm` / `k_norm`, RoPE (the target's settings), grouped-query
  attention, an optional learnable sink per head, then the SwiGLU MLP; pre-norm residuals;
- `full_attention` layers: every query sees the whole context and the whole block;
  `sliding_attention` layers: a query at position `t` sees key position `p` only when
  `0 <= t - p < sliding_window` (causal, the query itself included);
- the final `norm`. Apply the target's `lm_head` to the result; the target's `embed_tokens`
  embeds the block `[anchor, mask, ..., mask]` (`dflash_config.mask_token_id`).

Head variants (Domino, DSpark) are not implemented here: loading one raises an error.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding


def _dflash_settings(config: Qwen3Config) -> dict[str, object]:
    settings = getattr(config, "dflash_config", None)
    return dict(settings) if isinstance(settings, dict) else {}


def _size(config: Qwen3Config, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        msg = f"config.json needs a positive integer {name}, got {value!r}; re-export the drafter"
        raise ValueError(msg)
    return value


def _eps(config: Qwen3Config) -> float:
    return float(getattr(config, "rms_norm_eps", None) or 1e-6)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(nn.Module):
    """Block queries; keys and values over the fused context followed by the block."""

    def __init__(self, config: Qwen3Config, layer_idx: int, sink: bool) -> None:
        super().__init__()
        hidden = _size(config, "hidden_size")
        self.num_heads = _size(config, "num_attention_heads")
        self.num_kv_heads = _size(config, "num_key_value_heads")
        self.head_dim = _size(config, "head_dim")
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=_eps(config))
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=_eps(config))
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads)) if sink else None

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        batch, q_len, _ = x.shape
        ctx_len = context.shape[1]
        kv_in = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(batch, q_len, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(batch, ctx_len + q_len, -1, self.head_dim))
        v = self.v_proj(kv_in).view(batch, ctx_len + q_len, -1, self.head_dim)
        q = _rope(q.transpose(1, 2), cos[:, ctx_len:], sin[:, ctx_len:])
        k = _rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        groups = self.num_heads // self.num_kv_heads
        if self.attention_sink_bias is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
        else:
            # The sink is one more logit per head whose value vector is zero.
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            scores = torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(self.head_dim)
            scores = scores.masked_fill(~mask, float("-inf"))
            sink = self.attention_sink_bias.float().view(1, -1, 1, 1)
            sink = sink.expand(batch, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            out = torch.matmul(probs.to(v.dtype), v)
        out = out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim)
        result: torch.Tensor = self.o_proj(out)
        return result


class DFlashMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        hidden, inner = _size(config, "hidden_size"), _size(config, "intermediate_size")
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual layer: KV-injection attention, then the MLP."""

    def __init__(self, config: Qwen3Config, layer_idx: int, sink: bool) -> None:
        super().__init__()
        hidden = _size(config, "hidden_size")
        self.input_layernorm = Qwen3RMSNorm(hidden, eps=_eps(config))
        self.self_attn = DFlashAttention(config, layer_idx, sink)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden, eps=_eps(config))
        self.mlp = DFlashMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        result: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class DFlashDraftModel(PreTrainedModel):
    """The drafter of a dflash-recipes export (no embeddings, no lm_head: the target's)."""

    config_class = Qwen3Config
    base_model_prefix = "dflash_draft"
    _no_split_modules = ["DFlashDecoderLayer"]  # noqa: RUF012 (transformers declares it so)

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        settings = _dflash_settings(config)
        projector = settings.get("projector_type", "dflash")
        if projector not in (None, "dflash"):
            msg = (
                f"this export has a {projector} head, which dflash.py does not implement; load "
                "it with dflash-recipes (`dflash-recipe eval`) instead"
            )
            raise ValueError(msg)
        taps = settings.get("target_layer_ids")
        if not isinstance(taps, list) or not taps:
            msg = "config.json lacks dflash_config.target_layer_ids; re-export the drafter"
            raise ValueError(msg)
        self.target_layer_ids = [int(t) for t in taps]
        self.mask_token_id = settings.get("mask_token_id")
        block_size = settings.get("block_size", getattr(config, "block_size", 16))
        self.block_size = block_size if isinstance(block_size, int) else 16
        sink = bool(settings.get("attention_sink_bias", settings.get("attention_sink", False)))
        n_layers = _size(config, "num_hidden_layers")
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * n_layers)
        if len(layer_types) != n_layers:
            msg = f"config.json has {len(layer_types)} layer_types for {n_layers} layers"
            raise ValueError(msg)
        self.windows: list[int | None] = [
            _size(config, "sliding_window") if kind == "sliding_attention" else None
            for kind in layer_types
        ]
        hidden = _size(config, "hidden_size")
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=_eps(config))
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, index, sink) for index in range(n_layers)
        )
        self.norm = Qwen3RMSNorm(hidden, eps=_eps(config))
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()  # type: ignore[no-untyped-call]

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Final-normed draft states `[B, Q, H]` of one block per sequence.

        `noise_embedding [B, Q, H]`: the embedded block; `target_hidden [B, T, n_taps * H]`: the
        tapped target states of the positions before the block (not yet fused);
        `position_ids [B, T + Q]`: the positions of the context, then of the block.
        """
        dtype = self.fc.weight.dtype
        x = noise_embedding.to(dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        cos, sin = self.rotary_emb(x, position_ids)
        q_pos = position_ids[:, context.shape[1] :]
        distance = q_pos.unsqueeze(-1) - position_ids.unsqueeze(-2)
        full = torch.ones_like(distance, dtype=torch.bool).unsqueeze(1)
        masks: dict[int | None, torch.Tensor] = {None: full}
        for window in self.windows:
            if window not in masks and window is not None:
                masks[window] = ((distance >= 0) & (distance < window)).unsqueeze(1)
        for layer, window in zip(self.layers, self.windows, strict=True):
            x = layer(x, context, cos, sin, masks[window])
        result: torch.Tensor = self.norm(x)
        return result
