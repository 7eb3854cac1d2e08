"""`dflash-recipe`: a thin click shell over the library, one module per command group.

:mod:`~dflash_recipes.cli.group` holds the command group, the exit codes and what every
command shares; :mod:`~dflash_recipes.cli.recipes` the commands on recipe files (``compile``,
``lint``, ``schema``, ``init``); :mod:`~dflash_recipes.cli.training` those that train
(``run``, ``capture``, ``export``, ``demo``); :mod:`~dflash_recipes.cli.evaluation` ``eval`` and
``report``; :mod:`~dflash_recipes.cli.regenerate` ``regenerate``;
:mod:`~dflash_recipes.cli.serving` ``serve-target``; :mod:`~dflash_recipes.cli.cache` ``cache
list`` and ``cache rm``. Importing this package registers every command on :func:`main`; the
executor (torch) is imported only inside the commands that train, evaluate or export.
"""

from __future__ import annotations

from dflash_recipes.cli import cache, evaluation, recipes, regenerate, serving, training
from dflash_recipes.cli.group import (
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    load_plan_or_recipe,
    main,
    run_cli,
)

#: The command modules, imported for their registrations on :func:`main`.
COMMAND_MODULES = (recipes, training, evaluation, regenerate, serving, cache)

__all__ = ["EXIT_FINDINGS", "EXIT_OK", "EXIT_USAGE", "load_plan_or_recipe", "main", "run_cli"]
