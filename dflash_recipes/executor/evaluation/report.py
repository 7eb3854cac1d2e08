"""What a measurement of acceptance reports: :class:`AcceptanceReport`, and the arithmetic
that turns verification steps into its figures (tau pooled, per prompt and per workload tag,
per-position acceptance)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dflash_recipes.executor.evaluation.eval_settings import EvalSettings
from dflash_recipes.executor.evaluation.speculative import SpecResult
from dflash_recipes.records import Record

#: The tag of the prompts without one, in a report whose other prompts carry one.
UNTAGGED = "untagged"


@attrs.frozen(repr=False, eq=False, slots=False)
class TagAcceptance(Record):
    """The acceptance of the prompts of one workload tag (chat, code, tool, ...)."""

    tag: str
    #: Pooled tau over this tag's verification steps.
    tau: float
    #: Mean of this tag's per-prompt taus.
    tau_per_prompt_mean: float
    num_prompts: int
    steps: int

    def to_dict(self) -> dict[str, object]:
        return {
            "tau": self.tau,
            "tau_per_prompt_mean": self.tau_per_prompt_mean,
            "num_prompts": self.num_prompts,
            "steps": self.steps,
        }


@attrs.frozen(repr=False, eq=False, slots=False)
class AcceptanceReport(Record):
    """Measured acceptance of a drafter over a set of prompts."""

    #: Pooled tau: mean acceptance length over all verification steps of all prompts together
    #: (accepted drafts + 1), in [1, drafted_tokens + 1]. Long generations weigh more.
    tau: float
    #: For the k-th proposal, k = 1 .. drafted_tokens (index k - 1): accepted / reached, where a
    #: proposal is reached when every one before it was accepted. 0.0 where never reached.
    per_position_acceptance: list[float]
    #: How often each draft position was reached (the denominators of the rates above).
    reached_per_position: list[int]
    #: Verification steps (target passes after each prompt's prefill), all prompts together.
    steps: int
    #: Generated tokens, all prompts together.
    tokens: int
    #: True when every output equals the target's plain greedy decoding; None when not checked:
    #: sampled verification has no single output to compare (its rejection rule keeps the
    #: target's distribution, which the test suite checks).
    lossless: bool | None
    block_size: int
    num_prompts: int
    #: Indices of prompts whose speculative output differed from greedy (empty when lossless).
    mismatched_prompts: list[int] = attrs.field(factory=list)
    #: Each prompt's own tau (mean over its verification steps), in prompt order; prompts whose
    #: generation ended at the prefill (no verification step) have none and are left out.
    tau_per_prompt: list[float] = attrs.field(factory=list)
    #: The max_new_tokens the prompts were generated with (None: not recorded).
    max_new_tokens: int | None = None
    #: Wall-clock seconds of speculative generation (the losslessness check excluded); not
    #: compared by ``==`` (two runs of the same measurement take different times).
    generation_seconds: float = attrs.field(default=0.0, eq=False)
    #: What makes this tau comparable (prompt file, chat template, thinking mode, ...).
    settings: EvalSettings | None = None
    #: The head the proposals were drafted with, as the serving engine applies it
    #: (``ResolvedDraft.head_description``, e.g. ``domino (shift_label true,
    #: pure_draft_prefix_len 1)``).
    head: str = "dflash (no head)"
    #: Proposals per verification step (B - 1, or B for a head with shift_label); tau is at
    #: most one more.
    drafted_tokens: int | None = None
    #: Pooled tau of the same prompts drafted with the head switched off (the backbone's own
    #: argmax, or its draws when sampled; DFlash 2: the unary path instead of the selector's,
    #: the same seed's draws); ``tau`` minus this is
    #: what the head buys. None when not measured: the kind's ``eval_without_head`` is false,
    #: or the drafter was a bare BlockDrafter, whose head cannot be switched off.
    tau_without_head: float | None = None
    #: The mean of per-prompt taus of that head-off measurement (None when not measured).
    tau_without_head_per_prompt_mean: float | None = None
    #: Indices of prompts whose head-off output differed from greedy (also make ``lossless``
    #: false); empty when lossless or not measured.
    mismatched_prompts_without_head: list[int] = attrs.field(factory=list)
    #: Tau per workload tag when the prompts carry one (a prompt row's ``tag``), in tag order;
    #: prompts without one are counted as :data:`UNTAGGED`. Empty when no prompt has a tag.
    tau_per_tag: list[TagAcceptance] = attrs.field(factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of speculative generation (0.0 when not timed)."""
        return self.tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0

    @property
    def tau_pooled(self) -> float:
        """The pooled tau (same as ``tau``): all verification steps together."""
        return self.tau

    @property
    def tau_per_prompt_mean(self) -> float:
        """Mean of the per-prompt taus: every prompt weighs the same (z-lab's benchmark figure)."""
        if not self.tau_per_prompt:
            return 0.0
        return sum(self.tau_per_prompt) / len(self.tau_per_prompt)

    def to_dict(self) -> dict[str, object]:
        """JSON-compatible dict of every field (``tau`` is the pooled tau, as before)."""
        return {
            "tau": self.tau,
            "tau_pooled": self.tau_pooled,
            "tau_per_prompt_mean": self.tau_per_prompt_mean,
            "tau_per_prompt": list(self.tau_per_prompt),
            "per_position_acceptance": list(self.per_position_acceptance),
            "reached_per_position": list(self.reached_per_position),
            "steps": self.steps,
            "tokens": self.tokens,
            "lossless": self.lossless,
            "block_size": self.block_size,
            "num_prompts": self.num_prompts,
            "mismatched_prompts": list(self.mismatched_prompts),
            "max_new_tokens": self.max_new_tokens,
            "generation_seconds": self.generation_seconds,
            "tokens_per_second": self.tokens_per_second,
            "settings": self.settings.to_dict() if self.settings is not None else None,
            "head": self.head,
            "drafted_tokens": self.drafted_tokens,
            "tau_without_head": self.tau_without_head,
            "tau_without_head_per_prompt_mean": self.tau_without_head_per_prompt_mean,
            "mismatched_prompts_without_head": list(self.mismatched_prompts_without_head),
            "tau_per_tag": {t.tag: t.to_dict() for t in self.tau_per_tag},
        }


def acceptance_from_steps(
    accepted_per_step: Sequence[int], block_size: int
) -> tuple[list[float], list[int]]:
    """Per-position acceptance rates and reach counts from the taus of verification steps.

    ``block_size`` is one more than the proposals per step (``spec.drafted_tokens + 1``)."""
    reached = [0] * (block_size - 1)
    accepted = [0] * (block_size - 1)
    for tau in accepted_per_step:
        drafts_accepted = tau - 1
        for k in range(1, block_size):
            if drafts_accepted >= k - 1:
                reached[k - 1] += 1
            if drafts_accepted >= k:
                accepted[k - 1] += 1
    rates = [a / r if r else 0.0 for a, r in zip(accepted, reached, strict=True)]
    return rates, reached


def step_taus(results: Sequence[SpecResult]) -> tuple[list[int], list[float]]:
    """Every verification step's tau, and each prompt's own tau (mean over its steps; a
    generation that ended at the prefill has none and is left out)."""
    steps = [tau for result in results for tau in result.accepted_per_step]
    own = [mean_of(result.accepted_per_step) for result in results if result.accepted_per_step]
    return steps, own


def acceptance_per_tag(
    results: Sequence[SpecResult], tags: Sequence[str | None]
) -> list[TagAcceptance]:
    """Tau per tag of the prompts `results` answered (`tags` in the same order); empty when
    no prompt has a tag, and :data:`UNTAGGED` for those without one when others have."""
    if not any(tag is not None for tag in tags):
        return []
    groups: dict[str, list[SpecResult]] = {}
    for result, tag in zip(results, tags, strict=True):
        groups.setdefault(tag if tag is not None else UNTAGGED, []).append(result)
    found = []
    for tag in sorted(groups):
        steps, own = step_taus(groups[tag])
        found.append(TagAcceptance(tag, mean_of(steps), mean_of(own), len(groups[tag]), len(steps)))
    return found


def mean_of(values: Sequence[float]) -> float:
    """The mean (0.0 of nothing)."""
    return sum(values) / len(values) if values else 0.0


__all__ = [
    "UNTAGGED",
    "AcceptanceReport",
    "TagAcceptance",
    "acceptance_from_steps",
    "acceptance_per_tag",
    "mean_of",
    "step_taus",
]
