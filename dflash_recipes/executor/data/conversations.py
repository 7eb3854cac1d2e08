"""Training data: JSONL conversations -> tokenized, loss-masked examples -> padded batches.

Reading never raises for a bad line: each is kept as a :class:`SkippedLine` (1-based line
number, a short kind, the reason) and summarised; only a file with no usable conversation is a
:class:`~dflash_recipes.errors.DataError`, raised before any training state exists.

Loss masks: with ``answer_only_loss`` only the tokens the assistant produces are supervised.
When the chat template marks them with ``{% generation %}`` the tokenizer's own assistant mask
is used. Otherwise each assistant turn ``i`` is located by rendering the conversation up to turn
``i`` with the generation prompt and up to and including turn ``i``: the characters between the
two (the answer and the template's end-of-turn text, trailing whitespace excluded) are the
turn's span. Templates that render a turn differently once later turns follow (Qwen3 drops the
empty think block of earlier turns) fail that check for the turn; it is then located by its
content in the full rendering, plus the special token that closes it. Tokens overlapping a span
are supervised.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import attrs
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from dflash_recipes.errors import DataError
from dflash_recipes.executor.training.anchors import eligible_anchor_mask
from dflash_recipes.files.jsonio import JsonProblem, parse_json, regular_file_problem, shorten
from dflash_recipes.plan.run_plan import RunPlan
from dflash_recipes.records import Record

Role = Literal["system", "user", "assistant"]

_OPENAI_ROLES: dict[str, Role] = {"system": "system", "user": "user", "assistant": "assistant"}
_SHAREGPT_ROLES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: How many per-line reasons a DataError message quotes.
_REASONS_SHOWN = 5
#: How many line numbers a summary lists per kind before "...".
_LINES_SHOWN = 10
#: A generous bound on the characters of one token (tokenizers' longest pieces are runs of
#: whitespace or punctuation well below this): content beyond max_len * this is never tokenized.
MAX_CHARS_PER_TOKEN = 64
#: Integers in a data line are not used; any Python can convert (4300 digits) is accepted.
_DATA_INT_DIGITS = 4000


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class Message(Record):
    """One turn of a conversation, with the role normalised to system | user | assistant."""

    role: Role
    content: str


@attrs.frozen(repr=False, eq=False, slots=False)
class Conversation(Record):
    """A usable conversation and the 1-based line it came from."""

    line: int
    messages: tuple[Message, ...]


@attrs.frozen(repr=False, eq=False, slots=False)
class SkippedLine(Record):
    """A line (or conversation) that was not used: where, what kind of problem, and why."""

    line: int
    #: Short category used to group the summary, e.g. "invalid JSON", "bad role".
    kind: str
    #: The full explanation for this line.
    reason: str


@attrs.frozen(repr=False, eq=False, slots=False)
class ConversationFile(Record):
    """The usable conversations of a JSONL file and the lines that were skipped."""

    path: Path
    conversations: tuple[Conversation, ...]
    skipped: tuple[SkippedLine, ...]

    @property
    def summary(self) -> str:
        """'used N conversations, skipped M: 3 invalid JSON (lines 4, 9, 12), ...'."""
        return summarize(len(self.conversations), self.skipped)


def summarize(used: int, skipped: Sequence[SkippedLine]) -> str:
    """One line: how many conversations were used, how many skipped, grouped by kind."""
    text = f"used {used} conversation{'' if used == 1 else 's'}, skipped {len(skipped)}"
    if not skipped:
        return text
    groups: dict[str, list[int]] = {}
    for item in skipped:
        groups.setdefault(item.kind, []).append(item.line)
    parts = []
    for kind, lines in groups.items():
        shown = ", ".join(str(n) for n in lines[:_LINES_SHOWN])
        if len(lines) > _LINES_SHOWN:
            shown += f", ... ({len(lines) - _LINES_SHOWN} more)"
        parts.append(f"{len(lines)} {kind} (line{'' if len(lines) == 1 else 's'} {shown})")
    return text + ": " + ", ".join(parts)


def _quote_reasons(skipped: Sequence[SkippedLine]) -> str:
    lines = [f"  line {item.line}: {item.reason}" for item in skipped[:_REASONS_SHOWN]]
    if len(skipped) > _REASONS_SHOWN:
        lines.append(f"  ... and {len(skipped) - _REASONS_SHOWN} more")
    return "\n".join(lines)


def read_conversations(
    path: Path, *, answer_only_loss: bool = True, setting: str = "data.data_path"
) -> ConversationFile:
    """Read a JSONL file of OpenAI or ShareGPT conversations, one per line.

    Blank lines are ignored. Every other line is either a usable :class:`Conversation` or a
    :class:`SkippedLine` saying what is wrong. With `answer_only_loss`, a conversation without an
    assistant turn has nothing to supervise and is skipped. Raises DataError when the file is
    missing, empty, or has no usable conversation (quoting the first reasons); `setting` is
    what the user sets to point at another file (the recipe key or a command-line option).
    """
    unreadable = regular_file_problem(path)
    if unreadable is not None:
        what = "does not exist" if unreadable.missing else f"cannot be read: {unreadable.reason}"
        msg = f"data file {path} {what}; set {setting} to a JSONL file"
        raise DataError(msg)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        msg = f"data file {path} cannot be read: {exc.strerror or exc}"
        raise DataError(msg) from None
    conversations: list[Conversation] = []
    skipped: list[SkippedLine] = []
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            skipped.append(SkippedLine(number, "not UTF-8", f"not valid UTF-8 ({exc.reason})"))
            continue
        if not line.strip():
            continue
        try:
            messages = _parse_line(line, answer_only_loss=answer_only_loss)
        except _LineProblem as problem:
            skipped.append(SkippedLine(number, problem.kind, problem.reason))
            continue
        conversations.append(Conversation(number, messages))
    file = ConversationFile(path, tuple(conversations), tuple(skipped))
    if not conversations:
        if not skipped:
            msg = f"data file {path} is empty: no conversation to train on"
        else:
            msg = f"no usable conversation in {path} ({file.summary}):\n" + _quote_reasons(
                file.skipped
            )
        raise DataError(msg)
    return file


class _LineProblem(Exception):
    """Why one line is unusable (caught by read_conversations, never escapes)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _parse_line(line: str, *, answer_only_loss: bool) -> tuple[Message, ...]:
    """The messages of one line; _LineProblem says why it is unusable."""
    try:
        record = parse_json(line, max_int_digits=_DATA_INT_DIGITS, allow_duplicate_keys=True)
    except JsonProblem as exc:
        raise _LineProblem("invalid JSON", exc.reason) from None
    if not isinstance(record, dict):
        raise _LineProblem("not an object", f"expected a JSON object, got {_json_type(record)}")
    if "messages" in record:
        key, role_key, content_key, roles = "messages", "role", "content", _OPENAI_ROLES
    elif "conversations" in record:
        key, role_key, content_key, roles = "conversations", "from", "value", _SHAREGPT_ROLES
    else:
        keys = ", ".join(sorted(record)) or "none"
        reason = (
            f"has neither a 'messages' (OpenAI) nor a 'conversations' (ShareGPT) key (keys: {keys})"
        )
        raise _LineProblem("no conversation key", reason)
    turns = record[key]
    if not isinstance(turns, list):
        raise _LineProblem("bad message list", f"'{key}' must be a list, got {_json_type(turns)}")
    if not turns:
        raise _LineProblem("empty conversation", f"'{key}' is an empty list")
    messages: list[Message] = []
    for index, turn in enumerate(turns):
        where = f"{key}[{index}]"
        if not isinstance(turn, dict):
            raise _LineProblem("bad message", f"{where} must be an object, got {_json_type(turn)}")
        if role_key not in turn:
            raise _LineProblem("bad role", f"{where} has no '{role_key}'")
        raw_role = turn[role_key]
        role = roles.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            reason = (
                f"{where} has {role_key} {shorten(raw_role)}; expected one of {', '.join(roles)}"
            )
            raise _LineProblem("bad role", reason)
        content = turn.get(content_key)
        if not isinstance(content, str):
            shown = "missing" if content_key not in turn else _json_type(content)
            reason = f"{where} '{content_key}' must be a string, got {shown}"
            raise _LineProblem("non-string content", reason)
        messages.append(Message(role, content))
    if answer_only_loss and not any(m.role == "assistant" for m in messages):
        reason = "no assistant turn: nothing to supervise with data.answer_only_loss"
        raise _LineProblem("no assistant turn", reason)
    return tuple(messages)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


# ---------------------------------------------------------------------------------------------
# tokenizing
# ---------------------------------------------------------------------------------------------


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
    if max_len < 1:
        msg = f"max_len must be >= 1, got {max_len}"
        raise ValueError(msg)
    template = _resolve_template(tokenizer, chat_template)
    messages, cut = _bounded_messages(messages, max_len)
    dicts = [{"role": m.role, "content": m.content} for m in messages]
    if not answer_only_loss:
        ids = _token_ids(_render_tokens(tokenizer, dicts, template))
        mask = [1] * len(ids)
    elif _GENERATION_MARKER.search(template):
        encoded = _render_tokens(tokenizer, dicts, template, return_assistant_tokens_mask=True)
        ids = _token_ids(encoded)
        mask = [int(bool(v)) for v in _field(encoded, "assistant_masks")]
    else:
        ids, mask = _mask_by_rendering(tokenizer, messages, template)
    truncated = cut or len(ids) > max_len
    return TokenizedExample(ids[:max_len], mask[:max_len], truncated)


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


def _resolve_template(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
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


def _render_text(
    tokenizer: PreTrainedTokenizerBase,
    dicts: list[dict[str, str]],
    template: str,
    *,
    add_generation_prompt: bool = False,
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            dicts,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as exc:  # jinja raises many kinds, templates raise their own
        msg = f"the chat template could not render the conversation: {exc}"
        raise DataError(msg) from exc
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
    try:
        return tokenizer.apply_chat_template(
            dicts,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=return_assistant_tokens_mask,
        )
    except Exception as exc:  # jinja raises many kinds, templates raise their own
        msg = f"the chat template could not render the conversation: {exc}"
        raise DataError(msg) from exc


def _field(encoded: object, name: str) -> list[int]:
    if not isinstance(encoded, Mapping) or name not in encoded:
        msg = f"the tokenizer returned no {name!r}"
        raise DataError(msg)
    values = encoded[name]
    if isinstance(values, Tensor):
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


# ---------------------------------------------------------------------------------------------
# datasets and batches
# ---------------------------------------------------------------------------------------------


@attrs.frozen(repr=False, eq=False, slots=False)
class DatasetStats(Record):
    """What went into a dataset, for the run's log and summary."""

    conversations_used: int
    skipped: tuple[SkippedLine, ...]
    num_tokens: int
    num_supervised_tokens: int
    num_truncated: int


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainDataset(Record):
    """Tokenized examples plus the pad id batches use and the stats of how they were made."""

    examples: tuple[TokenizedExample, ...]
    pad_token_id: int
    stats: DatasetStats
    source: Path

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def summary(self) -> str:
        """The reading summary plus token counts, e.g. for the run log."""
        s = self.stats
        return (
            f"{self.source}: {summarize(s.conversations_used, s.skipped)}; "
            f"{s.num_tokens} tokens, {s.num_supervised_tokens} supervised, "
            f"{s.num_truncated} truncated"
        )


def build_dataset(
    plan: RunPlan,
    tokenizer: PreTrainedTokenizerBase,
    *,
    split: Literal["train", "eval"] = "train",
) -> TrainDataset:
    """Read, tokenize and mask the plan's data (`data.data_path`, or `data.eval_data_path`).

    Conversations that cannot open a single block (``draft.block_size`` tokens starting on
    two consecutive supervised tokens within ``training.training_seq_len``) are skipped with a
    reason. Raises DataError when nothing usable remains, quoting the first reasons.
    """
    data = plan.data
    raw_path = data.data_path if split == "train" else data.eval_data_path
    if raw_path is None:
        field = "data.data_path" if split == "train" else "data.eval_data_path"
        msg = f"{field} is not set; point it at a JSONL file of conversations"
        raise DataError(msg)
    path = Path(raw_path)
    template = _resolve_template(tokenizer, read_chat_template(data.chat_template))
    file = read_conversations(path, answer_only_loss=data.answer_only_loss)
    max_len = plan.training.training_seq_len
    block_size = plan.draft.block_size
    examples: list[TokenizedExample] = []
    skipped = list(file.skipped)
    for conversation in file.conversations:
        try:
            example = tokenize_conversation(
                tokenizer,
                conversation.messages,
                chat_template=template,
                answer_only_loss=data.answer_only_loss,
                max_len=max_len,
            )
        except DataError as exc:
            skipped.append(SkippedLine(conversation.line, "template error", str(exc)))
            continue
        if not _opens_a_block(example, block_size):
            reason = (
                f"no block of {block_size} tokens starts on two supervised tokens within "
                f"training_seq_len={max_len} ({len(example.input_ids)} tokens, "
                f"{sum(example.loss_mask)} supervised)"
            )
            skipped.append(SkippedLine(conversation.line, "nothing to supervise", reason))
            continue
        examples.append(example)
    skipped.sort(key=lambda item: item.line)
    stats = DatasetStats(
        conversations_used=len(examples),
        skipped=tuple(skipped),
        num_tokens=sum(len(e.input_ids) for e in examples),
        num_supervised_tokens=sum(sum(e.loss_mask) for e in examples),
        num_truncated=sum(e.truncated for e in examples),
    )
    if not examples:
        msg = (
            f"no usable conversation in {path} ({summarize(0, stats.skipped)}):\n"
            + _quote_reasons(stats.skipped)
        )
        raise DataError(msg)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return TrainDataset(tuple(examples), int(pad), stats, path)


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


def _opens_a_block(example: TokenizedExample, block_size: int) -> bool:
    loss_mask = torch.tensor([example.loss_mask], dtype=torch.long)
    attention = torch.ones_like(loss_mask)
    return bool(eligible_anchor_mask(loss_mask, attention, block_size=block_size).any())


@attrs.frozen(eq=False)
class Batch:
    """Right-padded LongTensors ``[B, T]`` (T = longest example) and where the data stands."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    epoch: int
    #: Index into the epoch's order just after this (global) batch: save it to resume.
    next_index: int

    def to(self, device: torch.device) -> Batch:
        """The same batch with its tensors on `device`."""
        return attrs.evolve(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            loss_mask=self.loss_mask.to(device),
        )


def epoch_order(num_examples: int, *, seed: int, epoch: int) -> list[int]:
    """The deterministic shuffled order of example indices for `epoch` (same in every process)."""
    order = list(range(num_examples))
    random.Random(f"dflash-data:{seed}:{epoch}").shuffle(order)
    return order


def batches_per_epoch(
    num_examples: int, *, batch_size: int, world_size: int = 1, drop_last: bool = False
) -> int:
    """How many batches :func:`batches` yields per epoch (per process)."""
    global_batch = batch_size * world_size
    if drop_last or world_size > 1:
        return num_examples // global_batch
    return -(-num_examples // global_batch)


def batches(
    dataset: TrainDataset,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    start_index: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
) -> Iterator[Batch]:
    """Yield the batches of one epoch in a seeded order, starting at `start_index`.

    The order depends only on (seed, epoch). A global batch is ``batch_size * world_size``
    consecutive examples of that order; process `rank` gets its ``batch_size`` slice. Resume by
    passing a saved :attr:`Batch.next_index` as `start_index`. The last, smaller batch is
    yielded on one process unless `drop_last`; with several processes an incomplete global
    batch is always dropped (every process must take the same number of steps).
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        msg = (
            f"need batch_size >= 1 and 0 <= rank < world_size; got batch_size={batch_size}, "
            f"rank={rank}, world_size={world_size}"
        )
        raise ValueError(msg)
    order = epoch_order(len(dataset), seed=seed, epoch=epoch)
    global_batch = batch_size * world_size
    keep_partial = world_size == 1 and not drop_last
    index = start_index
    while index < len(order):
        chunk = order[index : index + global_batch]
        if len(chunk) < global_batch and not keep_partial:
            return
        mine = chunk[rank * batch_size : (rank + 1) * batch_size]
        index += len(chunk)
        yield _collate([dataset.examples[i] for i in mine], dataset.pad_token_id, epoch, index)


def _collate(examples: Sequence[TokenizedExample], pad: int, epoch: int, next_index: int) -> Batch:
    longest = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), longest), pad, dtype=torch.long)
    attention = torch.zeros((len(examples), longest), dtype=torch.long)
    loss = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids, dtype=torch.long)
        attention[row, :n] = 1
        loss[row, :n] = torch.tensor(example.loss_mask, dtype=torch.long)
    return Batch(ids, attention, loss, epoch, next_index)


__all__ = [
    "Batch",
    "Conversation",
    "ConversationFile",
    "DatasetStats",
    "Message",
    "SkippedLine",
    "TokenizedExample",
    "TrainDataset",
    "batches",
    "batches_per_epoch",
    "build_dataset",
    "epoch_order",
    "read_chat_template",
    "read_conversations",
    "summarize",
    "tokenize_conversation",
]
