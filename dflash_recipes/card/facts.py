"""What a model card says, as plain data: the drafter, its training, its last measurement.

:class:`CardFacts` is everything :func:`~dflash_recipes.card.render.render_card` renders; it holds
no path of the machine that trained the drafter (files are named by their names, sizes and
sha256). An export keeps it beside its README as :data:`CARD_DATA_FILE`, so `eval --write-card`
can regenerate the card with a new measurement without the plan or the run directory.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from dflash_recipes.files.jsonio import JsonProblem, parse_json, shorten
from dflash_recipes.recipe.choices import SUPERVISED_PARTS
from dflash_recipes.records import Record

if TYPE_CHECKING:
    import cattrs

#: The card's data, written beside README.md in every export (JSON).
CARD_DATA_FILE = ".dflash-card.json"
#: The card's own file name (the Hub renders it as the model card).
CARD_FILE = "README.md"
#: Version of :data:`CARD_DATA_FILE`'s layout.
CARD_DATA_VERSION = 1


@attrs.frozen(repr=False, eq=False, slots=False)
class DataFile(Record):
    """One file the drafter was trained (or evaluated during training) on."""

    #: ``training`` or ``held-out``.
    role: str
    #: The file's name (inside a data folder: its name there), never its path.
    name: str
    size: int | None = None
    sha256: str | None = None
    #: Why size or sha256 is missing (unreadable at export time, too large to hash).
    note: str | None = None


@attrs.frozen(repr=False, eq=False, slots=False)
class DrafterFacts(Record):
    """What the exported drafter is."""

    #: The projector type (dflash, domino, dspark) and the head as it drafts, in words.
    kind: str
    head: str
    block_size: int
    #: Proposals per verification step (block_size - 1, or block_size with a shifted head).
    drafted_tokens: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int
    num_target_layers: int
    #: Read from the exported model.safetensors header.
    parameters: int
    tensors: int
    dtype: str
    weights_bytes: int


@attrs.frozen(repr=False, eq=False, slots=False)
class TrainingFacts(Record):
    """How the drafter was trained, as the plan and the run directory say."""

    #: The target as the card names it: its Hub id when known, else its directory's name.
    target: str
    #: The target's Hub id (the card's base_model), when known.
    base_model: str | None
    target_dtype: str
    #: The warm start in words (None: trained from scratch).
    warm_start: str | None
    #: The training checkpoint the plan resumed from (its step), when it did.
    resumed_from_step: int | None
    data_files: tuple[DataFile, ...]
    #: The `dflash-recipe capture` folder trained on offline (its name), if any.
    capture: str | None
    #: Hub ids of the training data (the card's datasets).
    datasets: tuple[str, ...]
    #: Optimiser steps behind the exported weights (None: not recorded).
    steps: int | None
    #: What the plan asked for: "max_steps 60" or "3 epochs".
    planned: str
    #: Sequences per optimiser step, all processes together (None: not recorded).
    sequences_per_step: int | None
    #: How a step's sequences were made up, in words.
    batch: str
    training_seq_len: int
    #: The tokenized training set (tokens, supervised tokens, conversations), when recorded.
    dataset_tokens: int | None
    supervised_tokens: int | None
    conversations: int | None
    answer_only_loss: bool
    #: The loss in words (weighting, anchors, distillation, head terms).
    objective: str
    #: The optimiser and schedule in words.
    optimiser: str
    seed: int
    plan_fingerprint: str
    #: With answer_only_loss, the assistant parts supervised (data.supervise).
    supervised_parts: tuple[str, ...] = SUPERVISED_PARTS


@attrs.frozen(repr=False, eq=False, slots=False)
class TagMeasurement(Record):
    """The acceptance of the prompts of one workload tag (chat, code, tool, ...)."""

    tag: str
    #: Pooled tau over this tag's verification steps.
    tau: float
    num_prompts: int


@attrs.frozen(repr=False, eq=False, slots=False)
class Measurement(Record):
    """A held-out acceptance measurement and the settings that make it comparable."""

    #: Acceptance length tau pooled over every verification step (`eval`'s first figure).
    tau: float
    tau_per_prompt_mean: float | None
    block_size: int
    drafted_tokens: int | None
    max_new_tokens: int | None
    num_prompts: int
    #: on, off or template default.
    thinking_mode: str | None
    #: The prompt file's name (never its path) and the sha256 of its bytes.
    prompts_file: str | None
    prompts_sha256: str | None
    #: Where the chat template came from: ``tokenizer`` or the template file's name.
    chat_template: str | None
    chat_template_sha256: str | None
    #: The head the proposals were drafted with, as the serving engine applies it.
    head: str | None
    #: True when every output equalled the target's greedy decoding.
    lossless: bool | None
    #: ``training`` (training.eval_steps) or ``eval`` (`dflash-recipe eval --write-card`).
    source: str
    #: The training step of the weights measured (None: the export itself, by `eval`).
    step: int | None = None
    #: How the target verified: ``greedy``, or ``sampling at temperature T (top-k K, top-p P,
    #: drafts sampled, seed S)`` (None: not recorded; every measurement before sampling existed
    #: was greedy).
    decoding: str | None = None
    #: Tau per workload tag when the prompts carried tags (empty: none did).
    per_tag: tuple[TagMeasurement, ...] = ()


@attrs.frozen(repr=False, eq=False, slots=False)
class CardFacts(Record):
    """Everything a model card renders."""

    drafter: DrafterFacts
    training: TrainingFacts
    #: The last held-out measurement of these weights (None: not measured).
    measurement: Measurement | None
    #: The recipe's card.description and card.license.
    description: str | None
    license: str | None
    #: Why an engine serves the head otherwise than trained (empty for plain DFlash).
    serving_notes: tuple[str, ...]
    tool_version: str


class CardDataError(ValueError):
    """A card data file that cannot be read back (damaged, edited, another version)."""


def card_data_json(facts: CardFacts) -> str:
    """The text of :data:`CARD_DATA_FILE` for `facts` (sorted keys, one trailing newline)."""
    data = {"dflash_card": CARD_DATA_VERSION, "facts": attrs.asdict(facts)}
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def parse_card_data(text: str | bytes) -> CardFacts:
    """Read :data:`CARD_DATA_FILE` back; CardDataError says what is wrong with it."""
    try:
        data = parse_json(text)
    except JsonProblem as exc:
        msg = f"not valid JSON ({exc.reason})"
        raise CardDataError(msg) from None
    if not isinstance(data, dict) or data.get("dflash_card") != CARD_DATA_VERSION:
        version = data.get("dflash_card") if isinstance(data, dict) else None
        msg = f"card data version {shorten(version)}, this dflash-recipes reads {CARD_DATA_VERSION}"
        raise CardDataError(msg)
    try:
        facts: CardFacts = _converter().structure(data.get("facts"), CardFacts)
    except Exception as exc:  # cattrs raises ExceptionGroups of many kinds
        msg = f"the card data does not match its layout ({type(exc).__name__})"
        raise CardDataError(msg) from exc
    return facts


@functools.cache
def _converter() -> cattrs.Converter:
    """A strict converter: no coercion between JSON types, no extra keys."""
    import cattrs

    conv = cattrs.Converter(forbid_extra_keys=True)

    def strict(kind: type) -> Callable[[object, object], object]:
        def hook(value: object, _type: object) -> object:
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if type(value) is not kind:
                msg = f"expected {kind.__name__}, got {type(value).__name__}"
                raise TypeError(msg)
            return value

        return hook

    for kind in (int, float, str, bool):
        conv.register_structure_hook(kind, strict(kind))
    return conv


__all__ = [
    "CARD_DATA_FILE",
    "CARD_DATA_VERSION",
    "CARD_FILE",
    "CardDataError",
    "CardFacts",
    "DataFile",
    "DrafterFacts",
    "Measurement",
    "TagMeasurement",
    "TrainingFacts",
    "card_data_json",
    "parse_card_data",
]
