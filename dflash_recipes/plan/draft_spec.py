"""The drafter's complete specification, resolved from a run plan: what the executor builds.

A :class:`~dflash_recipes.plan.run_plan.RunPlan` stores what the compiler decided, section by
section,
with optional fields where a recipe may leave a value to the checkpoint or the base model.
:class:`ResolvedDraft` is the executor's view of it: every dimension, tap, mask id, head and
layer type of the drafter, none optional (``RunPlan.resolved_draft()`` builds it, or raises
PlanError naming what the plan leaves unresolved). Pure data, no torch; the compile path does
not import it.
"""

from __future__ import annotations

import attrs

from dflash_recipes.checkpoint.kinds.registry import kind_facts
from dflash_recipes.checkpoint.target_facts import RopePlan, TargetFacts
from dflash_recipes.errors import PlanError
from dflash_recipes.plan.parts import ArchitecturePlan, DraftPlan
from dflash_recipes.recipe.choices import MarkovHeadType, ProjectorType
from dflash_recipes.records import Record


@attrs.frozen(repr=False, eq=False, slots=False)
class ResolvedDraft(Record):
    """The drafter's complete, non-optional specification (built from a resolved plan)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    num_target_layers: int
    max_position_embeddings: int
    rope: RopePlan
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    projector_type: ProjectorType
    emb_dim: int | None
    gru_hidden_dim: int | None
    markov_rank: int | None
    use_confidence_head: bool
    attention_sink: bool
    #: One of full_attention | sliding_attention per draft layer; None: full attention in all.
    layer_types: tuple[str, ...] | None = None
    #: Keys a sliding_attention query sees, itself included (None without sliding layers).
    sliding_window: int | None = None
    #: Domino/DSpark: block position k predicts anchor + k + 1 (true) or anchor + k (false).
    shift_label: bool = True
    #: Domino: block positions left uncorrected (backbone logits only).
    pure_draft_prefix_len: int = 1
    #: DSpark: vanilla | gated | rnn.
    markov_head_type: MarkovHeadType = "vanilla"
    #: DFlash 2 (None for other kinds): convolution taps and channels per coefficient group,
    #: selector rank and candidates, unary-logit factor and soft cap, query-embedding factor.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None

    @property
    def label_shift(self) -> int:
        """1 when block position k predicts anchor + k + 1 (a head with shift_label), else 0.

        Plain DFlash is always 0 (its kind has no label shift): position k predicts anchor + k
        and position 0 is the anchor.
        """
        return int(kind_facts(self.projector_type).shifts_labels and self.shift_label)

    @property
    def drafted_tokens(self) -> int:
        """Proposals per block: ``block_size`` with the label shift, else ``block_size - 1``."""
        return self.block_size - 1 + self.label_shift

    @property
    def first_drafting_position(self) -> int:
        """The first block position whose output is a proposal (0 with the shift, else 1)."""
        return 1 - self.label_shift

    @property
    def head_description(self) -> str:
        """The head as it drafts, in words (``KindFacts.describe``): ``dflash`` (no head),
        ``domino (shift_label true, pure_draft_prefix_len 1)``, ``dspark vanilla (shift_label
        true)``."""
        return kind_facts(self.projector_type).describe(self)

    @property
    def sliding_causal(self) -> bool:
        """Whether ``sliding_attention`` layers are causal inside the block (``KindFacts.
        sliding_causal``): DFlash 1 kinds yes, DFlash 2 (``is_causal: false``) no."""
        return kind_facts(self.projector_type).sliding_causal

    def layer_type(self, index: int) -> str:
        """``full_attention`` or ``sliding_attention``: the kind of draft layer `index`."""
        return self.layer_types[index] if self.layer_types is not None else "full_attention"

    def layer_window(self, index: int) -> int | None:
        """The sliding window of draft layer `index`, or None for a full-attention layer."""
        return self.sliding_window if self.layer_type(index) == "sliding_attention" else None


def resolve_draft(draft: DraftPlan, facts: TargetFacts | None) -> ResolvedDraft:
    """Collect the drafter spec from a plan's draft and base-model facts; PlanError lists every
    unresolved field (``RunPlan.resolved_draft()`` calls it)."""
    arch = draft.architecture
    missing: list[str] = []
    for name in (
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
    ):
        if getattr(arch, name) is None:
            missing.append(f"draft.architecture.{name}")
    if draft.mask_token_id is None:
        missing.append("draft.mask_token_id")
    if draft.target_layer_ids is None:
        missing.append("draft.target_layer_ids")
    if facts is None:
        missing.append("base_model.facts")
    if missing or facts is None:
        msg = (
            "the run plan is not resolved (" + ", ".join(missing) + "); compile it with "
            "`dflash-recipe compile RECIPE -o plan.json` so config.json and the checkpoint "
            "are read"
        )
        raise PlanError(msg)
    assert arch.num_hidden_layers is not None
    assert arch.num_attention_heads is not None
    assert arch.num_key_value_heads is not None
    assert arch.head_dim is not None
    assert arch.intermediate_size is not None
    assert draft.mask_token_id is not None
    assert draft.target_layer_ids is not None
    _check_layer_types(arch)
    return ResolvedDraft(
        hidden_size=facts.hidden_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.intermediate_size,
        rms_norm_eps=arch.rms_norm_eps,
        vocab_size=facts.vocab_size,
        num_target_layers=facts.num_hidden_layers,
        max_position_embeddings=facts.max_position_embeddings,
        rope=facts.rope,
        block_size=draft.block_size,
        mask_token_id=draft.mask_token_id,
        target_layer_ids=draft.target_layer_ids,
        projector_type=arch.projector_type,
        emb_dim=arch.emb_dim,
        gru_hidden_dim=arch.gru_hidden_dim,
        markov_rank=arch.markov_rank,
        use_confidence_head=arch.use_confidence_head,
        attention_sink=arch.attention_sink,
        layer_types=arch.layer_types,
        sliding_window=arch.sliding_window,
        shift_label=arch.shift_label,
        pure_draft_prefix_len=arch.pure_draft_prefix_len,
        markov_head_type=arch.markov_head_type,
        conv_kernel_size=arch.conv_kernel_size,
        conv_group_size=arch.conv_group_size,
        selector_rank=arch.selector_rank,
        selector_top_k=arch.selector_top_k,
        output_multiplier=arch.output_multiplier,
        final_logit_softcapping=arch.final_logit_softcapping,
        input_embedding_scale=arch.input_embedding_scale,
    )


def _check_layer_types(arch: ArchitecturePlan) -> None:
    """PlanError unless the layer types name one kind per layer and sliding layers have a window."""
    types = arch.layer_types
    if types is None:
        return
    problem = None
    if len(types) != arch.num_hidden_layers:
        problem = f"has {len(types)} layer_types for {arch.num_hidden_layers} draft layers"
    elif "sliding_attention" in types and arch.sliding_window is None:
        problem = "has sliding_attention layers but no sliding_window"
    elif any(t not in ("full_attention", "sliding_attention") for t in types):
        problem = f"names an unknown layer type in {list(types)}"
    if problem is not None:
        msg = (
            f"the run plan {problem}; recompile the recipe with `dflash-recipe compile` "
            "instead of editing the plan"
        )
        raise PlanError(msg)


__all__ = ["ResolvedDraft", "resolve_draft"]
