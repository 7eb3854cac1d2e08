"""Drafter kinds, their torch half: one module per ``projector_type`` (head modules, objective,
eval proposals, greedy or drawn) and the registry
(:mod:`~dflash_recipes.executor.kinds.registry`); the torch-free half of each kind is the
module of the same name in ``dflash_recipes/checkpoint/kinds/``. The protocol:
:mod:`~dflash_recipes.executor.kinds.protocol`.
"""
