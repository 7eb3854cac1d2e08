"""The units of work of `regenerate` that the job and both backends share: jobs, answers,
outcomes."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Sequence

import attrs

from dflash_recipes.data.conversations import Message, SkippedLine
from dflash_recipes.files.regenerate_output import prompt_key
from dflash_recipes.records import Record

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


@attrs.frozen(repr=False, eq=False, slots=False)
class Job(Record):
    """One conversation to regenerate: its resume key, input line and prompt turns.

    `messages` ends with an assistant turn; the content of every assistant turn is replaced.
    """

    key: str
    line: int
    messages: tuple[Message, ...]


def build_jobs(
    conversations: Iterable[tuple[int, Sequence[Message]]], *, first_turn_only: bool
) -> tuple[list[Job], list[SkippedLine]]:
    """Jobs for (line, messages) pairs, and the conversations that cannot be regenerated."""
    jobs: list[Job] = []
    skipped: list[SkippedLine] = []
    seen: collections.Counter[str] = collections.Counter()
    for line, given in conversations:
        messages = list(given)
        assistant_at = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if first_turn_only and assistant_at:
            messages = messages[: assistant_at[0] + 1]
        first_user = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if first_user is None:
            reason = "no user turn: there is nothing for the target to answer"
            skipped.append(SkippedLine(line, "no user turn", reason))
            continue
        if assistant_at and assistant_at[0] < first_user:
            reason = (
                f"messages[{assistant_at[0]}] is an assistant turn before any user turn; the "
                "target only answers user turns"
            )
            skipped.append(SkippedLine(line, "assistant before user", reason))
            continue
        if messages[-1].role != "assistant":
            messages.append(Message("assistant", ""))
        turns = [(m.role, None if m.role == "assistant" else m.content) for m in messages]
        digest = prompt_key(turns)
        occurrence = seen[digest]
        seen[digest] += 1
        key = digest if occurrence == 0 else f"{digest}-{occurrence}"
        jobs.append(Job(key, line, tuple(messages)))
    return jobs, skipped


@attrs.frozen(repr=False, eq=False, slots=False)
class Answer(Record):
    """One generated assistant turn."""

    content: str
    #: Tokens generated (as the server reports them, or counted locally).
    tokens: int
    #: Generation stopped at max_new_tokens (finish_reason "length").
    truncated: bool


def apply_reasoning(content: str, reasoning: str | None, policy: str) -> str:
    """The answer text under the reasoning policy.

    keep: a separate `reasoning_content` is put back in front of the answer as a
    ``<think>\\n...\\n</think>\\n\\n`` block, the form Qwen3 chat templates parse (and strip
    from earlier turns themselves). drop: every ``<think>...</think>`` block, any text before a
    lone ``</think>`` and an unclosed ``<think>`` to the end are removed.
    """
    if policy == "keep":
        if reasoning and reasoning.strip() and "<think>" not in content:
            return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
        return content
    text = _THINK_BLOCK.sub("", content)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text.strip()


@attrs.frozen(repr=False, eq=False, slots=False)
class Outcome(Record):
    """A finished conversation: its messages, or why it failed."""

    job: Job
    messages: tuple[Message, ...] = ()
    failure: str | None = None
    tokens: int = 0
    truncated: int = 0
    empty: int = 0


class TurnFailed(Exception):
    """A turn could not be answered after its retries (the conversation is recorded failed)."""


def finished_outcome(job: Job, answers: Sequence[Answer]) -> Outcome:
    """The Outcome of `job` whose assistant turns got `answers`, in order."""
    messages: list[Message] = []
    index = 0
    for message in job.messages:
        if message.role == "assistant":
            messages.append(Message("assistant", answers[index].content))
            index += 1
        else:
            messages.append(message)
    return Outcome(
        job=job,
        messages=tuple(messages),
        tokens=sum(a.tokens for a in answers),
        truncated=sum(a.truncated for a in answers),
        empty=sum(not a.content.strip() for a in answers),
    )
