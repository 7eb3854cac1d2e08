"""Tokenizing a conversation: render with the chat template, tokenize, mask, truncate.

Loss masks: with ``answer_only_loss`` only the tokens the assistant produces are supervised.
When the chat template marks them with ``{% generation %}`` the tokenizer's own assistant mask
is used. Otherwise each assistant turn ``i`` is located by rendering the conversation up to turn
``i`` with the generation prompt and up to and including turn ``i``: the characters between the
two (the answer and the template's end-of-turn text, trailing whitespace excluded) are the
turn's span. Templates that render a turn differently once later turns follow (Qwen3 drops the
empty think block of earlier turns) fail that check for the turn; it is then located by its
content in the full rendering, plus the special token that closes it. Tokens overlapping a span
are supervised.

Parts (tool calls, tool results, reasoning, `tools`): the messages reach the template as Hugging
Face templates read them (:func:`~dflash_recipes.data.conversations.template_messages`) and the
row's schemas as its `tools` argument, so the target's own tool and reasoning syntax renders them.
``supervise`` names the parts of an assistant turn that keep their loss: ``answer`` (the text and
the turn's end), ``tool_calls`` and ``reasoning``. A part switched off is located by rendering the
whole conversation again without it: the characters the two renderings do not share (what the
template writes for that part, its own tags included) lose their supervision. Tool results,
system and user turns are never assistant turns, so never supervised. A row whose tools or tool
calls the template leaves out (the rendering is the same without them) cannot be trained as
written: :class:`UnrenderablePart` (a DataError) names the part.

No torch here (numpy for the block rule): the parallel tokenizing workers import this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_recipes.data.conversations import (
    Message,
    SkippedLine,
    template_messages,
    tool_schemas,
)
from dflash_recipes.errors import DataError
from dflash_recipes.recipe.choices import SUPERVISED_PARTS
from dflash_recipes.records import Record

#: The `tools` argument of a render: the row's schemas or None.
Tools = list[dict[str, object]] | None
#: A message as a template reads it.
MessageDict = dict[str, object]

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: A generous bound on the characters of one token (tokenizers' longest pieces are runs of
#: whitespace or punctuation well below this): content beyond max_len * this is never tokenized.
MAX_CHARS_PER_TOKEN = 64


class UnrenderablePart(DataError):
    """The chat template cannot render a part of the row (or renders the row without it)."""


@attrs.frozen(repr=False, eq=False, slots=False)
class TokenizedExample(Record):
    """Token ids of one rendered conversation and its 0/1 loss mask (same length)."""

    input_ids: list[int]
    loss_mask: list[int]
    #: True when the rendering was longer than max_len and cut.
    truncated: bool = False


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    chat_template: str | None,
    answer_only_loss: bool,
    max_len: int,
    tools: str | None = None,
    supervise: Sequence[str] = SUPERVISED_PARTS,
) -> TokenizedExample:
    """Render `messages` with the chat template, tokenize, mask and truncate to `max_len`.

    `chat_template` is template text (a data.chat_template file's content) or None for the
    tokenizer's own; `tools` the row's schemas as JSON text. Without `answer_only_loss` every
    token is supervised, else the assistant parts `supervise` names (module docstring). Raises
    DataError when the template cannot render the conversation or an assistant turn cannot be
    located, UnrenderablePart when it leaves out the row's tools or tool calls.
    """
    ids, mask, truncated = tokenize_to_arrays(
        tokenizer,
        messages,
        chat_template=chat_template,
        answer_only_loss=answer_only_loss,
        max_len=max_len,
        tools=tools,
        supervise=supervise,
    )
    return TokenizedExample(ids.tolist(), mask.tolist(), truncated)


def tokenize_to_arrays(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    chat_template: str | None,
    answer_only_loss: bool,
    max_len: int,
    tools: str | None = None,
    supervise: Sequence[str] = SUPERVISED_PARTS,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """:func:`tokenize_conversation` as (int64 ids, uint8 mask, truncated) arrays: the cache's
    builder takes these (no Python list per token)."""
    if max_len < 1:
        msg = f"max_len must be >= 1, got {max_len}"
        raise ValueError(msg)
    template = resolve_template(tokenizer, chat_template)
    messages, cut = _bounded_messages(messages, max_len)
    dicts = template_messages(messages)
    schemas = tool_schemas(tools)
    _check_parts_rendered(tokenizer, messages, dicts, schemas, template)
    if not answer_only_loss:
        ids = _array(_render_tokens(tokenizer, dicts, template, schemas), "input_ids")
        mask = np.ones(len(ids), dtype=np.uint8)
    elif _GENERATION_MARKER.search(template):
        encoded = _render_tokens(
            tokenizer, dicts, template, schemas, return_assistant_tokens_mask=True
        )
        ids = _array(encoded, "input_ids")
        mask = (_array(encoded, "assistant_masks") != 0).astype(np.uint8)
    else:
        id_list, mask_list = _mask_by_rendering(tokenizer, messages, template, schemas)
        ids = np.asarray(id_list, dtype=np.int64)
        mask = np.asarray(mask_list, dtype=np.uint8)
    if answer_only_loss:
        regions = _switched_off_regions(tokenizer, messages, dicts, schemas, template, supervise)
        if regions:
            _unmask(tokenizer, dicts, schemas, template, ids, mask, regions)
    truncated = cut or len(ids) > max_len
    return ids[:max_len], mask[:max_len], truncated


#: What each switchable part of an assistant turn is called in messages (for error texts).
_PART_FIELDS = {"answer": "content", "tool_calls": "tool_calls", "reasoning": "reasoning_content"}


def _without(message: Message, part: str) -> Message:
    """`message` with one part taken out (answer: empty text)."""
    if part == "answer":
        return attrs.evolve(message, content="")
    if part == "tool_calls":
        return attrs.evolve(message, tool_calls=())
    return attrs.evolve(message, reasoning=None)


def _has(message: Message, part: str) -> bool:
    if part == "answer":
        return bool(message.content)
    if part == "tool_calls":
        return bool(message.tool_calls)
    return bool(message.reasoning)


def _differing_region(
    full: str, reduced: str, boundaries: frozenset[int] = frozenset()
) -> tuple[int, int] | None:
    """The characters of `full` that `reduced` lacks: the span between their longest common
    prefix and longest common suffix (None when the two are the same).

    The span can often be placed more than one way: when its last characters repeat the ones
    before it (the ``\\n`` before ``<think>`` and after ``</think>``, the ``<`` of ``<think>``
    and of a following ``<tool_call>``) it slides back over them. The placement taken is the
    earliest whose both ends are token `boundaries` (offsets where a token of `full` starts)
    and which does not start with whitespace; failing that, the earliest with token ends;
    failing that, the earliest. (Wrong only when a turn's text ends with the last character
    of the part after it, such as a ``>`` before a tool call's closing tag, and the tokenizer
    splits both places alike.)
    """
    if full == reduced:
        return None
    limit = min(len(full), len(reduced))
    start = 0
    while start < limit and full[start] == reduced[start]:
        start += 1
    tail = 0
    while tail < limit - start and full[-1 - tail] == reduced[-1 - tail]:
        tail += 1
    end = len(full) - tail
    if end <= start:
        return None
    placements = [(start, end)]
    while start > 0 and full[start - 1] == full[end - 1]:
        start, end = start - 1, end - 1
        placements.append((start, end))
    ends = boundaries | {len(full)}

    def aligned(span: tuple[int, int]) -> bool:
        return span[0] in boundaries and span[1] in ends

    placements.reverse()
    return next(
        (p for p in placements if aligned(p) and not full[p[0]].isspace()),
        next((p for p in placements if aligned(p)), placements[0]),
    )


def _check_parts_rendered(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    dicts: list[MessageDict],
    schemas: Tools,
    template: str,
) -> None:
    """UnrenderablePart when the template renders the row the same without its `tools` or
    without an assistant turn's tool calls (it drops them: the row would train on less than
    it says)."""
    if not schemas and not any(m.tool_calls for m in messages):
        return
    full = _render_text(tokenizer, dicts, template, schemas)
    if schemas and _render_text(tokenizer, dicts, template, None) == full:
        msg = (
            "the chat template renders the row's 'tools' the same as no tools (it has no tool "
            "support); set data.chat_template to a template that renders tools, or "
            "data.unrenderable_rows: skip to leave such rows out"
        )
        raise UnrenderablePart(msg)
    for index, message in enumerate(messages):
        if not message.tool_calls:
            continue
        reduced = [*dicts[:index], *template_messages([_without(message, "tool_calls")])]
        reduced += dicts[index + 1 :]
        if _render_text(tokenizer, reduced, template, schemas) == full:
            msg = (
                f"the chat template leaves out messages[{index}].tool_calls (the rendering is "
                "the same without them); set data.chat_template to a template that renders "
                "tool calls, or data.unrenderable_rows: skip to leave such rows out"
            )
            raise UnrenderablePart(msg)


#: A character span of the rendering to leave out of the loss, and whether the supervised
#: tokens right after it (the turn's end) go with it: the turn has nothing left to supervise.
_Region = tuple[int, int, bool]


def _switched_off_regions(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    dicts: list[MessageDict],
    schemas: Tools,
    template: str,
    supervise: Sequence[str],
) -> list[_Region]:
    """Character spans of the full rendering that belong to assistant parts `supervise` leaves
    out (module docstring). A turn whose every part is left out loses its end too."""
    off = [part for part in SUPERVISED_PARTS if part not in supervise]
    if not off:
        return []
    full: str | None = None
    regions: list[_Region] = []
    for index, message in enumerate(messages):
        present = [p for p in SUPERVISED_PARTS if _has(message, p)]
        if message.role != "assistant" or not any(p in off for p in present):
            continue
        if full is None:
            full = _render_text(tokenizer, dicts, template, schemas)
            boundaries = _token_starts(tokenizer, full)
        found = []
        for part in (p for p in present if p in off):
            reduced = [*dicts[:index], *template_messages([_without(message, part)])]
            reduced += dicts[index + 1 :]
            try:
                text = _render_text(tokenizer, reduced, template, schemas)
            except DataError as exc:
                msg = (
                    f"cannot leave messages[{index}].{_PART_FIELDS[part]} out of the loss "
                    f"(data.supervise): the template cannot render the turn without it: {exc}"
                )
                raise UnrenderablePart(msg) from exc
            region = _differing_region(full, text, boundaries)
            if region is not None:
                found.append(region)
        if found and all(p in off for p in present):
            regions.append((min(r[0] for r in found), max(r[1] for r in found), True))
        else:
            regions.extend((start, end, False) for start, end in found)
    return regions


def _token_starts(tokenizer: PreTrainedTokenizerBase, text: str) -> frozenset[int]:
    """The offsets of `text` where one of its tokens starts."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if not isinstance(encoded, Mapping) or "offset_mapping" not in encoded:
        return frozenset()
    return frozenset(int(start) for start, _ in encoded["offset_mapping"])


def _unmask(
    tokenizer: PreTrainedTokenizerBase,
    dicts: list[MessageDict],
    schemas: Tools,
    template: str,
    ids: np.ndarray,
    mask: np.ndarray,
    regions: Sequence[_Region],
) -> None:
    """Clear the loss of every token of `ids` (the full rendering's) overlapping `regions`,
    and of the supervised run right after a region that takes the turn's end with it."""
    full = _render_text(tokenizer, dicts, template, schemas)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    if not isinstance(encoded, Mapping) or "offset_mapping" not in encoded:
        msg = "the tokenizer returned no offsets; a fast (Rust) tokenizer is needed"
        raise DataError(msg)
    if _token_ids(encoded) != ids.tolist():
        msg = (
            "the chat template's tokens differ from the tokens of its rendered text, so parts "
            "cannot be left out of the loss; keep every part in data.supervise"
        )
        raise DataError(msg)
    offsets = [(int(a), int(b)) for a, b in encoded["offset_mapping"]]
    for start, end, whole_turn in regions:
        position = 0
        while position < len(offsets) and offsets[position][0] < end:
            if offsets[position][1] > start:
                mask[position] = 0
            position += 1
        while whole_turn and position < len(offsets) and mask[position]:
            mask[position] = 0
            position += 1


def _array(encoded: object, name: str) -> np.ndarray:
    if not isinstance(encoded, Mapping) or name not in encoded:
        msg = f"the tokenizer returned no {name!r}"
        raise DataError(msg)
    values = encoded[name]
    if hasattr(values, "tolist"):  # a tensor or an array, when a tokenizer returns one
        values = values.tolist()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _bounded_messages(messages: Sequence[Message], max_len: int) -> tuple[Sequence[Message], bool]:
    """The turns that can matter for `max_len` tokens, cut to a character budget.

    No token is longer than MAX_CHARS_PER_TOKEN characters, so the first `max_len` tokens
    come from at most `max_len * MAX_CHARS_PER_TOKEN` characters of text (content, reasoning,
    tool-call arguments): a 50 MB line is cut before the template renders it or the tokenizer
    sees it. The turn cut keeps the start of its reasoning and text and loses its tool calls
    (half a JSON object cannot be rendered). True when anything was cut.
    """
    budget = max_len * MAX_CHARS_PER_TOKEN
    if sum(_text_size(m) for m in messages) <= budget:
        return messages, False
    kept: list[Message] = []
    for message in messages:
        if budget <= 0:
            break
        if _text_size(message) > budget:
            reasoning = message.reasoning[:budget] if message.reasoning is not None else None
            left = budget - len(reasoning or "")
            kept.append(
                attrs.evolve(
                    message,
                    content=message.content[: max(left, 0)],
                    reasoning=reasoning,
                    tool_calls=(),
                )
            )
            break
        kept.append(message)
        budget -= _text_size(message)
    return kept, True


def _text_size(message: Message) -> int:
    size = len(message.content) + len(message.reasoning or "")
    return size + sum(len(c.name) + len(c.arguments) for c in message.tool_calls)


def resolve_template(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
    """The template text to use: `chat_template`, else the tokenizer's (default) template."""
    if chat_template is not None:
        return chat_template
    try:
        return tokenizer.get_chat_template()
    except ValueError as exc:
        why = "none" if tokenizer.chat_template is None else str(exc)
        msg = (
            f"the tokenizer has no usable chat template ({why}); set data.chat_template to a "
            ".jinja file that renders the conversations"
        )
        raise DataError(msg) from exc


def _apply_template(render: Callable[[], object]) -> object:
    """The result of `render` (an ``apply_chat_template`` call); what it raises is a DataError."""
    try:
        return render()
    except Exception as exc:  # jinja raises many kinds, templates raise their own
        msg = f"the chat template could not render the conversation: {exc}"
        raise DataError(msg) from exc


def _render_text(
    tokenizer: PreTrainedTokenizerBase,
    dicts: list[MessageDict],
    template: str,
    schemas: Tools = None,
    *,
    add_generation_prompt: bool = False,
) -> str:
    text = _apply_template(
        lambda: tokenizer.apply_chat_template(
            dicts,  # type: ignore[arg-type]
            tools=schemas,  # type: ignore[arg-type]
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    )
    if not isinstance(text, str):
        msg = f"the chat template rendered {type(text).__name__}, expected text"
        raise DataError(msg)
    return text


def _render_tokens(
    tokenizer: PreTrainedTokenizerBase,
    dicts: list[MessageDict],
    template: str,
    schemas: Tools = None,
    *,
    return_assistant_tokens_mask: bool = False,
) -> object:
    return _apply_template(
        lambda: tokenizer.apply_chat_template(
            dicts,  # type: ignore[arg-type]
            tools=schemas,  # type: ignore[arg-type]
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=return_assistant_tokens_mask,
        )
    )


def _field(encoded: object, name: str) -> list[int]:
    if not isinstance(encoded, Mapping) or name not in encoded:
        msg = f"the tokenizer returned no {name!r}"
        raise DataError(msg)
    values = encoded[name]
    if hasattr(values, "tolist"):  # a tensor or an array, when a tokenizer returns one
        values = values.tolist()
    return [int(v) for v in values]


def _token_ids(encoded: object) -> list[int]:
    return _field(encoded, "input_ids")


def _mask_by_rendering(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    template: str,
    schemas: Tools = None,
) -> tuple[list[int], list[int]]:
    """Assistant mask for templates without generation markers (module docstring)."""
    dicts = template_messages(messages)
    full = _render_text(tokenizer, dicts, template, schemas)
    # (start, end, close_with_special_token): character spans of the assistant turns.
    spans: list[tuple[int, int, bool]] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message.role != "assistant":
            continue
        before = _try_render(
            tokenizer, dicts[:index], template, schemas, add_generation_prompt=True
        )
        if before is not None and (len(before) < cursor or not full.startswith(before)):
            before = None
        through = _try_render(tokenizer, dicts[: index + 1], template, schemas)
        if before is not None and through is not None:
            through = through.rstrip()
            if through.startswith(before) and full.startswith(through):
                spans.append((len(before), len(through), False))
                cursor = len(through)
                continue
        if not message.content:
            emptied = _emptied_region(tokenizer, messages, dicts, index, template, schemas, full)
            if emptied is not None:  # tool calls or reasoning without text
                spans.append((emptied[0], emptied[1], True))
                cursor = emptied[1]
            continue  # otherwise nothing to find; an empty answer supervises nothing
        # The answer is searched only after everything that precedes its turn, so a user
        # message quoting it cannot be mistaken for it.
        start = full.find(message.content, len(before) if before is not None else cursor)
        if start < 0:
            msg = (
                f"could not locate assistant turn {index + 1} in the rendered chat template; "
                "add {% generation %} ... {% endgeneration %} around the assistant output in "
                "the template (data.chat_template) so answer tokens can be masked exactly"
            )
            raise DataError(msg)
        spans.append((start, start + len(message.content), True))
        cursor = start + len(message.content)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = _token_ids(encoded)
    if not isinstance(encoded, Mapping) or "offset_mapping" not in encoded:
        msg = "the tokenizer returned no offsets; a fast (Rust) tokenizer is needed"
        raise DataError(msg)
    offsets = [(int(s), int(e)) for s, e in encoded["offset_mapping"]]
    special = set(tokenizer.all_special_ids)
    mask = [0] * len(ids)
    for start, end, close in spans:
        last = -1
        for position, (tok_start, tok_end) in enumerate(offsets):
            if tok_end > start and tok_start < end:
                mask[position] = 1
                last = position
        # A located answer is closed by the template's end-of-turn token, which the model
        # must learn to produce too.
        if close and last >= 0 and last + 1 < len(ids) and ids[last + 1] in special:
            mask[last + 1] = 1
    return ids, mask


def _emptied_region(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    dicts: list[MessageDict],
    index: int,
    template: str,
    schemas: Tools,
    full: str,
) -> tuple[int, int] | None:
    """Where the tool calls and reasoning of a turn without text are in `full`: what the
    rendering loses when the turn is emptied of them (None: nothing)."""
    message = messages[index]
    if not message.tool_calls and not message.reasoning:
        return None
    empty = attrs.evolve(message, tool_calls=(), reasoning=None)
    reduced = [*dicts[:index], *template_messages([empty]), *dicts[index + 1 :]]
    text = _try_render(tokenizer, reduced, template, schemas)
    return None if text is None else _differing_region(full, text)


def _try_render(
    tokenizer: PreTrainedTokenizerBase,
    dicts: list[MessageDict],
    template: str,
    schemas: Tools = None,
    *,
    add_generation_prompt: bool = False,
) -> str | None:
    if not dicts:
        return None
    try:
        return _render_text(
            tokenizer, dicts, template, schemas, add_generation_prompt=add_generation_prompt
        )
    except DataError:
        return None


@attrs.frozen(repr=False, eq=False, slots=False)
class DatasetStats(Record):
    """What went into a dataset, for the run's log and summary."""

    conversations_used: int
    skipped: tuple[SkippedLine, ...]
    num_tokens: int
    num_supervised_tokens: int
    num_truncated: int


def read_chat_template(chat_template: str | None) -> str | None:
    """The text of a `data.chat_template` file (None passes through); DataError if unreadable."""
    if chat_template is None:
        return None
    path = Path(chat_template)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        msg = f"cannot read data.chat_template {path}: {exc}"
        raise DataError(msg) from exc


def opens_a_block(loss_mask: Sequence[int] | np.ndarray, block_size: int) -> bool:
    """Whether some position may open a block: the eligibility rule of
    :func:`~dflash_recipes.executor.training.anchors.eligible_anchor_mask` for one unpadded
    example (``a + block_size <= len``, ``loss_mask[a] == loss_mask[a + 1] == 1``)."""
    last = len(loss_mask) - block_size  # the last anchor whose block fits
    if last < 0 or block_size < 2:
        return False
    mask = np.asarray(loss_mask, dtype=np.bool_)
    return bool(np.any(mask[: last + 1] & mask[1 : last + 2]))


__all__ = [
    "MAX_CHARS_PER_TOKEN",
    "DatasetStats",
    "TokenizedExample",
    "UnrenderablePart",
    "opens_a_block",
    "read_chat_template",
    "resolve_template",
    "tokenize_conversation",
    "tokenize_to_arrays",
]
