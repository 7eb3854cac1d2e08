"""Domino, torch-free: a GRU correction head on the backbone logits (``projector_type: domino``).

Tensors (docs/dflash.md, "Domino and DSpark from a plain DFlash checkpoint"): a bias-free GRU
over the target embeddings of the tokens before each position (``prefix_gru.weight_ih_l0``
``[3g, H]``, ``prefix_gru.weight_hh_l0`` ``[3g, g]``) and ``embed_proj`` (``.0.weight``
``[emb_dim, H + g]``, ``.2.weight`` ``[vocab, emb_dim]``). With ``shift_label`` (ModelOpt's
labels) block position k predicts anchor + k + 1; the first ``pure_draft_prefix_len``
positions are proposed uncorrected. The torch half (the head module, its objective and greedy
proposals): :mod:`dflash_recipes.executor.kinds.domino`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dflash_recipes.checkpoint.config_fields import _DC
from dflash_recipes.checkpoint.kinds.alignment import (
    FIELD_DIFFERS,
    TrainedDetail,
    shift_label_findings,
    stated_int,
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

#: The compiler's code for a prefix that leaves nothing to correct (compiler/codes.py).
PURE_DRAFT_PREFIX_RANGE = "pure-draft-prefix-range"


def _shift(draft: HeadSettings) -> str:
    return f"shift_label {'true' if draft.shift_label else 'false'}"


class DominoFacts:
    """Domino (module doc)."""

    name = "domino"
    head_fields: tuple[str, ...] = ("emb_dim", "gru_hidden_dim")
    field_meaning: Mapping[str, str] = {
        "emb_dim": "the width of Domino's correction embedding",
        "gru_hidden_dim": "the hidden width of Domino's prefix GRU",
    }
    switch_fields: tuple[str, ...] = ()
    layout_needs: tuple[str, ...] = ("vocab_size", "emb_dim", "gru_hidden_dim")
    shifts_labels = True
    marker_prefixes: tuple[str, ...] = ("prefix_gru.", "embed_proj.")
    # The corrected logits and their log-softmax: a rough count, not measured.
    loss_logit_copies = 2
    head_name: str | None = "domino"
    inherited_fields: tuple[str, ...] = ()
    required_fields: tuple[str, ...] = ()
    trains = True
    fresh_start = "will train from scratch"
    objective_fields: tuple[str, ...] = ("domino_backbone_loss_weight",)
    sliding_causal = True
    eval_without_head = False

    def layout(self, spec: LayoutSettings) -> dict[str, Shape]:
        """``prefix_gru.weight_{ih,hh}_l0`` and ``embed_proj.{0,2}.weight`` (module doc)."""
        assert spec.gru_hidden_dim is not None
        assert spec.emb_dim is not None
        assert spec.vocab_size is not None
        hidden, gru = spec.hidden_size, spec.gru_hidden_dim
        return {
            "prefix_gru.weight_ih_l0": (3 * gru, hidden),
            "prefix_gru.weight_hh_l0": (3 * gru, gru),
            "embed_proj.0.weight": (spec.emb_dim, hidden + gru),
            "embed_proj.2.weight": (spec.vocab_size, spec.emb_dim),
        }

    def tensor_groups(self, spec: LayoutSettings) -> dict[str, tuple[str, ...]]:
        """``prefix_gru`` and ``embed_proj``."""
        return group_by_submodule(self.layout(spec))

    def infer_dims(self, found: Mapping[str, Shape]) -> dict[str, int]:
        """vocab_size and emb_dim from ``embed_proj``, gru_hidden_dim from the GRU."""
        dims: dict[str, int] = {}
        vocab = dim(found, "embed_proj.2.weight", 2, 0)
        if vocab:
            dims["vocab_size"] = vocab
        emb = dim(found, "embed_proj.0.weight", 2, 0)
        if emb:
            dims["emb_dim"] = emb
        gru = dim(found, "prefix_gru.weight_hh_l0", 2, 1)
        if gru:
            dims["gru_hidden_dim"] = gru
        return dims

    def describe(self, draft: HeadSettings) -> str:
        """``domino (shift_label true, pure_draft_prefix_len 1)``."""
        return f"domino ({_shift(draft)}, pure_draft_prefix_len {draft.pure_draft_prefix_len})"

    def export_config(
        self, draft: HeadSettings, config: dict[str, JsonValue]
    ) -> dict[str, JsonValue]:
        """The head fields as ModelOpt's exporters write them, and ``emb_dim`` at the top."""
        return with_kind_fields(
            config,
            top={"emb_dim": draft.emb_dim},
            nested={
                "shift_label": draft.shift_label,
                "pure_draft_prefix_len": draft.pure_draft_prefix_len,
                "gru_hidden_dim": draft.gru_hidden_dim,
                "emb_dim": draft.emb_dim,
            },
        )

    def serving_warnings(self, draft: HeadSettings) -> list[str]:
        """SGLang's Domino runtime serves pure_draft_prefix_len 1 only; vLLM has no Domino."""
        prefix = draft.pure_draft_prefix_len
        if prefix == 1:
            return []
        return [
            "warning: this Domino export is not served as trained by any engine: its head "
            f"leaves {prefix} proposals uncorrected "
            f"(dflash_config.pure_draft_prefix_len {prefix}), SGLang's "
            "Domino runtime accepts only pure_draft_prefix_len 1 and refuses it, and vLLM has "
            "no Domino head; train with pure_draft_prefix_len: 1 to serve it with SGLang, or "
            "use `dflash-recipe eval` to measure it (see 'Serving the export' in docs/dflash.md)"
        ]

    def needs_teacher(self, objective: ObjectiveSettings) -> bool:
        """Domino's own terms (the backbone CE) read labels only."""
        return False

    def recipe_findings(self, arch: HeadSettings, block_size: int) -> list[KindFinding]:
        """The uncorrected prefix must leave the block at least one corrected position."""
        prefix = arch.pure_draft_prefix_len
        if prefix <= block_size - 1:
            return []
        return [
            KindFinding(
                PURE_DRAFT_PREFIX_RANGE,
                "pure_draft_prefix_len",
                f"pure_draft_prefix_len {prefix} leaves no block position for Domino's head to "
                f"correct: it must lie in [0, {block_size - 1}] (dflash_block_size "
                f"{block_size} minus 1)",
                "set dflash_architecture_config.pure_draft_prefix_len: 1 (ModelOpt's default, "
                f"the only value SGLang serves), or any value up to {block_size - 1}",
            )
        ]

    def checkpoint_findings(
        self, nested: Mapping[str, object], recipe: AlignmentSettings
    ) -> list[KindFinding]:
        """shift_label (:mod:`~dflash_recipes.checkpoint.kinds.alignment`), then the prefix."""
        prefix = stated_int(nested, "pure_draft_prefix_len")
        findings = shift_label_findings(
            self.name, nested, recipe, corrects_every_proposal=prefix == 0
        )
        if prefix is not None and prefix != recipe.pure_draft_prefix_len:
            findings.append(
                KindFinding(
                    FIELD_DIFFERS,
                    "pure_draft_prefix_len",
                    f"`{_DC}pure_draft_prefix_len: {prefix}`: the checkpoint's Domino head "
                    f"leaves {prefix} proposal(s) uncorrected; the recipe's "
                    f"pure_draft_prefix_len {recipe.pure_draft_prefix_len} corrects other "
                    "positions, so the warm-started head starts on positions it never learned",
                    f"set dflash_architecture_config.pure_draft_prefix_len: {prefix} to keep "
                    "the checkpoint's, unless the change is intended",
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
        """The shift_label note, with the checkpoint's prefix when it states one."""
        prefix = stated_int(nested, "pure_draft_prefix_len")
        detail = (
            TrainedDetail("pure_draft_prefix_len", prefix, draft.pure_draft_prefix_len)
            if prefix is not None
            else None
        )
        return trained_for_note(where, nested, draft, self.describe(draft), detail=detail)

    def starter_fields(
        self, stated: StatedHead, tensors: Collection[str]
    ) -> dict[str, tuple[object, str]]:
        """Nothing beyond the head sizes."""
        return {}


FACTS = DominoFacts()

__all__ = ["FACTS", "PURE_DRAFT_PREFIX_RANGE", "DominoFacts"]
