"""dflash-recipes: typed, compiled recipes for training DFlash speculative-decoding drafters.

The public surface is `__all__`; it is the only stable API (module paths below the package are
internal and may move). Importing the package loads only the pure-data compile path (attrs,
yaml, json; cattrs where a plan is read): never torch, transformers or safetensors, which only
the executor (`dflash_recipes.executor`, used by `dflash-recipe run`) imports.

The names are resolved on first use (PEP 562 module `__getattr__`), so `dflash-recipe --version`
or `lint`, which need a part of the package, do not pay for importing the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_recipes.lazy import lazy_exports

if TYPE_CHECKING:
    from dflash_recipes.compiler.compilation import CompileResult, compile_file, compile_recipe
    from dflash_recipes.diagnostics import Diagnostic, Severity
    from dflash_recipes.errors import (
        CheckpointError,
        CompileError,
        DataError,
        DFlashRecipeError,
        DirectoryLockedError,
        LaunchError,
        PlanError,
        RecipeError,
        RegenerateError,
        ReplaceRefusedError,
        RunIOError,
        SafetensorsHeaderError,
        TrackerError,
        WarmStartError,
    )
    from dflash_recipes.plan.draft_spec import ResolvedDraft
    from dflash_recipes.plan.run_plan import RunPlan
    from dflash_recipes.recipe.json_schema import recipe_json_schema
    from dflash_recipes.recipe.loader import LoadResult, load_recipe, load_recipe_with_diagnostics
    from dflash_recipes.recipe.sections import (
        CardSection,
        DataSection,
        DFlashArchitectureConfig,
        DFlashSection,
        ModelSection,
        Recipe,
        RegenerateSection,
        TargetServerSection,
        TrainingSection,
    )

__version__ = "0.1.0"

#: Where each public name lives (the module is imported when the name is first read).
_HOMES = {
    "CompileResult": "compiler.compilation",
    "compile_file": "compiler.compilation",
    "compile_recipe": "compiler.compilation",
    "Diagnostic": "diagnostics",
    "Severity": "diagnostics",
    "CheckpointError": "errors",
    "CompileError": "errors",
    "DataError": "errors",
    "DFlashRecipeError": "errors",
    "DirectoryLockedError": "errors",
    "LaunchError": "errors",
    "PlanError": "errors",
    "RecipeError": "errors",
    "RegenerateError": "errors",
    "ReplaceRefusedError": "errors",
    "RunIOError": "errors",
    "SafetensorsHeaderError": "errors",
    "TrackerError": "errors",
    "WarmStartError": "errors",
    "LoadResult": "recipe.loader",
    "load_recipe": "recipe.loader",
    "load_recipe_with_diagnostics": "recipe.loader",
    "ResolvedDraft": "plan.draft_spec",
    "RunPlan": "plan.run_plan",
    "CardSection": "recipe.sections",
    "DataSection": "recipe.sections",
    "DFlashArchitectureConfig": "recipe.sections",
    "DFlashSection": "recipe.sections",
    "ModelSection": "recipe.sections",
    "Recipe": "recipe.sections",
    "RegenerateSection": "recipe.sections",
    "TargetServerSection": "recipe.sections",
    "TrainingSection": "recipe.sections",
    "recipe_json_schema": "recipe.json_schema",
}


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)


__all__ = [
    "CardSection",
    "CheckpointError",
    "CompileError",
    "CompileResult",
    "DFlashArchitectureConfig",
    "DFlashRecipeError",
    "DFlashSection",
    "DataError",
    "DataSection",
    "Diagnostic",
    "DirectoryLockedError",
    "LaunchError",
    "LoadResult",
    "ModelSection",
    "PlanError",
    "Recipe",
    "RecipeError",
    "RegenerateError",
    "RegenerateSection",
    "ReplaceRefusedError",
    "ResolvedDraft",
    "RunIOError",
    "RunPlan",
    "SafetensorsHeaderError",
    "Severity",
    "TargetServerSection",
    "TrackerError",
    "TrainingSection",
    "WarmStartError",
    "__version__",
    "compile_file",
    "compile_recipe",
    "load_recipe",
    "load_recipe_with_diagnostics",
    "recipe_json_schema",
]
