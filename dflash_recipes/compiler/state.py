"""What one compile's checks read, and where they report: explicit values, no shared state.

Every check of the compiler is a function of what it reads, passed in by
:func:`~dflash_recipes.compiler.compilation.compile_recipe`:

- :class:`CompileInputs`: the recipe and the folder its relative paths resolve against;
- :class:`WhatWasRead`: what the reading phase found on disk (the base model's facts, the output
  directory's resume, the init checkpoint's files), built once and frozen; a check that needs it
  cannot run before it exists. A schema-level compile reads nothing (:data:`NOTHING_READ`);
- :class:`Report`: where checks append their diagnostics, in order. Checks only append; none reads
  another's findings (a fact one check needs from another is a returned value).

The families of checks are modules of functions over these: the recipe alone
(:mod:`~dflash_recipes.compiler.recipe_checks`), the inputs on disk
(:mod:`~dflash_recipes.compiler.input_checks`), the init checkpoint
(:mod:`~dflash_recipes.compiler.checkpoint_checks`) and the drafter's ids
(:mod:`~dflash_recipes.compiler.id_checks`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import attrs

from dflash_recipes.checkpoint.hfconfig import CheckpointConfigFacts, ConfigProblem
from dflash_recipes.checkpoint.model_paths import CheckpointDirProblem, resolve_local_path
from dflash_recipes.checkpoint.target_facts import TargetFacts
from dflash_recipes.checkpoint.tensor_layout import CheckpointDims
from dflash_recipes.checkpoint.weight_index import CheckpointWeights
from dflash_recipes.diagnostics import Diagnostic, Severity, SourceMap, code_severity
from dflash_recipes.plan.parts import ResumePlan
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.recipe.headers import header_download_step
from dflash_recipes.recipe.sections import DFlashArchitectureConfig, Recipe
from dflash_recipes.records import Record

#: Dotted recipe paths the checks report at.
ARCH_PATH = "dflash.dflash_architecture_config"
TAPS_PATH = f"{ARCH_PATH}.target_layer_ids"
MASK_PATH = "dflash.dflash_mask_token_id"
INIT_PATH = "dflash.dflash_init_checkpoint"
MODEL_PATH = "model.model_name_or_path"


def format_ids(ids: Sequence[int]) -> str:
    """`[1, 2, 3]`: a list of layer or token ids as a message shows it."""
    return "[" + ", ".join(str(i) for i in ids) + "]"


@attrs.frozen(repr=False, eq=False, slots=False)
class CompileInputs(Record):
    """The recipe being compiled and the folder its relative paths resolve against."""

    recipe: Recipe
    #: The recipe's folder (absolute), or None: relative paths resolve against the working
    #: directory (a recipe built in Python).
    base_dir: Path | None
    #: The recipe file (absolute), or None for a recipe built in Python: its header's staging
    #: steps name the fix for a missing model folder.
    recipe_file: Path | None = None

    @property
    def arch(self) -> DFlashArchitectureConfig:
        """The recipe's `dflash.dflash_architecture_config`."""
        return self.recipe.dflash.dflash_architecture_config

    def absolute(self, value: str) -> Path:
        """A recipe path made absolute (`~` expanded, relative to :attr:`base_dir`)."""
        return resolve_local_path(value, base_dir=self.base_dir)

    def folder_fix(self, problem: CheckpointDirProblem) -> str:
        """`problem`'s fix, or for a folder that is missing or empty the recipe header's own
        download step for it (:func:`~dflash_recipes.recipe.headers.header_download_step`)."""
        if self.recipe_file is not None and problem.kind in ("not-found", "empty-directory"):
            step = header_download_step(
                self.recipe_file, Path(problem.path), base_dir=self.base_dir
            )
            if step is not None:
                return f"stage it as the recipe's header says: {step}"
        return problem.hint


@attrs.frozen(repr=False, eq=False, slots=False)
class OutputDir(Record):
    """What `training.output_dir` holds: a complete checkpoint the run resumes from, or nothing."""

    resume: ResumePlan | None = None
    #: The plan the resumed run was started with (its plan.json), when readable.
    previous_plan: RunPlan | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class InitCheckpoint(Record):
    """What the init checkpoint's files said; all unset when there is none to read (no
    `dflash_init_checkpoint`, a resume, or a schema-level compile)."""

    weights: CheckpointWeights | None = None
    config: CheckpointConfigFacts | None = None
    #: Its draft dims (from config.json and the tensor shapes), for the hints of missing dims.
    dims: CheckpointDims = attrs.field(factory=lambda: CheckpointDims(values={}, sources={}))
    #: True when the checkpoint exists but cannot be read (weights or config.json): its taps
    #: and mask are then unknown, not absent, and are not asked for again.
    broken: bool = False
    #: True when two stored tensors load into one parameter (`checkpoint-name-clash`, already
    #: reported): the layout comparison is skipped.
    name_clash: bool = False

    @property
    def readable_config(self) -> CheckpointConfigFacts | None:
        """The checkpoint's config.json facts when it was present and readable, else None."""
        return self.config if self.config is not None and self.config.readable else None


@attrs.frozen(repr=False, eq=False, slots=False)
class WhatWasRead(Record):
    """Everything the reading phase found: the base model's facts, the output directory and the
    init checkpoint (each empty where nothing could be or was read)."""

    facts: TargetFacts | None
    output: OutputDir
    checkpoint: InitCheckpoint

    @property
    def resume(self) -> ResumePlan | None:
        """The checkpoint the run resumes from, or None for a new run."""
        return self.output.resume


#: What a schema-level compile (`lint`) has read: nothing.
NOTHING_READ = WhatWasRead(facts=None, output=OutputDir(), checkpoint=InitCheckpoint())


class Report:
    """Where one compile's checks report: diagnostics in the order they were emitted, each
    located in the recipe file through its source map. Append-only for the checks."""

    def __init__(self, source: SourceMap) -> None:
        self._source = source
        self._diagnostics: list[Diagnostic] = []

    def emit(self, code: str, path: str, message: str, hint: str | None = None) -> None:
        """A finding of `code` at the dotted recipe `path`, with its registered severity."""
        self.emit_as(code_severity(code), code, path, message, hint)

    def emit_as(
        self, severity: Severity, code: str, path: str, message: str, hint: str | None
    ) -> None:
        """A finding whose severity the caller knows (a reader's problem, a field check's)."""
        self._diagnostics.append(self._source.diagnostic(severity, code, path, message, hint))

    def emit_problem(self, problem: ConfigProblem, path: str, what: str) -> None:
        """A config.json reader's problem, its message prefixed with `what` was read."""
        message = f"{what}: {problem.message}"
        self.emit_as(problem.severity, problem.code, path, message, problem.hint)

    @property
    def diagnostics(self) -> tuple[Diagnostic, ...]:
        """Every diagnostic so far, in emission order (not sorted)."""
        return tuple(self._diagnostics)

    def messages_of(self, codes: Collection[str]) -> tuple[str, ...]:
        """The messages of the diagnostics with one of `codes`, in emission order."""
        return tuple(d.message for d in self._diagnostics if d.code in codes)


__all__ = [
    "ARCH_PATH",
    "INIT_PATH",
    "MASK_PATH",
    "MODEL_PATH",
    "NOTHING_READ",
    "TAPS_PATH",
    "CompileInputs",
    "InitCheckpoint",
    "OutputDir",
    "Report",
    "WhatWasRead",
    "format_ids",
]
