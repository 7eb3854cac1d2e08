"""Plain DFlash, torch-free: the backbone alone, no head (``projector_type: dflash``).

Block position k predicts the token at anchor + k; position 0 (the anchor) is never scored.
Its tensors are the backbone's (:func:`~dflash_recipes.checkpoint.tensor_layout.
backbone_layout`), its ``config.json`` the common fields. The torch half (the objective and
the greedy proposals): :mod:`dflash_recipes.executor.kinds.dflash`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dflash_recipes.checkpoint.kinds.protocol import (
    AlignmentSettings,
    HeadSettings,
    JsonValue,
    KindFinding,
    LayoutSettings,
    ObjectiveSettings,
    Shape,
    StatedHead,
)


class DFlashFacts:
    """Plain DFlash (module doc)."""

    name = "dflash"
    head_fields: tuple[str, ...] = ()
    field_meaning: Mapping[str, str] = {}
    switch_fields: tuple[str, ...] = ()
    layout_needs: tuple[str, ...] = ()
    shifts_labels = False
    marker_prefixes: tuple[str, ...] = ()
    loss_logit_copies = 0
    head_name: str | None = None
    inherited_fields: tuple[str, ...] = ()
    required_fields: tuple[str, ...] = ()
    trains = True
    fresh_start = "will train from scratch"
    objective_fields: tuple[str, ...] = ()
    sliding_causal = True
    eval_without_head = False

    def layout(self, spec: LayoutSettings) -> dict[str, Shape]:
        """No tensors beyond the backbone."""
        return {}

    def tensor_groups(self, spec: LayoutSettings) -> dict[str, tuple[str, ...]]:
        """No head submodules."""
        return {}

    def infer_dims(self, found: Mapping[str, Shape]) -> dict[str, int]:
        """No head sizes."""
        return {}

    def describe(self, draft: HeadSettings) -> str:
        """``dflash (no head)``."""
        return "dflash (no head)"

    def export_config(
        self, draft: HeadSettings, config: dict[str, JsonValue]
    ) -> dict[str, JsonValue]:
        """The common fields only."""
        return config

    def serving_warnings(self, draft: HeadSettings) -> list[str]:
        """vLLM and SGLang serve a plain DFlash export as trained."""
        return []

    def needs_teacher(self, objective: ObjectiveSettings) -> bool:
        """Only self-distillation reads the target's logits."""
        return False

    def recipe_findings(self, arch: HeadSettings, block_size: int) -> list[KindFinding]:
        """Nothing beyond the common checks."""
        return []

    def checkpoint_findings(
        self, nested: Mapping[str, object], recipe: AlignmentSettings
    ) -> list[KindFinding]:
        """No head fields to compare."""
        return []

    def settings_findings(
        self, settings: Mapping[str, object], *, hidden: int, vocab: int, block_size: int
    ) -> list[KindFinding]:
        """No inherited settings."""
        return []

    def trained_for(
        self, where: str, nested: Mapping[str, object], draft: HeadSettings
    ) -> tuple[str, bool] | None:
        """A plain drafter has no head alignment."""
        return None

    def starter_fields(
        self, stated: StatedHead, tensors: Collection[str]
    ) -> dict[str, tuple[object, str]]:
        """Nothing beyond the backbone's fields."""
        return {}


FACTS = DFlashFacts()

__all__ = ["FACTS", "DFlashFacts"]
