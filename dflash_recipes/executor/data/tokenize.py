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

No torch here (numpy for the block rule): the parallel tokenizing workers import this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np
from transformers import PreTrainedTokenizerBase

from dflash_recipes.data.conversations import Message, SkippedLine
from dflash_recipes.errors import DataError
from dflash_recipes.records import Record

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: A generous bound on the characters of one token (tokenizers' longest pieces are runs of
#: whitespace or punctuation well below this): content beyond max_len * this is never tokenized.
MAX_CHARS_PER_TOKEN = 64


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
) -> TokenizedExample:
    """Render `messages` with the chat template, tokenize, mask and truncate to `max_len`.

    `chat_template` is template text (a data.chat_template file's content) or None for the
    tokenizer's own. Without `answer_only_loss` every token is supervised. Raises DataError
    when the template cannot render the conversation or an assistant turn cannot be located.
    """
    ids, mask, truncated = tokenize_to_arrays(
        tokenizer,
        messages,
        chat_template=chat_template,
        answer_only_loss=answer_only_loss,
        max_len=max_len,
    )
    return TokenizedExample(ids.tolist(), mask.tolist(), truncated)


def tokenize_to_arrays(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    chat_template: str | None,
    answer_only_loss: bool,
    max_len: int,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """:func:`tokenize_conversation` as (int64 ids, uint8 mask, truncated) arrays: the cache's
    builder takes these (no Python list per token)."""
    if max_len < 1:
        msg = f"max_len must be >= 1, got {max_len}"
        raise ValueError(msg)
    template = resolve_template(tokenizer, chat_template)
    messages, cut = _bounded_messages(messages, max_len)
    dicts = [{"role": m.role, "content": m.content} for m in messages]
    if not answer_only_loss:
        ids = _array(_render_tokens(tokenizer, dicts, template), "input_ids")
        mask = np.ones(len(ids), dtype=np.uint8)
    elif _GENERATION_MARKER.search(template):
        encoded = _render_tokens(tokenizer, dicts, template, return_assistant_tokens_mask=True)
        ids = _array(encoded, "input_ids")
        mask = (_array(encoded, "assistant_masks") != 0).astype(np.uint8)
    else:
        id_list, mask_list = _mask_by_rendering(tokenizer, messages, template)
        ids = np.asarray(id_list, dtype=np.int64)
        mask = np.asarray(mask_list, dtype=np.uint8)
    truncated = cut or len(ids) > max_len
    return ids[:max_len], mask[:max_len], truncated


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
    come from at most `max_len * MAX_CHARS_PER_TOKEN` characters of content: a 50 MB line is
    cut before the template renders it or the tokenizer sees it. True when anything was cut.
    """
    budget = max_len * MAX_CHARS_PER_TOKEN
    if sum(len(m.content) for m in messages) <= budget:
        return messages, False
    kept: list[Message] = []
    for message in messages:
        if budget <= 0:
            break
        if len(message.content) > budget:
            kept.append(Message(message.role, message.content[:budget]))
            break
        kept.append(message)
        budget -= len(message.content)
    return kept, True


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
    dicts: list[dict[str, str]],
    template: str,
    *,
    add_generation_prompt: bool = False,
) -> str:
    text = _apply_template(
        lambda: tokenizer.apply_chat_template(
            dicts,
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
    dicts: list[dict[str, str]],
    template: str,
    *,
    return_assistant_tokens_mask: bool = False,
) -> object:
    return _apply_template(
        lambda: tokenizer.apply_chat_template(
            dicts,
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
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], template: str
) -> tuple[list[int], list[int]]:
    """Assistant mask for templates without generation markers (module docstring)."""
    dicts = [{"role": m.role, "content": m.content} for m in messages]
    full = _render_text(tokenizer, dicts, template)
    # (start, end, close_with_special_token): character spans of the assistant turns.
    spans: list[tuple[int, int, bool]] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message.role != "assistant":
            continue
        before = _try_render(tokenizer, dicts[:index], template, add_generation_prompt=True)
        if before is not None and (len(before) < cursor or not full.startswith(before)):
            before = None
        through = _try_render(tokenizer, dicts[: index + 1], template)
        if before is not None and through is not None:
            through = through.rstrip()
            if through.startswith(before) and full.startswith(through):
                spans.append((len(before), len(through), False))
                cursor = len(through)
                continue
        if not message.content:
            continue  # nothing to find; an empty answer supervises nothing
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


def _try_render(
    tokenizer: PreTrainedTokenizerBase,
    dicts: list[dict[str, str]],
    template: str,
    *,
    add_generation_prompt: bool = False,
) -> str | None:
    if not dicts:
        return None
    try:
        return _render_text(tokenizer, dicts, template, add_generation_prompt=add_generation_prompt)
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
    "opens_a_block",
    "read_chat_template",
    "resolve_template",
    "tokenize_conversation",
    "tokenize_to_arrays",
]
