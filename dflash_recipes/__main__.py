"""`python -m dflash_recipes` is `dflash-recipe`."""

from dflash_recipes.cli import run_cli

if __name__ == "__main__":
    run_cli()
