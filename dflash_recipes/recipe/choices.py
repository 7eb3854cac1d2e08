"""Every enumeration of the recipe, written once: dtypes, schedulers, objectives, heads, ...

Each choice is a ``Literal`` type (what mypy checks and the plan's fields are typed with) and
a tuple of its values derived from it with :func:`typing.get_args` (what validators, the JSON
Schema, the CLI's choices and the compiler's checks iterate). Adding a value here is the one
edit that makes it a valid recipe value; the modules that act on a value (the executor's dtype
map, the head builder) have tests that fail for a value they do not handle.
"""

from __future__ import annotations

from typing import Literal, get_args

Dtype = Literal["bfloat16", "float16", "float32"]
#: The drafter's parameter (master-weight) dtype during training: its gradients and AdamW's
#: moments follow it.
MasterDtype = Literal["float32", "bfloat16"]
SchedulerType = Literal["cosine", "linear", "constant"]
LossObjective = Literal["decay", "dpace"]
ProjectorType = Literal["dflash", "domino", "dspark", "dflash2"]
#: DSpark's Markov head kinds (ModelOpt's `markov_head_type`).
MarkovHeadType = Literal["vanilla", "gated", "rnn"]
#: What DFlash 2's selector loss does at a position whose gold token is not among the unary
#: top-K candidates: skip it (SpecForge, NeMo; serving never picks it either) or inject it in
#: place of the last candidate (speculators).
SelectorMissingGold = Literal["skip", "inject"]
DeviceChoice = Literal["auto", "cpu", "cuda"]
#: `regenerate.reasoning`: keep (a <think> block in the text), separate (the server's
#: reasoning_content kept as the turn's own field), drop.
ReasoningPolicy = Literal["keep", "separate", "drop"]
#: The parts of an assistant turn `data.supervise` may name: its text, its tool-call text
#: and its reasoning (each as the chat template renders it).
SupervisedPart = Literal["answer", "tool_calls", "reasoning"]
#: What a row the chat template cannot render (or renders without one of its parts) does:
#: stop the run with an error naming the row and the part, or be skipped and counted.
UnrenderableRows = Literal["error", "skip"]
#: `regenerate.thinking`: template: send no switch (the template's default); on / off: send
#: ``chat_template_kwargs.enable_thinking``; both: one row with thinking on, one with it off.
ThinkingMode = Literal["template", "on", "off", "both"]
#: What the trainer does with a vLLM hidden-states file once it is read and checked: delete it,
#: or keep it as a verified capture shard (``target_server.keep_files``).
KeepFiles = Literal["delete", "capture"]
#: Attention kinds of a draft layer (the `layer_types` values of Hugging Face configs).
LayerType = Literal["full_attention", "sliding_attention"]
#: Experiment trackers `training.report_to` may name (one module each in
#: dflash_recipes.executor.training.trackers).
TrackerName = Literal["tensorboard", "mlflow", "wandb"]

DTYPES: tuple[str, ...] = get_args(Dtype)
MASTER_DTYPES: tuple[str, ...] = get_args(MasterDtype)
#: Target dtypes the trainer autocasts the drafter's step to on CUDA (the half-precision ones).
AUTOCAST_DTYPES: tuple[str, ...] = tuple(d for d in DTYPES if d != "float32")
SCHEDULERS: tuple[str, ...] = get_args(SchedulerType)
LOSS_OBJECTIVES: tuple[str, ...] = get_args(LossObjective)
PROJECTOR_TYPES: tuple[str, ...] = get_args(ProjectorType)
MARKOV_HEAD_TYPES: tuple[str, ...] = get_args(MarkovHeadType)
SELECTOR_MISSING_GOLD: tuple[str, ...] = get_args(SelectorMissingGold)
DEVICES: tuple[str, ...] = get_args(DeviceChoice)
LAYER_TYPES: tuple[str, ...] = get_args(LayerType)
REASONING_POLICIES: tuple[str, ...] = get_args(ReasoningPolicy)
SUPERVISED_PARTS: tuple[str, ...] = get_args(SupervisedPart)
UNRENDERABLE_ROWS: tuple[str, ...] = get_args(UnrenderableRows)
THINKING_MODES: tuple[str, ...] = get_args(ThinkingMode)
KEEP_FILES: tuple[str, ...] = get_args(KeepFiles)
TRACKERS: tuple[str, ...] = get_args(TrackerName)
#: The package each tracker imports. It comes with ``pip install 'dflash-recipes[NAME]'``: the
#: extras of pyproject.toml are named after the trackers.
TRACKER_LIBRARIES: dict[str, str] = {
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
}

__all__ = [
    "AUTOCAST_DTYPES",
    "DEVICES",
    "DTYPES",
    "KEEP_FILES",
    "LAYER_TYPES",
    "LOSS_OBJECTIVES",
    "MARKOV_HEAD_TYPES",
    "MASTER_DTYPES",
    "PROJECTOR_TYPES",
    "REASONING_POLICIES",
    "SCHEDULERS",
    "SELECTOR_MISSING_GOLD",
    "SUPERVISED_PARTS",
    "THINKING_MODES",
    "TRACKERS",
    "TRACKER_LIBRARIES",
    "UNRENDERABLE_ROWS",
    "DeviceChoice",
    "Dtype",
    "KeepFiles",
    "LayerType",
    "LossObjective",
    "MarkovHeadType",
    "MasterDtype",
    "ProjectorType",
    "ReasoningPolicy",
    "SchedulerType",
    "SelectorMissingGold",
    "SupervisedPart",
    "ThinkingMode",
    "TrackerName",
    "UnrenderableRows",
]
