"""Drafter kinds, torch-free: one module per ``projector_type`` and the registry
(:mod:`~dflash_recipes.checkpoint.kinds.registry`); the torch half of each kind is the module
of the same name in ``dflash_recipes/executor/kinds/``. The protocol:
:mod:`~dflash_recipes.checkpoint.kinds.protocol`."""
