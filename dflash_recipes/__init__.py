"""dflash-recipes: typed, compiled recipes for training DFlash speculative-decoding drafters.

The public surface is `__all__`. Importing the package loads only the pure-data compile path
(attrs, cattrs, yaml, json): never torch, transformers or safetensors, which only the executor
(`dflash_recipes.executor`, used by `dflash-recipe run`) imports.
"""

from dflash_recipes.compiler import CompileResult, compile_file, compile_recipe
from dflash_recipes.diagnostics import Diagnostic, Severity
from dflash_recipes.errors import (
    CheckpointError,
    CompileError,
    DataError,
    DFlashRecipeError,
    LaunchError,
    PlanError,
    RecipeError,
    RegenerateError,
    SafetensorsHeaderError,
    WarmStartError,
)
from dflash_recipes.loader import LoadResult, load_recipe, load_recipe_with_diagnostics
from dflash_recipes.plan import ResolvedDraft, RunPlan
from dflash_recipes.recipe import (
    DataSection,
    DFlashArchitectureConfig,
    DFlashSection,
    ModelSection,
    Recipe,
    RegenerateSection,
    TrainingSection,
)
from dflash_recipes.schema import recipe_json_schema

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompileError",
    "CompileResult",
    "DFlashArchitectureConfig",
    "DFlashRecipeError",
    "DFlashSection",
    "DataError",
    "DataSection",
    "Diagnostic",
    "LaunchError",
    "LoadResult",
    "ModelSection",
    "PlanError",
    "Recipe",
    "RecipeError",
    "RegenerateError",
    "RegenerateSection",
    "ResolvedDraft",
    "RunPlan",
    "SafetensorsHeaderError",
    "Severity",
    "TrainingSection",
    "WarmStartError",
    "__version__",
    "compile_file",
    "compile_recipe",
    "load_recipe",
    "load_recipe_with_diagnostics",
    "recipe_json_schema",
]
