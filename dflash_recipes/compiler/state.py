"""What one compile knows so far, and how its checks report: the base of the check mixins.

:class:`CompileState` holds the recipe, what the resolving steps read (base model facts, the
resumed run, the init checkpoint's header and config.json) and the diagnostics so far. The
check mixins (:mod:`~dflash_recipes.compiler.recipe_checks`,
:mod:`~dflash_recipes.compiler.input_checks`,
:mod:`~dflash_recipes.compiler.id_checks`, :mod:`~dflash_recipes.compiler.checkpoint_checks`) extend
it and
:mod:`~dflash_recipes.compiler.compilation` puts them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dflash_recipes.checkpoint.hfconfig import CheckpointConfigFacts, ConfigProblem
from dflash_recipes.checkpoint.tensor_layout import CheckpointDims
from dflash_recipes.checkpoint.weight_index import CheckpointWeights
from dflash_recipes.compiler.codes import (
    LAYER_TYPES_LENGTH,
)
from dflash_recipes.checkpoint.model_paths import resolve_local_path
from dflash_recipes.diagnostics import Diagnostic, Severity, SourceMap, code_severity
from dflash_recipes.plan.run_plan import ResumePlan, RunPlan, TargetFacts
from dflash_recipes.recipe.sections import DFlashArchitectureConfig, Recipe

#: Dotted recipe paths the checks report at.
ARCH_PATH = "dflash.dflash_architecture_config"
TAPS_PATH = f"{ARCH_PATH}.target_layer_ids"
MASK_PATH = "dflash.dflash_mask_token_id"
INIT_PATH = "dflash.dflash_init_checkpoint"
MODEL_PATH = "model.model_name_or_path"


def format_ids(ids: Sequence[int]) -> str:
    """`[1, 2, 3]`: a list of layer or token ids as a message shows it."""
    return "[" + ", ".join(str(i) for i in ids) + "]"


class CompileState:
    """State of one compile: the recipe, what was read, and the diagnostics so far."""

    def __init__(self, recipe: Recipe, source: SourceMap, base_dir: Path | None) -> None:
        self.recipe = recipe
        self.arch: DFlashArchitectureConfig = recipe.dflash.dflash_architecture_config
        self.source = source
        self.base_dir = base_dir
        self.diagnostics: list[Diagnostic] = []
        # filled by the resolving steps
        self.facts: TargetFacts | None = None
        self.resume: ResumePlan | None = None
        self.previous_plan: RunPlan | None = None
        self.checkpoint_dir: Path | None = None
        #: True when the init checkpoint (weights or config.json) exists but cannot be read.
        self.checkpoint_broken = False
        self.weights: CheckpointWeights | None = None
        self.config: CheckpointConfigFacts | None = None
        self.dims = CheckpointDims(values={}, sources={})
        self.heads_from_scratch: tuple[str, ...] = ()

    # -- emitting ---------------------------------------------------------------------------

    def emit(self, code: str, path: str, message: str, hint: str | None = None) -> None:
        self.emit_as(code_severity(code), code, path, message, hint)

    def emit_as(
        self, severity: Severity, code: str, path: str, message: str, hint: str | None
    ) -> None:
        self.diagnostics.append(self.source.diagnostic(severity, code, path, message, hint))

    def emit_problem(self, problem: ConfigProblem, path: str, what: str) -> None:
        message = f"{what}: {problem.message}"
        self.emit_as(problem.severity, problem.code, path, message, problem.hint)

    def absolute(self, value: str) -> Path:
        return resolve_local_path(value, base_dir=self.base_dir)

    # -- a check both the schema level and the resolved layer types use ---------------------

    def check_layer_types_length(self, types: tuple[str, ...] | None, origin: str) -> bool:
        layers = self.arch.num_hidden_layers
        if types is None or layers is None or len(types) == layers:
            return True
        if len(types) < layers:
            example = list(types) + [types[-1]] * (layers - len(types))
        else:
            example = list(types[:layers])
        self.emit(
            LAYER_TYPES_LENGTH,
            f"{ARCH_PATH}.layer_types",
            f"layer_types{origin} lists {len(types)} attention kinds, but the drafter has "
            f"num_hidden_layers {layers}; layer_types needs exactly one entry per draft layer",
            f"set dflash_architecture_config.layer_types to {layers} entries, e.g. "
            f"[{', '.join(example)}]",
        )
        return False


__all__ = [
    "ARCH_PATH",
    "INIT_PATH",
    "MASK_PATH",
    "MODEL_PATH",
    "TAPS_PATH",
    "CompileState",
    "format_ids",
]
