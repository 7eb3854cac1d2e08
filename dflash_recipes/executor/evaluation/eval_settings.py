"""What makes a measured tau comparable with another: recorded beside every eval report.

The same checkpoint's tau ranges from about 2.6 to 8 in published trackers depending on the
engine, the block size, thinking mode, the chat template, the prompts and the generation
length. :class:`EvalSettings` records each of them (files by sha256), so two ``eval --json``
reports can be compared field by field before their taus are.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs

from dflash_recipes.records import Record

#: How the verification decides by default: the target's greedy token. ``sampling`` when it
#: samples at a temperature (docs/dflash.md "Measuring acceptance").
DECODING = "greedy"


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def thinking_mode(enable_thinking: bool | None) -> str:
    """``on``, ``off`` or ``template default`` (``enable_thinking`` not passed)."""
    if enable_thinking is None:
        return "template default"
    return "on" if enable_thinking else "off"


@attrs.frozen(repr=False, eq=False, slots=False)
class EvalSettings(Record):
    """The settings of one acceptance measurement that change tau."""

    block_size: int
    max_new_tokens: int
    num_prompts: int
    #: Prompts per batch of the verification loop (does not change tau or the tokens).
    batch_size: int
    #: The prompt file (None: prompts given in memory) and the sha256 of its bytes (of a
    #: folder: of its files, names and bytes, as data.sources.content_sha256 hashes them).
    prompt_file: str | None
    prompt_file_sha256: str | None
    #: jsonl, json, parquet, or rows (any other training-data input; None: prompts in memory).
    prompt_format: str | None
    #: The Parquet column read (None for other formats).
    prompt_column: str | None
    #: Where the chat template came from: ``data.chat_template`` (its path) or ``tokenizer``.
    chat_template_source: str
    chat_template_sha256: str | None
    #: The ``enable_thinking`` passed to the chat template (None: not passed).
    enable_thinking: bool | None
    #: Whether the chat template mentions ``enable_thinking`` at all.
    template_reads_enable_thinking: bool
    #: The first stop token id (None: generation runs to max_new_tokens).
    eos_token_id: int | None
    decoding: str = DECODING
    #: The sampling temperature (0.0: greedy).
    temperature: float = 0.0
    #: How proposals were drawn at temperature > 0, ``sampled`` or ``greedy`` (None: greedy
    #: decoding).
    draft_sampling: str | None = None
    #: The seed of the sampled draws (None: greedy decoding draws nothing).
    seed: int | None = None
    #: The top-k and top-p cuts of sampled decoding (0 and 1.0: off; None: greedy decoding).
    top_k: int | None = None
    top_p: float | None = None
    #: The prompts are the data.eval_holdout slice of prompt_file (training held them out),
    #: e.g. "4 conversations, seed 0"; None: the file's first num_prompts.
    held_out_slice: str | None = None

    @property
    def thinking_mode(self) -> str:
        """``on``, ``off`` or ``template default``."""
        return thinking_mode(self.enable_thinking)

    def to_dict(self) -> dict[str, object]:
        """JSON-compatible dict of every field, and ``thinking_mode``."""
        row: dict[str, object] = {
            field.name: getattr(self, field.name) for field in attrs.fields(EvalSettings)
        }
        row["thinking_mode"] = self.thinking_mode
        return row


__all__ = [
    "DECODING",
    "EvalSettings",
    "sha256_file",
    "sha256_text",
    "thinking_mode",
]
