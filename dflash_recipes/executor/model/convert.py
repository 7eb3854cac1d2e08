"""Load the frozen target and attach a DFlash drafter to it (``model.dflash_module``).

The converted model is the Hugging Face causal LM itself, with the drafter registered as the
submodule ``dflash_module``. The base's parameters are frozen; the drafter borrows the base's
input embeddings and ``lm_head`` through :func:`embed_tokens` and :func:`lm_head` and never
holds a copy, so ``model.dflash_module.state_dict()`` is exactly the z-lab export.

The drafter is built on the CPU in float32 (the trainer's master weights) and, when the plan
has an init checkpoint and the run is not a resume, warm-started right away: before any dtype
or device move, so the loaded values are the checkpoint's, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeAlias

import attrs
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from dflash_recipes.checkpoint.model_files import CONFIG_FILE
from dflash_recipes.errors import CheckpointError, PlanError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.masks import document_causal_mask, document_starts
from dflash_recipes.executor.model.warmstart import warm_start
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger(__name__)

#: The base model after :func:`convert`: a Hugging Face causal LM with the drafter attached as
#: ``dflash_module`` (the drafter itself is :class:`DFlashDraftModel`).
ConvertedModel: TypeAlias = PreTrainedModel

DRAFT_ATTRIBUTE = "dflash_module"

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a plan dtype name (``bfloat16``, ``float16``, ``float32``)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        msg = f"unknown dtype {name!r}; expected one of {', '.join(_TORCH_DTYPES)}"
        raise PlanError(msg) from None


def load_base_model(plan: RunPlan) -> PreTrainedModel:
    """The frozen target from the plan's local directory, in the plan's dtype, on the CPU.

    Never downloads (``local_files_only``); runs custom modelling code only when the recipe set
    ``model.trust_remote_code``.
    """
    base = plan.base_model
    path = Path(base.path)
    if not (path / CONFIG_FILE).is_file():
        msg = (
            f"base model directory {path} has no config.json; model.model_name_or_path must be "
            "a local Hugging Face model directory (stage it with "
            f"`hf download <repo> --local-dir {path}`)"
        )
        raise CheckpointError(msg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            local_files_only=True,
            trust_remote_code=base.trust_remote_code,
            dtype=torch_dtype(base.dtype),
        )
    except (OSError, ValueError) as exc:
        msg = f"cannot load the base model from {path}: {exc}"
        raise CheckpointError(msg) from exc
    assert isinstance(model, PreTrainedModel)
    _eval_mode(model)
    return model


def load_tokenizer(plan: RunPlan) -> PreTrainedTokenizerBase:
    """The base model's tokenizer, from its local directory (never the network).

    Raises CheckpointError, naming the directory and the command that stages the files, when
    the directory has no tokenizer files or they do not load.
    """
    from transformers import AutoTokenizer

    base = plan.base_model
    known = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(base.path) / name).is_file() for name in known):
        # transformers would build an empty tokenizer from config.json alone.
        msg = (
            f"the base model directory {base.path} has no tokenizer files (none of "
            f"{', '.join(known)}); the directory needs them next to config.json: stage "
            f"the whole model with `hf download <repo> --local-dir {base.path}`"
        )
        raise CheckpointError(msg)
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            base.path, local_files_only=True, trust_remote_code=base.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        msg = (
            f"cannot load the tokenizer of the base model from {base.path}: {exc}; the "
            "directory needs the tokenizer files (tokenizer.json / tokenizer_config.json) "
            "next to config.json: stage the whole model with `hf download <repo> "
            f"--local-dir {base.path}`"
        )
        raise CheckpointError(msg) from exc
    return tokenizer


def _eval_mode(model: nn.Module) -> None:
    # Through nn.Module's typed signature; transformers' own override is untyped.
    model.eval()


def _output_head(model: PreTrainedModel) -> nn.Module | None:
    head: nn.Module | None = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    return head


def _rows(embeddings: nn.Module) -> int | None:
    weight = getattr(embeddings, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None


def _check_base_matches_plan(base_model: PreTrainedModel, plan: RunPlan) -> None:
    facts = plan.base_model.facts
    if facts is None:
        return
    config = base_model.config.get_text_config()
    found = {
        "hidden_size": getattr(config, "hidden_size", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "vocab_size": _rows(base_model.get_input_embeddings()),
    }
    wanted = {
        "hidden_size": facts.hidden_size,
        "num_hidden_layers": facts.num_hidden_layers,
        "vocab_size": facts.vocab_size,
    }
    wrong = [f"{k}: plan {wanted[k]}, model {found[k]}" for k in wanted if found[k] != wanted[k]]
    if wrong:
        msg = (
            "the base model does not match the run plan (" + "; ".join(wrong) + "); pass the "
            f"model the plan was compiled for ({plan.base_model.path}) or recompile the recipe"
        )
        raise PlanError(msg)


def convert(base_model: PreTrainedModel, plan: RunPlan, *, init: bool = True) -> ConvertedModel:
    """Attach the plan's drafter to ``base_model`` as ``dflash_module``, freeze the base.

    With ``init`` (the default), a plan with ``init_checkpoint`` and no ``resume`` warm-starts
    the drafter here, before anything moves it (:func:`~dflash_recipes.executor.model.warmstart.
    warm_start`; a caller that wants the report passes ``init=False`` and calls it itself).
    Returns ``base_model`` (converted in place).
    """
    if hasattr(base_model, DRAFT_ATTRIBUTE):
        msg = "this model already has a dflash_module; convert a fresh base model"
        raise ValueError(msg)
    if base_model.get_input_embeddings() is None or _output_head(base_model) is None:
        msg = (
            f"{type(base_model).__name__} has no input embeddings or output head; convert "
            "needs a causal LM (Qwen3ForCausalLM, LlamaForCausalLM, ...)"
        )
        raise PlanError(msg)
    _check_base_matches_plan(base_model, plan)
    spec = plan.resolved_draft()
    if not 0 <= spec.mask_token_id < spec.vocab_size:
        msg = (
            f"mask_token_id {spec.mask_token_id} is not a row of the target's "
            f"{spec.vocab_size}-row embedding table"
        )
        raise PlanError(msg)

    for parameter in base_model.parameters():
        parameter.requires_grad_(False)
    _eval_mode(base_model)

    generator = torch.Generator().manual_seed(plan.training.seed)
    module = DFlashDraftModel(spec, generator=generator)
    if init:
        warm_start(module, plan)
    base_model.add_module(DRAFT_ATTRIBUTE, module)
    return base_model


def dflash_module(model: nn.Module) -> DFlashDraftModel:
    """The drafter of a converted model (or the drafter itself)."""
    if isinstance(model, DFlashDraftModel):
        return model
    module = getattr(model, DRAFT_ATTRIBUTE, None)
    if not isinstance(module, DFlashDraftModel):
        msg = f"{type(model).__name__} has no dflash_module; call convert(base_model, plan) first"
        raise TypeError(msg)
    return module


@attrs.frozen(eq=False)
class TargetStates:
    """What one frozen target forward gives the trainer."""

    #: Hugging Face's ``output_hidden_states`` tuple (index 0 is the embedding output).
    hidden_states: tuple[torch.Tensor, ...]
    #: ``[B, S, V]`` next-token logits, only when asked for (None otherwise).
    logits: torch.Tensor | None


def target_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    with_logits: bool,
    document_ids: torch.Tensor | None = None,
) -> TargetStates:
    """Run the frozen target for its hidden states, and its logits only when asked.

    Without logits only the decoder runs (``model.get_decoder()``): the ``lm_head`` product
    over every position, ``[B, S, vocab]`` (about a tenth of an 8B target's forward at a
    152k vocabulary), is skipped. Taps are the same either way. With logits, or for a model
    whose decoder cannot be told apart, the whole causal LM runs, so the logits are exactly
    the model's (including any scaling or soft-capping its forward applies). Call it under
    ``torch.no_grad()``.

    A packed row passes `document_ids` (``[B, S]``, the document number of each token): the
    position ids restart at 0 per document and the mask handed to the model is the 4-D
    block-diagonal causal boolean mask (:func:`~dflash_recipes.executor.model.masks.
    document_causal_mask`), which transformers passes as-is to the model's attention (SDPA,
    the implementation the targets are loaded with; the eager path takes the same mask).
    """
    runner: nn.Module = model
    if not with_logits:
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if callable(get_decoder) else None
        if isinstance(decoder, nn.Module) and decoder is not model:
            runner = decoder
    extra: dict[str, torch.Tensor] = {}
    if document_ids is not None:
        attention_mask = document_causal_mask(document_ids)
        extra["position_ids"] = document_position_ids(document_ids)
    out = runner(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        use_cache=False,
        **extra,
    )
    hidden = tuple(out.hidden_states)
    return TargetStates(hidden, out.logits if with_logits else None)


class _StopTarget(Exception):
    """Raised by the deepest tap's hook to end a target forward early (private)."""


def stop_after_layer(target_layer_ids: Sequence[int], *, needs_logits: bool) -> int | None:
    """The one rule for stopping the target early: after the deepest tapped layer, unless
    something needs the later layers (logits for a teacher or KL objective); None = run to
    the end."""
    if needs_logits or not target_layer_ids:
        return None
    return max(target_layer_ids)


def capture_taps(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_layer_ids: Sequence[int],
    *,
    stop_after: int | None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The taps (``[B, S, n_taps * H]``, in ``target_layer_ids`` order) captured by forward
    hooks on the tapped decoder layers, without ``output_hidden_states``; with ``stop_after``
    the forward ends once that layer has run, so later layers are never computed.

    The early end is a private exception raised from the deepest tap's hook and caught here:
    the model's own forward runs unchanged (works for any wrapper that keeps the layer
    modules, e.g. FSDP2's ``fully_shard``, whose hooks are module hooks too). A tap on the
    last layer goes through the final norm, as Hugging Face's ``hidden_states[-1]`` does.
    Call it under ``torch.no_grad()``. A packed row passes `document_ids`: positions restart
    per document and the mask is block-diagonal causal, as in :func:`target_forward`.
    """
    decoder = model.get_decoder()  # type: ignore[no-untyped-call]
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        msg = f"{type(model).__name__} has no decoder layers at get_decoder().layers"
        raise CheckpointError(msg)
    bad = [k for k in target_layer_ids if not 0 <= k < len(layers)]
    if bad:
        msg = f"target_layer_ids {bad} are outside the target's {len(layers)} decoder layers"
        raise ValueError(msg)
    captured: dict[int, torch.Tensor] = {}

    def hook_for(k: int) -> Callable[[nn.Module, object, object], None]:
        def hook(_module: nn.Module, _args: object, output: object) -> None:
            out = output[0] if isinstance(output, tuple) else output
            assert isinstance(out, torch.Tensor)
            captured[k] = out
            if k == stop_after:
                raise _StopTarget

        return hook

    extra: dict[str, torch.Tensor] = {}
    if document_ids is not None:
        attention_mask = document_causal_mask(document_ids)
        extra["position_ids"] = document_position_ids(document_ids)
    handles = [layers[k].register_forward_hook(hook_for(k)) for k in set(target_layer_ids)]
    try:
        model.get_decoder()(  # type: ignore[no-untyped-call]
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra
        )
    except _StopTarget:
        pass
    finally:
        for handle in handles:
            handle.remove()
    last = len(layers) - 1
    if last in captured:  # as ``hidden_states[-1]``: the last layer's output after the norm
        captured[last] = final_norm(model)(captured[last])
    return torch.cat([captured[k] for k in target_layer_ids], dim=-1)


def document_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions restarting at 0 where the document number changes."""
    seq_len = document_ids.shape[1]
    index = torch.arange(seq_len, device=document_ids.device).expand_as(document_ids)
    return index - document_starts(document_ids)


@attrs.frozen(eq=False)
class CapturedStates:
    """What an offline capture gives the trainer in place of a target forward: a micro-batch's
    captured states, padded like the batch (zeros past each row)."""

    #: ``[B, T, n_taps * H]`` float32: the fused-in-order taps, as ``taps_from_hidden_states``.
    tapped: torch.Tensor
    #: ``[B, T, H]`` in the target dtype: the input of the final norm, or None.
    last_hidden: torch.Tensor | None


def final_norm(model: PreTrainedModel) -> nn.Module:
    """The target's final norm (``model.get_decoder().norm``), applied before ``lm_head``."""
    decoder = model.get_decoder()  # type: ignore[no-untyped-call]
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, nn.Module):
        msg = (
            f"{type(model).__name__} has no final norm at get_decoder().norm; offline "
            "self-distillation needs it to recompute the teacher logits"
        )
        raise CheckpointError(msg)
    return norm


def teacher_logits(
    model: PreTrainedModel, head: nn.Module, last_hidden: torch.Tensor
) -> torch.Tensor:
    """``lm_head(final_norm(last_hidden))``: the logits the online forward gives, recomputed
    from a capture's last hidden state."""
    logits: torch.Tensor = head(final_norm(model)(last_hidden))
    return logits


def embed_tokens(model: PreTrainedModel) -> nn.Module:
    """The base's input embedding table (shared with the drafter, never copied)."""
    embeddings: nn.Module = model.get_input_embeddings()
    return embeddings


def lm_head(model: PreTrainedModel) -> nn.Module:
    """The base's output head (shared with the drafter, never copied)."""
    head = _output_head(model)
    if head is None:
        msg = f"{type(model).__name__} has no output head (lm_head)"
        raise TypeError(msg)
    return head


__all__ = [
    "DRAFT_ATTRIBUTE",
    "CapturedStates",
    "ConvertedModel",
    "TargetStates",
    "capture_taps",
    "convert",
    "dflash_module",
    "embed_tokens",
    "final_norm",
    "lm_head",
    "load_base_model",
    "load_tokenizer",
    "stop_after_layer",
    "target_forward",
    "teacher_logits",
    "torch_dtype",
]
