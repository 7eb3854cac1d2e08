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
from pathlib import Path
from typing import TypeAlias

import attrs
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from dflash_recipes.checkpoint.model_files import CONFIG_FILE
from dflash_recipes.errors import CheckpointError, PlanError
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.target_states import final_norm
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


def require_config(path: Path) -> Path:
    """`path`, a local model directory with its config.json (CheckpointError naming the
    download step otherwise)."""
    if not (path / CONFIG_FILE).is_file():
        msg = (
            f"base model directory {path} has no config.json; model.model_name_or_path must be "
            "a local Hugging Face model directory (stage it with "
            f"`hf download <repo> --local-dir {path}`)"
        )
        raise CheckpointError(msg)
    return path


def load_base_model(plan: RunPlan) -> PreTrainedModel:
    """The frozen target from the plan's local directory, in the plan's dtype, on the CPU.

    Never downloads (``local_files_only``); runs custom modelling code only when the recipe set
    ``model.trust_remote_code``.
    """
    base = plan.base_model
    path = require_config(Path(base.path))
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
class CapturedStates:
    """What an offline capture gives the trainer in place of a target forward: a micro-batch's
    captured states, padded like the batch (zeros past each row).

    Read on the prefetch thread into host memory (pinned when training on CUDA) and moved to
    the device by the loop with :meth:`to` (``non_blocking``)."""

    #: ``[B, T, n_taps * H]`` in the stored (target) dtype: the taps in ``target_layer_ids``
    #: order, as :func:`~dflash_recipes.executor.model.target_states.target_states` gives them.
    tapped: torch.Tensor
    #: ``[B, T, H]`` in the target dtype: the input of the final norm, or None.
    last_hidden: torch.Tensor | None
    #: True when each conversation's states were computed alone (a served target): a packed
    #: row's states are then its conversations' own, and a packed batch may use them.
    documents_alone: bool = False

    def to(self, device: torch.device, *, non_blocking: bool = False) -> CapturedStates:
        """The same states on `device` (`non_blocking`: asynchronous from pinned memory)."""
        last = self.last_hidden
        return attrs.evolve(
            self,
            tapped=self.tapped.to(device, non_blocking=non_blocking),
            last_hidden=None if last is None else last.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> CapturedStates:
        """The same states in pinned host memory (CUDA only)."""
        last = self.last_hidden
        return attrs.evolve(
            self,
            tapped=self.tapped.pin_memory(),
            last_hidden=None if last is None else last.pin_memory(),
        )


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
    "convert",
    "dflash_module",
    "embed_tokens",
    "lm_head",
    "load_base_model",
    "load_tokenizer",
    "teacher_logits",
    "torch_dtype",
]
