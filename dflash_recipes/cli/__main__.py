"""`python -m dflash_recipes.cli` (how torchrun starts the workers of `run` and `capture`)."""

from dflash_recipes.cli import run_cli

run_cli()
