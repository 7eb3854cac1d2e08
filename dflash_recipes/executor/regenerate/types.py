"""The units of work of `regenerate` that the job and both backends share: jobs, answers,
outcomes.

Tool conversations: the target answers every assistant turn given the conversation so far, its
own earlier answers (their tool calls and reasoning included) and the original tool results. A
tool result answers the call at its position in the target's turn before it (its
``tool_call_id`` becomes the target's call id). When the target's turn makes another number of
calls than the tool results that follow it in the row, those results answer nothing the target
asked: the conversation ends with that answer (counted as ``diverged``).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Sequence

import attrs

from dflash_recipes.data.conversations import Conversation, Message, SkippedLine, ToolCall
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
    #: The row's tool schemas (JSON text), sent with every request; None: none.
    tools: str | None = None
    #: The thinking switch sent (chat_template_kwargs.enable_thinking); None: none is sent.
    thinking: bool | None = None
    #: The row's workload tag, kept in the output.
    tag: str | None = None


#: The thinking switches each regenerate.thinking mode sends, one job per entry.
THINKING_SWITCHES: dict[str, tuple[bool | None, ...]] = {
    "template": (None,),
    "on": (True,),
    "off": (False,),
    "both": (True, False),
}


def build_jobs(
    conversations: Iterable[Conversation], *, first_turn_only: bool, thinking: str = "template"
) -> tuple[list[Job], list[SkippedLine]]:
    """Jobs for the conversations read, and those that cannot be regenerated.
    `thinking` (regenerate.thinking) "both" makes two jobs of each conversation."""
    jobs: list[Job] = []
    skipped: list[SkippedLine] = []
    seen: collections.Counter[str] = collections.Counter()
    for conversation in conversations:
        line, given = conversation.line, conversation.messages
        tools, tag = conversation.tools, conversation.tag
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
        for switch in THINKING_SWITCHES[thinking]:
            digest = prompt_key(turns, tools=tools, thinking=switch)
            occurrence = seen[digest]
            seen[digest] += 1
            key = digest if occurrence == 0 else f"{digest}-{occurrence}"
            jobs.append(Job(key, line, tuple(messages), tools, switch, tag))
    return jobs, skipped


@attrs.frozen(repr=False, eq=False, slots=False)
class Answer(Record):
    """One generated assistant turn."""

    content: str
    #: Tokens generated (as the server reports them, or counted locally).
    tokens: int
    #: Generation stopped at max_new_tokens (finish_reason "length").
    truncated: bool
    #: The tool calls the target made, as it returned them.
    tool_calls: tuple[ToolCall, ...] = ()
    #: The target's reasoning as a field of its own (regenerate.reasoning: separate).
    reasoning: str | None = None

    def message(self) -> Message:
        """The assistant turn this answer is."""
        return Message("assistant", self.content, self.tool_calls, self.reasoning)


def apply_reasoning(content: str, reasoning: str | None, policy: str) -> str:
    """The answer text under the reasoning policy.

    keep: a separate `reasoning_content` is put back in front of the answer as a
    ``<think>\\n...\\n</think>\\n\\n`` block, the form Qwen3 chat templates parse (and strip
    from earlier turns themselves). separate: the text is left as it is (the reasoning stays in
    its own field, see :func:`kept_reasoning`). drop: every ``<think>...</think>`` block, any
    text before a lone ``</think>`` and an unclosed ``<think>`` to the end are removed.
    """
    if policy == "separate":
        return content
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


def kept_reasoning(reasoning: str | None, policy: str) -> str | None:
    """The reasoning kept as a field of its own: the server's under "separate", else None."""
    return reasoning if policy == "separate" and reasoning else None


@attrs.frozen(repr=False, eq=False, slots=False)
class Outcome(Record):
    """A finished conversation: its messages, or why it failed."""

    job: Job
    messages: tuple[Message, ...] = ()
    failure: str | None = None
    tokens: int = 0
    truncated: int = 0
    empty: int = 0
    #: 1 when the conversation ended early: the target's calls did not match the tool results.
    diverged: int = 0


class TurnFailed(Exception):
    """A turn could not be answered after its retries (the conversation is recorded failed)."""


def calls_match(answer: Answer, messages: Sequence[Message], after: int) -> bool:
    """Whether the tool results right after position `after` of `messages` answer the calls of
    `answer` one for one (true when no tool result follows)."""
    results = 0
    for message in messages[after + 1 :]:
        if message.role != "tool":
            break
        results += 1
    return results == 0 or results == len(answer.tool_calls)


def finished_outcome(job: Job, answers: Sequence[Answer]) -> Outcome:
    """The Outcome of `job` whose assistant turns got `answers`, in order: each tool result
    takes the id of the target's call it answers; the conversation ends at an answer whose
    calls the following tool results do not match (module docstring)."""
    messages: list[Message] = []
    index = 0
    calls: tuple[ToolCall, ...] = ()
    result = 0
    diverged = 0
    for position, message in enumerate(job.messages):
        if message.role == "assistant":
            if index >= len(answers):
                break
            answer = answers[index]
            messages.append(answer.message())
            index += 1
            calls, result = answer.tool_calls, 0
            if not calls_match(answer, job.messages, position):
                diverged = 1
                break
        elif message.role == "tool":
            call_id = calls[result].id if result < len(calls) else None
            messages.append(attrs.evolve(message, tool_call_id=call_id or message.tool_call_id))
            result += 1
        else:
            messages.append(message)
    used = answers[:index]
    return Outcome(
        job=job,
        messages=tuple(messages),
        tokens=sum(a.tokens for a in used),
        truncated=sum(a.truncated for a in used),
        empty=sum(not a.content.strip() and not a.tool_calls for a in used),
        diverged=diverged,
    )
