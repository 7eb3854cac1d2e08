"""The executor: the only package that imports torch, transformers and safetensors.

It reads a compiled :class:`~dflash_recipes.plan.run_plan.RunPlan` and never the recipe. This module
re-exports the model core; import submodules directly for the rest (``data``, ``loss``,
``train``). Importing ``dflash_recipes`` itself never imports this package.

The names below are loaded on first use (PEP 562): importing a submodule that needs no torch
(``regenerate`` against a server) does not pay for the model code through this file.

Importing it refuses a torch or transformers older than the executor runs on, in one line
naming both versions (:mod:`dflash_recipes.executor.versions`; it reads their metadata and
imports neither).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_recipes.executor.versions import check_versions
from dflash_recipes.lazy import lazy_exports

check_versions()

if TYPE_CHECKING:
    from dflash_recipes.executor.kinds.domino import DominoHead
    from dflash_recipes.executor.kinds.dspark import DSparkHead
    from dflash_recipes.executor.model.convert import (
        ConvertedModel,
        convert,
        dflash_module,
        embed_tokens,
        lm_head,
        load_base_model,
    )
    from dflash_recipes.executor.model.draft import DFlashDraftModel, taps_from_hidden_states
    from dflash_recipes.executor.model.export import export_drafter
    from dflash_recipes.executor.model.masks import (
        DraftMask,
        build_dense_block_mask,
        build_flex_block_mask,
    )
    from dflash_recipes.executor.model.target_states import (
        IsolationReport,
        TargetStates,
        check_packed_isolation,
        target_states,
    )
    from dflash_recipes.executor.model.warmstart import WarmStartReport, load_init_checkpoint
    from dflash_recipes.executor.training.anchors import block_positions
    from dflash_recipes.executor.training.checkpoints import (
        restore_training_checkpoint,
        save_training_checkpoint,
    )
    from dflash_recipes.executor.training.train_step import (
        StepOutput,
        TrainStep,
        build_step,
        optimizer_step,
        prepare_rows,
    )

    #: The former name of :data:`ConvertedModel` (kept so existing imports keep working).
    DFlashModel = ConvertedModel

#: Where each public name lives.
_HOMES = {
    "ConvertedModel": "model.convert",
    "DFlashModel": "model.convert",
    "convert": "model.convert",
    "dflash_module": "model.convert",
    "embed_tokens": "model.convert",
    "lm_head": "model.convert",
    "load_base_model": "model.convert",
    "DFlashDraftModel": "model.draft",
    "taps_from_hidden_states": "model.draft",
    "export_drafter": "model.export",
    "DSparkHead": "kinds.dspark",
    "DominoHead": "kinds.domino",
    "IsolationReport": "model.target_states",
    "TargetStates": "model.target_states",
    "check_packed_isolation": "model.target_states",
    "target_states": "model.target_states",
    "DraftMask": "model.masks",
    "build_dense_block_mask": "model.masks",
    "build_flex_block_mask": "model.masks",
    "WarmStartReport": "model.warmstart",
    "load_init_checkpoint": "model.warmstart",
    "block_positions": "training.anchors",
    "restore_training_checkpoint": "training.checkpoints",
    "save_training_checkpoint": "training.checkpoints",
    "StepOutput": "training.train_step",
    "TrainStep": "training.train_step",
    "build_step": "training.train_step",
    "optimizer_step": "training.train_step",
    "prepare_rows": "training.train_step",
}


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, {"DFlashModel": "ConvertedModel"})


__all__ = [
    "ConvertedModel",
    "DFlashDraftModel",
    "DFlashModel",
    "DSparkHead",
    "DominoHead",
    "DraftMask",
    "IsolationReport",
    "StepOutput",
    "TargetStates",
    "TrainStep",
    "WarmStartReport",
    "block_positions",
    "build_dense_block_mask",
    "build_flex_block_mask",
    "build_step",
    "check_packed_isolation",
    "convert",
    "dflash_module",
    "embed_tokens",
    "export_drafter",
    "lm_head",
    "load_base_model",
    "load_init_checkpoint",
    "optimizer_step",
    "prepare_rows",
    "restore_training_checkpoint",
    "save_training_checkpoint",
    "taps_from_hidden_states",
    "target_states",
]
