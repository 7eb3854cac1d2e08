"""DSpark, torch-free: a low-rank Markov bias head on the backbone logits
(``projector_type: dspark``).

Tensors (docs/dflash.md, "Domino and DSpark from a plain DFlash checkpoint"):
``markov_w1.weight`` and ``markov_w2.weight`` ``[vocab, rank]``; ``gate_proj.{weight,bias}``
(``markov_head_type: gated``) or ``joint_proj.{weight,bias}`` (``rnn``); and
``confidence_proj.{weight,bias}`` with ``use_confidence_head``. With ``shift_label`` block
position k predicts anchor + k + 1. Its objective adds a total-variation term against the
target's logits (``dspark_tv_weight``), so it needs the teacher when that weight is positive.
The torch half (the head module, its objective and greedy proposals):
:mod:`dflash_recipes.executor.kinds.dspark`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dflash_recipes.checkpoint.config_fields import _DC
from dflash_recipes.checkpoint.kinds.alignment import (
    FIELD_DIFFERS,
    shift_label_findings,
    trained_for_note,
)
from dflash_recipes.checkpoint.kinds.protocol import (
    AlignmentSettings,
    HeadSettings,
    JsonValue,
    KindFinding,
    LayoutSettings,
    ObjectiveSettings,
    Shape,
    StatedHead,
    dim,
    group_by_submodule,
    with_kind_fields,
)
from dflash_recipes.recipe.choices import MARKOV_HEAD_TYPES


class DSparkFacts:
    """DSpark (module doc)."""

    name = "dspark"
    head_fields: tuple[str, ...] = ("markov_rank",)
    field_meaning: Mapping[str, str] = {
        "markov_rank": "the rank of DSpark's low-rank Markov transition bias",
    }
    switch_fields: tuple[str, ...] = ("use_confidence_head",)
    layout_needs: tuple[str, ...] = ("vocab_size", "markov_rank")
    shifts_labels = True
    marker_prefixes: tuple[str, ...] = ("markov_w1.", "markov_w2.")
    # The biased logits and their log-softmax: a rough count, not measured.
    loss_logit_copies = 2
    head_name: str | None = "dspark"
    inherited_fields: tuple[str, ...] = ()
    required_fields: tuple[str, ...] = ()
    trains = True
    fresh_start = "will train from scratch"
    objective_fields: tuple[str, ...] = ("dspark_tv_weight", "dspark_confidence_weight")
    sliding_causal = True
    eval_without_head = False

    def layout(self, spec: LayoutSettings) -> dict[str, Shape]:
        """``markov_w{1,2}``, the gated/rnn projection and the confidence head (module doc)."""
        assert spec.markov_rank is not None
        assert spec.vocab_size is not None
        hidden, rank = spec.hidden_size, spec.markov_rank
        layout: dict[str, Shape] = {
            "markov_w1.weight": (spec.vocab_size, rank),
            "markov_w2.weight": (spec.vocab_size, rank),
        }
        if spec.markov_head_type == "gated":  # sigmoid(gate_proj([h ; W1[x]])) gates W1[x]
            layout["gate_proj.weight"] = (rank, hidden + rank)
            layout["gate_proj.bias"] = (rank,)
        elif spec.markov_head_type == "rnn":  # [gate ; candidate ; output] of [s ; W1[x] ; h]
            layout["joint_proj.weight"] = (3 * rank, 2 * rank + hidden)
            layout["joint_proj.bias"] = (3 * rank,)
        if spec.use_confidence_head:
            layout["confidence_proj.weight"] = (1, hidden + rank)
            layout["confidence_proj.bias"] = (1,)
        return layout

    def tensor_groups(self, spec: LayoutSettings) -> dict[str, tuple[str, ...]]:
        """One group per top-level submodule (``markov_w1``, ``confidence_proj``, ...)."""
        return group_by_submodule(self.layout(spec))

    def infer_dims(self, found: Mapping[str, Shape]) -> dict[str, int]:
        """vocab_size and markov_rank from ``markov_w1``."""
        dims: dict[str, int] = {}
        vocab = dim(found, "markov_w1.weight", 2, 0)
        if vocab:
            dims["vocab_size"] = vocab
        rank = dim(found, "markov_w1.weight", 2, 1)
        if rank:
            dims["markov_rank"] = rank
        return dims

    def describe(self, draft: HeadSettings) -> str:
        """``dspark vanilla (shift_label true)``, ``dspark gated (..., confidence head)``."""
        shift = f"shift_label {'true' if draft.shift_label else 'false'}"
        confidence = ", confidence head" if draft.use_confidence_head else ""
        return f"dspark {draft.markov_head_type} ({shift}{confidence})"

    def export_config(
        self, draft: HeadSettings, config: dict[str, JsonValue]
    ) -> dict[str, JsonValue]:
        """The head fields as ModelOpt's exporters write them."""
        return with_kind_fields(
            config,
            nested={
                "shift_label": draft.shift_label,
                "markov_rank": draft.markov_rank,
                "markov_head_type": draft.markov_head_type,
                "use_confidence_head": draft.use_confidence_head,
            },
        )

    def serving_warnings(self, draft: HeadSettings) -> list[str]:
        """No engine has a DSpark head."""
        return [
            "warning: no serving engine has a DSpark head: vLLM and SGLang would serve the "
            "DFlash backbone of this export without its Markov correction (or "
            "refuse its extra tensors), so served acceptance differs from `dflash-recipe eval`; "
            "see 'Serving the export' in docs/dflash.md"
        ]

    def needs_teacher(self, objective: ObjectiveSettings) -> bool:
        """The total-variation term compares with the target's distribution."""
        return objective.dspark_tv_weight > 0

    def recipe_findings(self, arch: HeadSettings, block_size: int) -> list[KindFinding]:
        """Nothing beyond the common checks."""
        return []

    def checkpoint_findings(
        self, nested: Mapping[str, object], recipe: AlignmentSettings
    ) -> list[KindFinding]:
        """shift_label (:mod:`~dflash_recipes.checkpoint.kinds.alignment`), then the head kind."""
        findings = shift_label_findings(self.name, nested, recipe)
        head = nested.get("markov_head_type")
        if head is not None and head in MARKOV_HEAD_TYPES and head != recipe.markov_head_type:
            findings.append(
                KindFinding(
                    FIELD_DIFFERS,
                    "markov_head_type",
                    f"`{_DC}markov_head_type: {head}`: the checkpoint's DSpark head is {head}, "
                    f"the recipe's markov_head_type is {recipe.markov_head_type}",
                    f"set dflash_architecture_config.markov_head_type: {head} to load the "
                    "checkpoint's head",
                )
            )
        return findings

    def settings_findings(
        self, settings: Mapping[str, object], *, hidden: int, vocab: int, block_size: int
    ) -> list[KindFinding]:
        """No inherited settings."""
        return []

    def trained_for(
        self, where: str, nested: Mapping[str, object], draft: HeadSettings
    ) -> tuple[str, bool] | None:
        """The shift_label note."""
        return trained_for_note(where, nested, draft, self.describe(draft))

    def starter_fields(
        self, stated: StatedHead, tensors: Collection[str]
    ) -> dict[str, tuple[object, str]]:
        """use_confidence_head when config.json says so or confidence_proj is present."""
        if stated.use_confidence_head or "confidence_proj.weight" in tensors:
            return {"use_confidence_head": (True, "the checkpoint has confidence_proj")}
        return {}


FACTS = DSparkFacts()

__all__ = ["FACTS", "DSparkFacts"]
