"""Export a drafter in the z-lab layout that serving engines load (docs/dflash.md,
"What a run writes, and the export layout").

``model.safetensors`` holds the drafter's own tensors under their unprefixed keys (58 for a
5-layer plain drafter; no embeddings, no ``lm_head``, no rotary buffers) and ``config.json``
describes it, with RoPE settings and vocabulary taken from the target (the plan), never from
class defaults, and the attention kind of every layer (``layer_types``, ``sliding_window``).
For the DFlash 1 kinds ``dflash.py`` (the package's ``remote_code/dflash.py``) is copied next
to them and named by the config's ``auto_map``, so ``AutoModel.from_pretrained(export,
trust_remote_code=True)`` builds the drafter itself rather than a plain ``Qwen3Model``; a
DFlash 2 export has neither (the z-lab layout engines load without remote code: its kind's
``export_config``).

The export is atomic: everything is written into a temporary sibling directory, flushed, and
renamed into place; an existing export is replaced only once the new one is complete. A crash
leaves either the old export or the new one, never a half-written directory; the staging
directory a killed export leaves is removed by the next export to the same place.

What an export may replace is :mod:`dflash_recipes.files.export_target`'s rule: nothing but an
earlier export (recognised by the marker file each export writes) unless ``force``, and
never a run directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from dflash_recipes.card.writer import write_model_card
from dflash_recipes.checkpoint.kinds.protocol import JsonValue
from dflash_recipes.checkpoint.kinds.registry import kind_facts
from dflash_recipes.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE
from dflash_recipes.checkpoint.tensor_layout import (
    compare_layout,
    expected_layout,
    format_layout_diff,
)
from dflash_recipes.errors import PlanError
from dflash_recipes.executor.model.convert import dflash_module, torch_dtype
from dflash_recipes.executor.model.draft import rope_parameters
from dflash_recipes.executor.model.warmstart import layout_spec
from dflash_recipes.files.crashsafe import remove_stale_staging, staged_directory
from dflash_recipes.files.export_target import (
    EXPORT_MARKER,
    check_export_target,
    export_marker_text,
)
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan

ARCHITECTURE_NAME = "DFlashDraftModel"
#: The remote-code module of `AutoModel.from_pretrained(export, trust_remote_code=True)`.
REMOTE_CODE_FILE = "dflash.py"
REMOTE_CODE_CLASS = "dflash.DFlashDraftModel"

logger = logging.getLogger(__name__)


def drafter_config(spec: ResolvedDraft, dtype: str) -> dict[str, JsonValue]:
    """The ``config.json`` of an exported drafter (see docs/dflash.md, "Serving the export"):
    the fields every kind writes, then the kind's own (``KindFacts.export_config``)."""
    rope = spec.rope
    params: dict[str, JsonValue] = dict(rope_parameters(rope))
    scaling: dict[str, JsonValue] | None = None
    if rope.rope_type != "default" or rope.rope_scaling:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    dflash: dict[str, JsonValue] = {
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id,
        "target_layer_ids": list(spec.target_layer_ids),
        "projector_type": spec.projector_type,
        # The key vLLM and SGLang read (exports before it said `attention_sink`).
        "attention_sink_bias": spec.attention_sink,
    }
    common: dict[str, JsonValue] = {
        "architectures": [ARCHITECTURE_NAME],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": [spec.layer_type(i) for i in range(spec.num_hidden_layers)],
        **_sliding_window_fields(spec),
        "tie_word_embeddings": False,
        "vocab_size": spec.vocab_size,
        "rope_theta": rope.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": params,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_target_layers": spec.num_target_layers,
        "block_size": spec.block_size,
        "dflash_config": dflash,
        "dtype": dtype,
        "torch_dtype": dtype,
        "auto_map": {"AutoModel": REMOTE_CODE_CLASS},
    }
    return kind_facts(spec.projector_type).export_config(spec, common)


def serving_warnings(spec: ResolvedDraft) -> list[str]:
    """Why no serving engine computes what this drafter's head computes (empty for plain DFlash;
    the kind's ``KindFacts.serving_warnings``).

    An export of a head no engine serves must not look servable: `export_drafter` logs these.
    A Domino export with pure_draft_prefix_len 1 is what SGLang's Domino runtime serves.
    """
    return kind_facts(spec.projector_type).serving_warnings(spec)


def _sliding_window_fields(spec: ResolvedDraft) -> dict[str, JsonValue]:
    """`sliding_window` with `use_sliding_window` (transformers' Qwen3Config drops the window
    unless it is true, and engines read the window from that config object)."""
    sliding = spec.layer_types is not None and "sliding_attention" in spec.layer_types
    return {
        "use_sliding_window": sliding,
        "sliding_window": spec.sliding_window if sliding else None,
    }


def remote_code_source() -> bytes:
    """The bytes of the remote-code module written next to every export (`dflash.py`)."""
    package = resources.files("dflash_recipes.executor.model")
    return (package / "remote_code" / REMOTE_CODE_FILE).read_bytes()


def export_drafter(
    module_or_model: nn.Module,
    plan: RunPlan,
    out_dir: Path,
    *,
    dtype: str | None = None,
    force: bool = False,
    sources: Sequence[Path] = (),
) -> Path:
    """Write ``out_dir/model.safetensors`` and ``out_dir/config.json``; returns ``out_dir``.

    ``dtype`` (``bfloat16``, ``float16``, ``float32``) defaults to the plan's base-model dtype.
    Accepts a converted model or the drafter itself. Raises ReplaceRefusedError, before
    writing anything, when ``out_dir`` holds something other than an earlier export (with
    ``force``: anything but a run directory or one of ``sources``).
    """
    out_dir = Path(out_dir)
    check_export_target(out_dir, force=force, sources=sources)
    module = dflash_module(module_or_model)
    spec = plan.resolved_draft()
    dtype_name = dtype or plan.base_model.dtype
    target_dtype = torch_dtype(dtype_name)
    state = module.state_dict()
    expected = expected_layout(layout_spec(spec))
    diff = compare_layout(expected, {n: tuple(t.shape) for n, t in state.items()})
    if not diff.is_empty:
        msg = "the drafter does not match the plan it is exported with:\n" + format_layout_diff(
            diff
        )
        raise PlanError(msg)
    tensors = {
        name: t.detach().to(device="cpu", dtype=target_dtype).contiguous()
        for name, t in state.items()
    }
    config = drafter_config(spec, dtype_name)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out_dir)
    with staged_directory(out_dir) as staging:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        text = json.dumps(config, indent=2, allow_nan=False) + "\n"
        (staging / CONFIG_FILE).write_text(text, encoding="utf-8")
        if "auto_map" in config:  # a kind whose engines load it without remote code omits it
            (staging / REMOTE_CODE_FILE).write_bytes(remote_code_source())
        write_model_card(staging, plan, sources=sources, serving_notes=serving_warnings(spec))
        files = [child.name for child in staging.iterdir()]
        (staging / EXPORT_MARKER).write_text(export_marker_text(files), encoding="utf-8")
    for warning in serving_warnings(spec):
        logger.warning("%s", warning)
    return out_dir


__all__ = [
    "ARCHITECTURE_NAME",
    "REMOTE_CODE_CLASS",
    "REMOTE_CODE_FILE",
    "drafter_config",
    "export_checkpoint",
    "export_drafter",
    "remote_code_source",
    "serving_warnings",
]


def export_checkpoint(
    checkpoint_dir: Path,
    plan: RunPlan,
    out_dir: Path,
    *,
    dtype: str | None = None,
    force: bool = False,
) -> Path:
    """Export the drafter weights of a training checkpoint (or another export) to `out_dir`.

    Builds the plan's drafter, loads the checkpoint's weights exactly (names, shapes and dtypes
    checked), then writes the z-lab layout atomically. Never reads ``dflash_init_checkpoint``.
    The target is checked (see :func:`export_drafter`) before the checkpoint is read.
    """
    check_export_target(Path(out_dir), force=force, sources=(Path(checkpoint_dir),))
    from dflash_recipes.executor.model.draft import DFlashDraftModel
    from dflash_recipes.executor.model.weights import load_drafter_weights

    drafter = DFlashDraftModel(plan.resolved_draft())
    load_drafter_weights(drafter, Path(checkpoint_dir))
    return export_drafter(
        drafter, plan, out_dir, dtype=dtype, force=force, sources=(Path(checkpoint_dir),)
    )
