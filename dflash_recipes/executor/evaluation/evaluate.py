"""Measured acceptance of a drafter on held-out prompts (library side of ``dflash-recipe eval``).

:func:`evaluate_acceptance` runs
:func:`~dflash_recipes.executor.evaluation.speculative.speculative_generate`
on each prompt, reports the acceptance length tau two ways (pooled: the mean over every
verification step of every prompt; per-prompt mean: the mean of each prompt's own tau, the figure
z-lab's benchmark publishes), the per-position acceptance rate,
and checks that every output equals the target's plain greedy decoding (``lossless``).
:func:`run_eval` loads the target, the drafter weights and the prompts from a plan and a
checkpoint directory.

Prompts are conversations in the training data's JSONL formats (OpenAI ``messages`` or ShareGPT
``conversations``, read by :func:`~dflash_recipes.executor.data.conversations.read_conversations`);
a bare
prompt is a conversation with one user turn. The prompt is the conversation up to, not
including, its first assistant turn, rendered with the chat template and the generation
prompt; later turns are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import attrs
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.conversations import (
    Conversation,
    read_chat_template,
    read_conversations,
)
from dflash_recipes.executor.evaluation.speculative import (
    BlockDrafter,
    is_greedy_decoding,
    speculative_generate,
)
from dflash_recipes.executor.model.convert import load_base_model, load_tokenizer, torch_dtype
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.weights import load_drafter_weights
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

logger = logging.getLogger(__name__)


@attrs.frozen(repr=False, eq=False, slots=False)
class AcceptanceReport(Record):
    """Measured acceptance of a drafter over a set of prompts."""

    #: Pooled tau: mean acceptance length over all verification steps of all prompts together
    #: (accepted drafts + 1), in [1, B]. Long generations weigh more.
    tau: float
    #: For draft position k = 1 .. B-1 (index k - 1): accepted / reached, where a position is
    #: reached when every position before it was accepted. 0.0 where it was never reached.
    per_position_acceptance: list[float]
    #: How often each draft position was reached (the denominators of the rates above).
    reached_per_position: list[int]
    #: Verification steps (target passes after each prompt's prefill), all prompts together.
    steps: int
    #: Generated tokens, all prompts together.
    tokens: int
    #: True when every output equals the target's plain greedy decoding.
    lossless: bool
    block_size: int
    num_prompts: int
    #: Indices of prompts whose speculative output differed from greedy (empty when lossless).
    mismatched_prompts: list[int] = attrs.field(factory=list)
    #: Each prompt's own tau (mean over its verification steps), in prompt order; prompts whose
    #: generation ended at the prefill (no verification step) have none and are left out.
    tau_per_prompt: list[float] = attrs.field(factory=list)

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
        }


def acceptance_from_steps(
    accepted_per_step: Sequence[int], block_size: int
) -> tuple[list[float], list[int]]:
    """Per-position acceptance rates and reach counts from the taus of verification steps."""
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


def evaluate_acceptance(
    target: PreTrainedModel,
    drafter: nn.Module | BlockDrafter,
    spec: ResolvedDraft,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
) -> AcceptanceReport:
    """Speculative decoding on every prompt: tau, per-position acceptance, losslessness.

    Safe to call during training: modules are put in eval mode for the measurement and their
    previous mode is restored. Pass the bare drafter, not a DDP/FSDP wrapper.
    """
    if not prompts:
        msg = "no prompts to evaluate acceptance on"
        raise DataError(msg)
    # Eval mode for the measurement, then every submodule's own mode back (the target may hold
    # the drafter as dflash_module, so whole-module train()/eval() would not restore it).
    modes = {
        module: module.training
        for root in (target, drafter)
        if isinstance(root, nn.Module)
        for module in root.modules()
    }
    for module in modes:
        module.eval()
    taus: list[int] = []
    per_prompt: list[float] = []
    tokens = 0
    mismatched: list[int] = []
    try:
        for index, prompt in enumerate(prompts):
            result = speculative_generate(
                target,
                drafter,
                spec,
                prompt,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
            )
            # One teacher-forced target pass checks the output against greedy decoding.
            if not is_greedy_decoding(target, prompt, result.tokens, max_new_tokens, eos_token_id):
                mismatched.append(index)
            taus.extend(result.accepted_per_step)
            steps = result.accepted_per_step
            if steps:  # a generation that ended at the prefill has no tau
                per_prompt.append(sum(steps) / len(steps))
            tokens += len(result.tokens)
    finally:
        for module, mode in modes.items():
            module.training = mode
    rates, reached = acceptance_from_steps(taus, spec.block_size)
    return AcceptanceReport(
        tau=sum(taus) / len(taus) if taus else 0.0,
        per_position_acceptance=rates,
        reached_per_position=reached,
        steps=len(taus),
        tokens=tokens,
        lossless=not mismatched,
        block_size=spec.block_size,
        num_prompts=len(prompts),
        mismatched_prompts=mismatched,
        tau_per_prompt=per_prompt,
    )


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def prompt_messages(conversation: Conversation) -> list[dict[str, str]]:
    """The turns before the first assistant turn, as chat-template dicts (maybe empty)."""
    messages: list[dict[str, str]] = []
    for message in conversation.messages:
        if message.role == "assistant":
            break
        messages.append({"role": message.role, "content": message.content})
    return messages


def prompts_from_conversations(
    conversations: Iterable[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    limit: int | None = None,
) -> list[list[int]]:
    """Token ids of each conversation's prompt, in order, at most ``limit`` of them.

    ``chat_template`` is template text (None: the tokenizer's own). A conversation that opens
    with an assistant turn has no prompt and is left out.
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None:
        msg = (
            "the tokenizer has no chat template; set data.chat_template to a .jinja file that "
            "renders the conversations"
        )
        raise DataError(msg)
    prompts: list[list[int]] = []
    for conversation in conversations:
        if limit is not None and len(prompts) >= limit:
            break
        messages = prompt_messages(conversation)
        if not messages:
            continue
        try:
            encoded = tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )
        except Exception as exc:  # jinja and templates raise many kinds
            msg = f"line {conversation.line}: the chat template could not render the prompt: {exc}"
            raise DataError(msg) from exc
        ids = encoded.get("input_ids") if isinstance(encoded, Mapping) else None
        if not isinstance(ids, list) or not ids:
            msg = f"line {conversation.line}: the chat template rendered no prompt tokens"
            raise DataError(msg)
        prompts.append([int(i) for i in ids])
    return prompts


def load_prompts(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    limit: int | None = None,
) -> list[list[int]]:
    """The first ``limit`` prompts of a JSONL conversation file; DataError when there are none.

    Unusable lines are skipped (and logged with the file's summary), as for training data.
    """
    file = read_conversations(
        path, answer_only_loss=False, setting="--prompts (or data.eval_data_path)"
    )
    if file.skipped:
        logger.warning("%s: %s", path, file.summary)
    prompts = prompts_from_conversations(
        file.conversations, tokenizer, chat_template=chat_template, limit=limit
    )
    if not prompts:
        msg = f"{path} has no conversation with a turn before its first assistant turn"
        raise DataError(msg)
    return prompts


# ---------------------------------------------------------------------------------------------
# The CLI's library call
# ---------------------------------------------------------------------------------------------


def evaluate_on_plan_data(
    plan: RunPlan,
    target: PreTrainedModel,
    drafter: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_new_tokens: int = 32,
    num_prompts: int = 4,
) -> AcceptanceReport:
    """Measured acceptance on the first ``num_prompts`` of ``data.eval_data_path`` (in training).

    ``drafter`` is the drafter or the converted model, on the target's device; its train/eval
    mode is restored afterwards. DataError when the plan has no eval data.
    """
    if plan.data.eval_data_path is None:
        msg = "data.eval_data_path is not set: there are no held-out conversations to measure on"
        raise DataError(msg)
    prompts = load_prompts(
        Path(plan.data.eval_data_path),
        tokenizer,
        chat_template=read_chat_template(plan.data.chat_template),
        limit=num_prompts,
    )
    eos = tokenizer.eos_token_id
    return evaluate_acceptance(
        target,
        drafter,
        plan.resolved_draft(),
        prompts,
        max_new_tokens=max_new_tokens,
        eos_token_id=int(eos) if eos is not None else None,
    )


def run_eval(
    plan: RunPlan,
    checkpoint_dir: Path,
    prompts_file: Path | None,
    *,
    max_new_tokens: int = 64,
    num_prompts: int = 8,
) -> AcceptanceReport:
    """Measure a saved drafter's acceptance with the plan's target, taps, mask and block size.

    Weights come from ``checkpoint_dir`` (an export or a training checkpoint); prompts from
    ``prompts_file`` or else ``plan.data.eval_data_path`` (the first ``num_prompts``), rendered
    with ``data.chat_template`` or the base model's tokenizer's template. Generation stops at
    the tokenizer's eos token. Runs on the CPU in the plan's dtype.
    """
    spec = plan.resolved_draft()
    source = prompts_file
    if source is None and plan.data.eval_data_path is not None:
        source = Path(plan.data.eval_data_path)
    if source is None:
        msg = (
            "no held-out prompts: pass --prompts FILE or set data.eval_data_path in the recipe "
            "(JSONL conversations, like the training data)"
        )
        raise DataError(msg)
    drafter = DFlashDraftModel(spec)
    load_drafter_weights(drafter, checkpoint_dir)
    tokenizer = load_tokenizer(plan)  # the one training used (model.trust_remote_code included)
    prompts = load_prompts(
        source,
        tokenizer,
        chat_template=read_chat_template(plan.data.chat_template),
        limit=num_prompts,
    )
    target = load_base_model(plan)
    drafter.to(dtype=torch_dtype(plan.base_model.dtype))
    eos = tokenizer.eos_token_id
    return evaluate_acceptance(
        target,
        drafter,
        spec,
        prompts,
        max_new_tokens=max_new_tokens,
        eos_token_id=int(eos) if eos is not None else None,
    )


__all__ = [
    "AcceptanceReport",
    "acceptance_from_steps",
    "evaluate_acceptance",
    "evaluate_on_plan_data",
    "load_drafter_weights",
    "load_prompts",
    "prompt_messages",
    "prompts_from_conversations",
    "run_eval",
]
