"""dflash-recipes: typed, compiled recipes for training DFlash speculative-decoding drafters."""

from dflash_recipes.diagnostics import Diagnostic, Severity
from dflash_recipes.errors import (
    CheckpointError,
    CompileError,
    DataError,
    DFlashRecipeError,
    LaunchError,
    PlanError,
    RecipeError,
    SafetensorsHeaderError,
    WarmStartError,
)
from dflash_recipes.plan import ResolvedDraft, RunPlan
from dflash_recipes.recipe import (
    DataSection,
    DFlashArchitectureConfig,
    DFlashSection,
    ModelSection,
    Recipe,
    TrainingSection,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CompileError",
    "DFlashArchitectureConfig",
    "DFlashRecipeError",
    "DFlashSection",
    "DataError",
    "DataSection",
    "Diagnostic",
    "LaunchError",
    "ModelSection",
    "PlanError",
    "Recipe",
    "RecipeError",
    "ResolvedDraft",
    "RunPlan",
    "SafetensorsHeaderError",
    "Severity",
    "TrainingSection",
    "WarmStartError",
    "__version__",
]
