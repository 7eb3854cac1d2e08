"""Plain DFlash's torch half: the backbone's argmax proposals, the teacher only with
self-distillation."""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
from testkit.tiny import tiny_plan

from dflash_recipes.executor.kinds.dflash import MODULES
from dflash_recipes.executor.training.loss import ObjectiveInputs


def test_proposals_are_the_backbones_argmax_after_the_anchor(tmp_path: Path) -> None:
    spec = tiny_plan(tmp_path, block_size=4).resolved_draft()
    logits = torch.zeros(2, 4, 10)
    for row, tokens in enumerate(([1, 2, 3, 4], [5, 6, 7, 8])):
        for position, token in enumerate(tokens):
            logits[row, position, token] = 1.0
    out = MODULES.propose(None, torch.zeros(2, 4, 8), logits, [0, 0], spec, torch.nn.Identity())
    assert out.tolist() == [[2, 3, 4], [6, 7, 8]]


def test_the_teacher_reaches_the_loss_only_with_self_distillation(tmp_path: Path) -> None:
    objective = tiny_plan(tmp_path).draft.objective
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 2, 4, 11, generator=gen)
    teacher = torch.randn(1, 2, 4, 11, generator=gen)
    targets = ObjectiveInputs(
        labels=torch.randint(0, 11, (1, 2, 4), generator=gen),
        label_mask=torch.ones(1, 2, 4, dtype=torch.bool),
        teacher=teacher,  # a DSpark-style teacher may be there without self-distillation
        step=0,
        total_steps=1,
    )
    hidden = torch.zeros(1, 2, 4, 8)
    plain = MODULES.objective(None, hidden, logits, (), targets, objective)
    assert not plain.parts
    distilling = attrs.evolve(objective, self_logit_distillation=True)
    distilled = MODULES.objective(None, hidden, logits, (), targets, distilling)
    assert set(distilled.parts) == {"distill"}
    assert distilled.loss > plain.loss
