"""The local backend of `regenerate`: transformers generation with the plan's base model.

For small targets, the demo and the tests: conversations go in batches of ``max_concurrency``,
and turn k of every conversation of a batch is generated in one left-padded ``generate`` call
(greedy when ``temperature`` is 0, seeded sampling otherwise). A conversation that cannot be
answered (a prompt too long for the target, a chat-template error) fails alone; the batch goes
on. The row's ``tools`` and the job's thinking switch (``enable_thinking``) go to the chat
template; the answers are text (no tool-call parser runs here, so a tool conversation ends at
the first turn the row answers with tool results). What to answer and where answers go is
:mod:`dflash_recipes.executor.regenerate.job`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dflash_recipes.data.conversations import template_messages, tool_schemas
from dflash_recipes.executor.regenerate.types import (
    Answer,
    Job,
    Outcome,
    apply_reasoning,
    finished_outcome,
)
from dflash_recipes.plan.run_plan import RegeneratePlan, RunPlan


def regenerate_locally(
    plan: RunPlan,
    settings: RegeneratePlan,
    todo: Sequence[Job],
    done: Callable[[Outcome], None],
) -> None:
    """Answer `todo` with transformers `generate` on the plan's base model, batched.

    Conversations go in batches of ``max_concurrency``; within a batch, turn k of every
    conversation is generated in one left-padded call. Greedy when temperature is 0.
    """
    import torch

    from dflash_recipes.executor.data.tokenize import read_chat_template
    from dflash_recipes.executor.model.convert import load_base_model, load_tokenizer

    tokenizer = load_tokenizer(plan)
    template = read_chat_template(plan.data.chat_template)
    model = load_base_model(plan)
    limit = plan.base_model.facts.max_position_embeddings if plan.base_model.facts else None
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(plan.training.seed)  # sampling (temperature > 0) is reproducible

    def generate(histories: list[tuple[Job, list[Answer]]]) -> list[Answer | str]:
        """One answer per (job, answers so far), or why that one could not be generated."""
        results: list[Answer | str] = ["" for _ in histories]
        texts: dict[int, str] = {}
        for i, (job, so_far) in enumerate(histories):
            switch: dict[str, Any] = {}  # the template's keyword arguments
            if job.thinking is not None:
                switch["enable_thinking"] = job.thinking
            try:
                text = str(
                    tokenizer.apply_chat_template(
                        template_messages(finished_outcome(job, so_far).messages),  # type: ignore[arg-type]
                        tools=tool_schemas(job.tools),  # type: ignore[arg-type]
                        chat_template=template,
                        tokenize=False,
                        add_generation_prompt=True,
                        **switch,
                    )
                )
            except Exception as exc:  # jinja raises many kinds, templates raise their own
                results[i] = f"chat template error: {exc}"
                continue
            length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if limit is not None and length >= limit:
                results[i] = (
                    f"prompt too long: {length} tokens leave no room under the target's "
                    f"max_position_embeddings={limit}"
                )
                continue
            texts[i] = text
        if not texts:
            return results
        batch = tokenizer(
            list(texts.values()), add_special_tokens=False, padding=True, return_tensors="pt"
        )
        width = int(batch["input_ids"].shape[1])
        budget = (
            settings.max_new_tokens
            if limit is None
            else min(settings.max_new_tokens, limit - width)
        )
        sampling = settings.temperature > 0
        with torch.no_grad():
            out = model.generate(  # type: ignore[operator]
                **batch,
                max_new_tokens=budget,
                do_sample=sampling,
                temperature=settings.temperature if sampling else None,
                top_p=settings.top_p if sampling else None,
                top_k=None,
                pad_token_id=pad,
                eos_token_id=eos,
            )
        for i, row in zip(texts, out[:, width:].tolist(), strict=True):
            ids = [int(t) for t in row]
            stopped = eos is not None and eos in ids
            ids = ids[: ids.index(eos)] if stopped else ids
            text = str(tokenizer.decode(ids, skip_special_tokens=True))
            content = apply_reasoning(text, None, settings.reasoning)
            results[i] = Answer(content, len(ids) + int(stopped), not stopped)
        return results

    size = settings.max_concurrency
    for start in range(0, len(todo), size):
        group = list(todo[start : start + size])
        answers: list[list[Answer]] = [[] for _ in group]
        failures: dict[int, str] = {}
        while True:
            waiting = [
                i
                for i, job in enumerate(group)
                if i not in failures and _turns_left(job, answers[i])
            ]
            if not waiting:
                break
            generated = generate([(group[i], answers[i]) for i in waiting])
            for i, answer in zip(waiting, generated, strict=True):
                if isinstance(answer, str):
                    failures[i] = answer
                    continue
                answers[i].append(answer)
        for i, job in enumerate(group):
            if i in failures:
                done(Outcome(job=job, failure=failures[i]))
            else:
                done(finished_outcome(job, answers[i]))


def _turns_left(job: Job, answers: list[Answer]) -> bool:
    """Whether `job` has an assistant turn still to answer after `answers` (none once the
    conversation has ended early, see finished_outcome)."""
    turns = sum(1 for m in job.messages if m.role == "assistant")
    return len(answers) < turns and not finished_outcome(job, answers).diverged


__all__ = ["regenerate_locally"]
