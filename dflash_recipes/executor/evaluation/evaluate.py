"""Measured acceptance of a drafter on held-out prompts (library side of ``dflash-recipe eval``).

:func:`evaluate_acceptance` runs the KV-cached verification loop
(:func:`~dflash_recipes.executor.evaluation.cached_decoding.speculative_generate_batch`,
``batch_size`` prompts at a time) on every prompt, reports the acceptance length tau two ways
(pooled: the mean over every verification step of every prompt; per-prompt mean: the mean of
each prompt's own tau, the figure z-lab's benchmark publishes), the per-position acceptance rate and
tokens/s, and checks that every output equals the target's plain greedy decoding
(``lossless``). For a kind whose facts ask for it (``KindFacts.eval_without_head``: DFlash 2)
it measures the same prompts a second time with the head switched off (the backbone's argmax,
DFlash 2's unary path beside the selector's), so the report shows what the head buys.
:func:`run_eval` loads the target, the drafter weights and the prompts from a
plan and a checkpoint directory, and records what makes its tau comparable
(:class:`~dflash_recipes.executor.evaluation.eval_settings.EvalSettings`).

Prompts are conversations in the training data's JSONL formats (OpenAI ``messages`` or
ShareGPT ``conversations``, read by
:func:`~dflash_recipes.data.conversations.read_conversations`), a JSON list of prompt
strings or message lists, or a Parquet column
(:mod:`~dflash_recipes.executor.evaluation.prompt_files`); a bare prompt is a conversation with
one user turn. The prompt is the conversation up to, not including, its first assistant turn,
rendered with the chat template and the generation prompt; later turns are ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dflash_recipes.checkpoint.kinds.registry import kind_facts
from dflash_recipes.data.conversations import (
    Conversation,
    read_conversations,
    template_messages,
    tool_schemas,
)
from dflash_recipes.data.sources import input_sha256
from dflash_recipes.errors import DataError
from dflash_recipes.executor.data.holdout import plan_held_out_conversations
from dflash_recipes.executor.data.tokenize import read_chat_template
from dflash_recipes.executor.evaluation.cached_decoding import (
    check_positions,
    speculative_generate_batch,
)
from dflash_recipes.executor.evaluation.eval_settings import DECODING, EvalSettings, sha256_text
from dflash_recipes.executor.evaluation.prompt_files import (
    UNITS,
    prompt_format,
    read_json_prompts,
    read_parquet_prompts,
)
from dflash_recipes.executor.evaluation.report import (
    AcceptanceReport,
    acceptance_from_steps,
    acceptance_per_tag,
    mean_of,
    step_taus,
)
from dflash_recipes.executor.evaluation.sampling import Sampling
from dflash_recipes.executor.evaluation.speculative import (
    BlockDrafter,
    DFlashBlockDrafter,
    SpecResult,
    as_block_drafter,
    is_greedy_decoding,
)
from dflash_recipes.executor.model.convert import load_base_model, load_tokenizer, torch_dtype
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.weights import load_drafter_weights
from dflash_recipes.plan.draft_spec import ResolvedDraft
from dflash_recipes.plan.run_plan import RunPlan

logger = logging.getLogger(__name__)


def evaluate_acceptance(
    target: PreTrainedModel,
    drafter: nn.Module | BlockDrafter,
    spec: ResolvedDraft,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    batch_size: int = 1,
    settings: EvalSettings | None = None,
    sampling: Sampling | None = None,
    tags: Sequence[str | None] | None = None,
) -> AcceptanceReport:
    """Speculative decoding on every prompt: tau, per-position acceptance, losslessness, and
    tau per workload tag when `tags` (one per prompt, None for an untagged one) name any.

    Greedy verification by default. With `sampling` the target samples at its temperature
    (:mod:`~dflash_recipes.executor.evaluation.sampling`); no output is compared with greedy
    decoding then, and ``lossless`` is None.

    ``batch_size`` prompts run at a time as rows of one KV cache (1: one at a time); tokens and
    taus do not depend on it. Safe to call during training: modules are put in eval mode for
    the measurement and their previous mode is restored. Pass the bare drafter, not a
    DDP/FSDP wrapper. DataError when a prompt does not fit the target's positions.

    When the kind's ``eval_without_head`` is true and `drafter` is a module (or its
    :class:`DFlashBlockDrafter`), the prompts run a second time with the head off
    (``tau_without_head``); ``generation_seconds`` times the head path only. That path must be
    lossless too: an output equal to the head path's shares its verdict, any other gets its
    own greedy check, and a mismatch makes ``lossless`` false
    (``mismatched_prompts_without_head``).
    """
    if not prompts:
        msg = "no prompts to evaluate acceptance on"
        raise DataError(msg)
    if batch_size < 1:
        msg = f"batch_size must be at least 1, got {batch_size}"
        raise ValueError(msg)
    if tags is not None and len(tags) != len(prompts):
        msg = f"{len(tags)} tags for {len(prompts)} prompts; give one per prompt (None: none)"
        raise ValueError(msg)
    check_positions(target, prompts, max_new_tokens)  # all of them, before any generation
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

    def generate(block_drafter: nn.Module | BlockDrafter) -> tuple[list[SpecResult], float]:
        results: list[SpecResult] = []
        seconds = 0.0
        for first in range(0, len(prompts), batch_size):
            started = time.perf_counter()
            results += speculative_generate_batch(
                target,
                block_drafter,
                spec,
                prompts[first : first + batch_size],
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                sampling=sampling,
            )
            seconds += time.perf_counter() - started
        return results, seconds

    def greedy(prompt: Sequence[int], result: SpecResult) -> bool:
        # One teacher-forced target pass checks the output against greedy decoding; a sampled
        # output has nothing to equal (never counted as a mismatch).
        if sampling is not None:
            return True
        return is_greedy_decoding(target, prompt, result.tokens, max_new_tokens, eos_token_id)

    off: list[SpecResult] | None = None
    mismatched_headless: list[int] = []
    try:
        results, seconds = generate(drafter)
        pairs = list(zip(prompts, results, strict=True))
        mismatched = [index for index, (p, r) in enumerate(pairs) if not greedy(p, r)]
        if _measures_without_head(drafter, spec):
            off, _ = generate(as_block_drafter(drafter, target, spec, use_head=False))
            # Greedy decoding has one output: the head path's verdict holds for the same tokens,
            # so only an output that differs costs a target pass.
            mismatched_headless = [
                index
                for index, ((p, r), o) in enumerate(zip(pairs, off, strict=True))
                if (index in mismatched if o.tokens == r.tokens else not greedy(p, o))
            ]
    finally:
        for module, mode in modes.items():
            module.training = mode
    taus, per_prompt = step_taus(results)
    headless = step_taus(off) if off is not None else None
    rates, reached = acceptance_from_steps(taus, spec.drafted_tokens + 1)
    return AcceptanceReport(
        tau=mean_of(taus),
        per_position_acceptance=rates,
        reached_per_position=reached,
        steps=len(taus),
        tokens=sum(len(result.tokens) for result in results),
        lossless=None if sampling is not None else not mismatched and not mismatched_headless,
        block_size=spec.block_size,
        num_prompts=len(prompts),
        mismatched_prompts=mismatched,
        tau_per_prompt=per_prompt,
        max_new_tokens=max_new_tokens,
        generation_seconds=seconds,
        settings=settings,
        head=spec.head_description,
        drafted_tokens=spec.drafted_tokens,
        tau_without_head=None if headless is None else mean_of(headless[0]),
        tau_without_head_per_prompt_mean=None if headless is None else mean_of(headless[1]),
        mismatched_prompts_without_head=mismatched_headless,
        tau_per_tag=acceptance_per_tag(results, tags or [None] * len(results)),
    )


def _measures_without_head(drafter: nn.Module | BlockDrafter, spec: ResolvedDraft) -> bool:
    """Whether the kind asks for tau with its head off and `drafter`'s head can be switched off
    (a module's, not an arbitrary :class:`BlockDrafter`'s)."""
    switchable = isinstance(drafter, nn.Module | DFlashBlockDrafter)
    return switchable and kind_facts(spec.projector_type).eval_without_head


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def prompt_messages(conversation: Conversation) -> list[dict[str, object]]:
    """The turns before the first assistant turn, as chat-template dicts (maybe empty)."""
    turns = []
    for message in conversation.messages:
        if message.role == "assistant":
            break
        turns.append(message)
    return template_messages(turns)


def prompts_from_conversations(
    conversations: Iterable[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    limit: int | None = None,
    enable_thinking: bool | None = None,
    unit: str = "line",
) -> list[list[int]]:
    """Token ids of each conversation's prompt, in order, at most ``limit`` of them.

    ``chat_template`` is template text (None: the tokenizer's own). ``enable_thinking`` is
    passed to the template when not None (Qwen3-style thinking switch), and a row's ``tools``
    as the template's `tools`. A conversation that opens with an assistant turn has no prompt
    and is left out. ``unit`` names what a conversation's number counts in error messages
    (line, item, row). :func:`tagged_prompts` gives each prompt's workload tag too.
    """
    tagged = tagged_prompts(
        conversations,
        tokenizer,
        chat_template=chat_template,
        limit=limit,
        enable_thinking=enable_thinking,
        unit=unit,
    )
    return [ids for ids, _ in tagged]


def tagged_prompts(
    conversations: Iterable[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    limit: int | None = None,
    enable_thinking: bool | None = None,
    unit: str = "line",
) -> list[tuple[list[int], str | None]]:
    """:func:`prompts_from_conversations` with each prompt's workload tag (None: none)."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None:
        msg = (
            "the tokenizer has no chat template; set data.chat_template to a .jinja file that "
            "renders the conversations"
        )
        raise DataError(msg)
    # Extra template variables go through apply_chat_template's **kwargs.
    template_kwargs: dict[str, Any] = {}
    if enable_thinking is not None:
        template_kwargs["enable_thinking"] = enable_thinking
    prompts: list[tuple[list[int], str | None]] = []
    for conversation in conversations:
        if limit is not None and len(prompts) >= limit:
            break
        messages = prompt_messages(conversation)
        if not messages:
            continue
        try:
            encoded = tokenizer.apply_chat_template(
                messages,  # type: ignore[arg-type]
                tools=tool_schemas(conversation.tools),  # type: ignore[arg-type]
                chat_template=template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **template_kwargs,
            )
        except Exception as exc:  # jinja and templates raise many kinds
            msg = (
                f"{unit} {conversation.line}: the chat template could not render the prompt: {exc}"
            )
            raise DataError(msg) from exc
        ids = encoded.get("input_ids") if isinstance(encoded, Mapping) else None
        if not isinstance(ids, list) or not ids:
            msg = f"{unit} {conversation.line}: the chat template rendered no prompt tokens"
            raise DataError(msg)
        prompts.append(([int(i) for i in ids], conversation.tag))
    return prompts


def load_prompts(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    limit: int | None = None,
    enable_thinking: bool | None = None,
    column: str | None = None,
) -> list[list[int]]:
    """The first ``limit`` prompts of a prompt file; DataError when there are none.

    The format follows the suffix (:mod:`~dflash_recipes.executor.evaluation.prompt_files`):
    chat JSONL, whose unusable lines are skipped (and logged with the file's summary) as for
    training data; a JSON list; a Parquet ``column``.
    """
    tagged = load_tagged_prompts(
        path,
        tokenizer,
        chat_template=chat_template,
        limit=limit,
        enable_thinking=enable_thinking,
        column=column,
    )
    return [ids for ids, _ in tagged]


def load_tagged_prompts(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    chat_template: str | None = None,
    limit: int | None = None,
    enable_thinking: bool | None = None,
    column: str | None = None,
) -> list[tuple[list[int], str | None]]:
    """:func:`load_prompts` with each prompt's workload tag (a JSONL row's ``tag``)."""
    conversations = read_prompt_conversations(path, column=column)
    prompts = tagged_prompts(
        conversations,
        tokenizer,
        chat_template=chat_template,
        limit=limit,
        enable_thinking=enable_thinking,
        unit=UNITS[prompt_format(path)],
    )
    if not prompts:
        msg = f"{path} has no conversation with a turn before its first assistant turn"
        raise DataError(msg)
    return prompts


def read_prompt_conversations(path: Path, *, column: str | None = None) -> list[Conversation]:
    """Every conversation of a prompt file, in the format its suffix says."""
    kind = prompt_format(path)
    if kind == "json":
        return read_json_prompts(path)
    if kind == "parquet":
        return read_parquet_prompts(path, column)
    file = read_conversations(
        path, answer_only_loss=False, setting="--prompts (or data.eval_data_path)"
    )
    if file.skipped:
        logger.warning("%s: %s", path, file.summary)
    return list(file.conversations)


def eval_settings(
    *,
    spec: ResolvedDraft,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str | None,
    chat_template_path: str | None,
    prompt_file: Path | None,
    prompt_column: str | None,
    num_prompts: int,
    max_new_tokens: int,
    batch_size: int,
    enable_thinking: bool | None,
    eos_token_id: int | None,
    held_out_slice: str | None = None,
    sampling: Sampling | None = None,
) -> EvalSettings:
    """The :class:`EvalSettings` of a measurement (file hashes read here)."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    text = template if isinstance(template, str) else None
    kind = prompt_format(prompt_file) if prompt_file is not None else None
    return EvalSettings(
        block_size=spec.block_size,
        max_new_tokens=max_new_tokens,
        num_prompts=num_prompts,
        batch_size=batch_size,
        prompt_file=str(prompt_file) if prompt_file is not None else None,
        # a file's bytes, or a folder's files (as a capture records its input)
        prompt_file_sha256=input_sha256(prompt_file) if prompt_file is not None else None,
        prompt_format=kind,
        prompt_column=prompt_column if kind == "parquet" else None,
        chat_template_source=(
            f"data.chat_template {chat_template_path}" if chat_template_path else "tokenizer"
        ),
        chat_template_sha256=sha256_text(text) if text is not None else None,
        enable_thinking=enable_thinking,
        template_reads_enable_thinking=text is not None and "enable_thinking" in text,
        eos_token_id=eos_token_id,
        held_out_slice=held_out_slice,
        decoding=DECODING if sampling is None else "sampling",
        temperature=0.0 if sampling is None else sampling.temperature,
        draft_sampling=None if sampling is None else sampling.drafts,
        seed=None if sampling is None else sampling.seed,
        top_k=None if sampling is None else sampling.top_k,
        top_p=None if sampling is None else sampling.top_p,
    )


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
    held_out: Sequence[Conversation] = (),
) -> AcceptanceReport:
    """Measured acceptance on the first ``num_prompts`` held-out conversations (in training):
    those of ``data.eval_data_path``, or `held_out`, the ``data.eval_holdout`` slice of the
    training data (:mod:`~dflash_recipes.executor.data.holdout`).

    ``drafter`` is the drafter or the converted model, on the target's device; its train/eval
    mode is restored afterwards. DataError when the plan has no eval data.
    """
    data = plan.data
    if data.eval_holdout > 0 and data.data_path is not None:
        return _measure(
            plan,
            target,
            drafter,
            tokenizer,
            Path(data.data_path),
            max_new_tokens=max_new_tokens,
            num_prompts=num_prompts,
            prompts=_held_out_prompts(plan, tokenizer, held_out, num_prompts),
            held_out_slice=held_out_slice(plan),
        )
    if data.eval_data_path is None:
        msg = (
            "neither data.eval_data_path nor data.eval_holdout is set: there are no held-out "
            "conversations to measure on"
        )
        raise DataError(msg)
    return _measure(
        plan,
        target,
        drafter,
        tokenizer,
        Path(data.eval_data_path),
        max_new_tokens=max_new_tokens,
        num_prompts=num_prompts,
    )


def held_out_slice(plan: RunPlan) -> str:
    """How a report names the plan's data.eval_holdout slice (its size and seed)."""
    return f"{plan.data.eval_holdout} conversations, seed {plan.training.seed}"


def _held_out_prompts(
    plan: RunPlan,
    tokenizer: PreTrainedTokenizerBase,
    held_out: Sequence[Conversation],
    num_prompts: int,
    enable_thinking: bool | None = None,
) -> list[list[int]]:
    """The prompts of the first `num_prompts` held-out conversations of the training data."""
    prompts = prompts_from_conversations(
        held_out,
        tokenizer,
        chat_template=read_chat_template(plan.data.chat_template),
        limit=num_prompts,
        enable_thinking=enable_thinking,
    )
    if not prompts:
        msg = (
            f"none of the {len(held_out)} conversation(s) data.eval_holdout holds out of "
            f"{plan.data.data_path} has a turn before its first assistant turn, so there is no "
            "prompt to draft on; raise data.eval_holdout or set data.eval_data_path"
        )
        raise DataError(msg)
    return prompts


def _measure(
    plan: RunPlan,
    target: PreTrainedModel,
    drafter: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    source: Path,
    *,
    max_new_tokens: int,
    num_prompts: int,
    batch_size: int = 1,
    enable_thinking: bool | None = None,
    prompt_column: str | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    held_out_slice: str | None = None,
    sampling: Sampling | None = None,
    tags: Sequence[str | None] | None = None,
) -> AcceptanceReport:
    spec = plan.resolved_draft()
    chat_template = read_chat_template(plan.data.chat_template)
    if prompts is None:
        tagged = load_tagged_prompts(
            source,
            tokenizer,
            chat_template=chat_template,
            limit=num_prompts,
            enable_thinking=enable_thinking,
            column=prompt_column,
        )
        prompts, tags = [ids for ids, _ in tagged], [tag for _, tag in tagged]
    eos = tokenizer.eos_token_id
    eos_id = int(eos) if eos is not None else None
    settings = eval_settings(
        spec=spec,
        tokenizer=tokenizer,
        chat_template=chat_template,
        chat_template_path=plan.data.chat_template,
        prompt_file=source,
        prompt_column=prompt_column,
        num_prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        enable_thinking=enable_thinking,
        eos_token_id=eos_id,
        held_out_slice=held_out_slice,
        sampling=sampling,
    )
    return evaluate_acceptance(
        target,
        drafter,
        spec,
        prompts,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_id,
        batch_size=batch_size,
        settings=settings,
        sampling=sampling,
        tags=tags,
    )


def run_eval(
    plan: RunPlan,
    checkpoint_dir: Path,
    prompts_file: Path | None,
    *,
    max_new_tokens: int = 64,
    num_prompts: int = 8,
    batch_size: int = 1,
    enable_thinking: bool | None = None,
    prompt_column: str | None = None,
    sampling: Sampling | None = None,
) -> AcceptanceReport:
    """Measure a saved drafter's acceptance with the plan's target, taps, mask and block size.

    Weights come from ``checkpoint_dir`` (an export or a training checkpoint); prompts from
    ``prompts_file`` or else ``plan.data.eval_data_path`` (the first ``num_prompts``; chat
    JSONL, a JSON list or a Parquet ``prompt_column``), rendered with ``data.chat_template``
    or the base model's tokenizer's template (``enable_thinking`` passed to it when not None).
    Generation stops at the tokenizer's eos token; ``batch_size`` prompts run at a time. Runs
    on the CPU in the plan's dtype, greedy unless `sampling` says otherwise. The report's
    ``settings`` record what makes its tau comparable.
    """
    spec = plan.resolved_draft()
    source = prompts_file
    holdout = source is None and plan.data.eval_holdout > 0 and plan.data.data_path is not None
    if source is None and plan.data.eval_data_path is not None:
        source = Path(plan.data.eval_data_path)
    if holdout and plan.data.data_path is not None:
        source = Path(plan.data.data_path)
    if source is None:
        msg = (
            "no held-out prompts: pass --prompts FILE or set data.eval_data_path (JSONL "
            "conversations, like the training data) or data.eval_holdout in the recipe"
        )
        raise DataError(msg)
    drafter = DFlashDraftModel(spec)
    load_drafter_weights(drafter, checkpoint_dir)
    tokenizer = load_tokenizer(plan)  # the one training used (model.trust_remote_code included)
    if holdout:
        # the conversations training held out (data.eval_holdout), from the tokenized cache
        prompts = _held_out_prompts(
            plan,
            tokenizer,
            plan_held_out_conversations(plan, tokenizer),
            num_prompts,
            enable_thinking,
        )
        tags = None
    else:
        tagged = load_tagged_prompts(
            source,
            tokenizer,
            chat_template=read_chat_template(plan.data.chat_template),
            limit=num_prompts,
            enable_thinking=enable_thinking,
            column=prompt_column,
        )
        prompts, tags = [ids for ids, _ in tagged], [tag for _, tag in tagged]
    target = load_base_model(plan)
    drafter.to(dtype=torch_dtype(plan.base_model.dtype))
    return _measure(
        plan,
        target,
        drafter,
        tokenizer,
        source,
        max_new_tokens=max_new_tokens,
        num_prompts=num_prompts,
        batch_size=batch_size,
        enable_thinking=enable_thinking,
        prompt_column=prompt_column,
        prompts=prompts,
        held_out_slice=held_out_slice(plan) if holdout else None,
        sampling=sampling,
        tags=tags,
    )


__all__ = [
    "AcceptanceReport",
    "acceptance_from_steps",
    "eval_settings",
    "evaluate_acceptance",
    "evaluate_on_plan_data",
    "load_drafter_weights",
    "load_prompts",
    "load_tagged_prompts",
    "prompt_messages",
    "prompts_from_conversations",
    "read_prompt_conversations",
    "run_eval",
    "tagged_prompts",
]
