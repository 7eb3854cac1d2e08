"""What `training.output_dir` may not hold: a drafter export.

A run writes its plan, checkpoints and metrics into its output_dir; `dflash-recipe export`
never replaces a run directory. An output_dir that already holds an export (an earlier
``export`` target, a released drafter, the init checkpoint itself) would be mixed with the run's
files and could never be exported into again, so compile refuses it. Reads a directory listing
and one small config.json, never tensor data.
"""

from __future__ import annotations

from dflash_recipes.compiler.codes import OUTPUT_DIR_HOLDS_EXPORT
from dflash_recipes.compiler.state import CompileInputs, Report
from dflash_recipes.files.export_target import export_evidence
from dflash_recipes.files.jsonio import clip


def check_output_not_export(inputs: CompileInputs, report: Report) -> None:
    """training.output_dir holds no drafter export (``output-dir-holds-export``)."""
    output_dir = inputs.absolute(inputs.recipe.training.output_dir)
    evidence = export_evidence(output_dir)
    if evidence is None:
        return
    init = inputs.recipe.dflash.dflash_init_checkpoint
    is_init = init is not None and inputs.absolute(init) == output_dir
    reuse = (
        "it stays the warm start (dflash.dflash_init_checkpoint)"
        if is_init
        else "to fine-tune that drafter, set dflash.dflash_init_checkpoint to it"
    )
    report.emit(
        OUTPUT_DIR_HOLDS_EXPORT,
        "training.output_dir",
        f"training.output_dir {clip(str(output_dir))} holds a drafter export ({evidence}): "
        "the run would write its plan, checkpoints and metrics beside it, and `dflash-recipe "
        "export` would refuse that folder from then on as a run directory",
        f"point training.output_dir at a new directory (e.g. {clip(str(output_dir))}-run; "
        f"the run exports into its export/ folder); {reuse}",
    )


__all__ = ["check_output_not_export"]
