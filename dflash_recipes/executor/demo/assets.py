"""The embedded tiny default: a deterministic tiny target, tokenizer and datasets.

Nothing is downloaded. A small synthetic "atlas" of invented cities is rendered into chat
conversations; a byte-level BPE tokenizer is trained on it; a 6-layer, width-128 Qwen3 target
is pretrained on it for a few hundred CPU steps so that its greedy answers are the atlas'
facts (a real language model of this tiny world, so drafting against it means something).
The same seed gives byte-identical assets in every process.

The data files (:func:`demo_conversations`) split the atlas by city: the drafters train on
the first cities (``general.jsonl``, ``domain.jsonl``), and ``eval.jsonl`` asks only about the
last :data:`HELD_OUT_CITIES`, which no training file mentions; the target knows every city.

The tool-calling example (``recipes/tiny/tiny_tools.yaml``) reads ``tools.jsonl``: the assistant
calls the atlas' one tool (:data:`CITY_FACTS_TOOL`), reads the tool's result and answers, in the
OpenAI format (``tools``, ``tool_calls``, a ``tool`` turn); ``tools_eval.jsonl`` asks about the
held-out cities with prompts tagged ``tool`` (with the tool) and ``chat`` (without), so `eval`
reports tau per workload.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_recipes.executor.demo.tiny_tokenizer import build_tiny_tokenizer, spare_token_ids
from dflash_recipes.records import Record

logger = logging.getLogger("dflash_recipes.demo")

ASSETS_VERSION = 1
TARGET_LAYERS = 6
TARGET_HIDDEN = 128
#: The last cities of the atlas: only the eval set asks about them.
HELD_OUT_CITIES = 6
#: The demo's data files, by name, in the order they are written.
DATA_FILES = ("general.jsonl", "domain.jsonl", "eval.jsonl", "tools.jsonl", "tools_eval.jsonl")
#: The atlas' tool: the facts of a city (a short schema: the tiny target has 512 positions).
CITY_FACTS_TOOL: dict[str, object] = {
    "type": "function",
    "function": {
        "name": "city_facts",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

_SYLLABLES = ("ka", "lo", "mi", "ven", "tor", "sa", "rin", "bel", "dor", "ne", "qua", "zu")
_COUNTRIES = ("arvand", "belmora", "cestia", "dunmark", "elvaria", "fenwick")
_RIVERS = ("silver", "amber", "north", "willow", "stone", "cloud")
_FOODS = ("honey bread", "salt fish", "plum cake", "green soup", "lamb stew", "rice pie")
_COLORS = ("red", "blue", "green", "gold", "white", "black")
_TRADES = ("glass", "wool", "ships", "clocks", "paper", "wine")


@attrs.frozen(repr=False, eq=False, slots=False)
class City(Record):
    """One invented city and its facts."""

    name: str
    country: str
    river: str
    food: str
    color: str
    bridges: int
    trade: str


def make_atlas(seed: int = 0, count: int = 36) -> tuple[City, ...]:
    """`count` cities with distinct names and seeded facts."""
    rng = random.Random(f"dflash-demo-atlas:{seed}")
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3))))
        if name not in names:
            names.append(name)
    return tuple(
        City(
            name=name,
            country=rng.choice(_COUNTRIES),
            river=rng.choice(_RIVERS),
            food=rng.choice(_FOODS),
            color=rng.choice(_COLORS),
            bridges=rng.randint(2, 19),
            trade=rng.choice(_TRADES),
        )
        for name in names
    )


#: (question, answer) templates. Split "general" (pretraining the released drafter) and
#: "domain" (the fine-tuning data) use different templates over the same world.
_GENERAL = (
    (
        "tell me about {name}.",
        "{name} is a city in {country}. it lies on the {river} river and is known for "
        "{food}. the flag of {name} is {color} and the city has {bridges} bridges.",
    ),
    (
        "where is {name}?",
        "{name} is in {country}, on the {river} river. people there make {trade}.",
    ),
    (
        "what do people eat in {name}?",
        "in {name} people eat {food}. it is the pride of {country}.",
    ),
)
_DOMAIN = (
    (
        "give me a travel note for {name}.",
        "travel note: {name}, {country}. cross one of its {bridges} bridges over the {river} "
        "river, try the {food}, and buy {trade} at the market.",
    ),
    (
        "describe the flag and trade of {name}.",
        "the flag of {name} is {color}. the city lives from {trade} and {food}.",
    ),
)


def _render(template: str, city: City) -> str:
    return template.format(**attrs.asdict(city))


def conversations(
    atlas: Sequence[City], templates: Sequence[tuple[str, str]]
) -> list[dict[str, object]]:
    """OpenAI-style conversations, one per (city, template)."""
    rows: list[dict[str, object]] = []
    for city in atlas:
        for question, answer in templates:
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": _render(question, city)},
                        {"role": "assistant", "content": _render(answer, city)},
                    ]
                }
            )
    return rows


def tool_conversation(city: City) -> dict[str, object]:
    """A tool-calling conversation about `city`: a call of city_facts, its result, the answer."""
    facts = json.dumps(
        {"country": city.country, "river": city.river, "bridges": city.bridges}, sort_keys=True
    )
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "city_facts", "arguments": json.dumps({"city": city.name})},
    }
    return {
        "tag": "tool",
        "tools": [CITY_FACTS_TOOL],
        "messages": [
            {"role": "user", "content": f"look up {city.name} and tell me about its river."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": facts},
            {
                "role": "assistant",
                "content": _render(
                    "the {river} river runs through {name}, {country}, under {bridges} bridges.",
                    city,
                ),
            },
        ],
    }


def demo_conversations(seed: int = 0) -> dict[str, list[dict[str, object]]]:
    """The rows of each data file (:data:`DATA_FILES`), generated from the atlas of `seed`.

    ``general.jsonl`` (the released drafter's data) and ``domain.jsonl`` (the fine-tune's) cover
    the training cities; ``eval.jsonl`` is the fine-tune's task over the held-out cities only, so
    the measured tau is on conversations no run trained on.
    """
    atlas = make_atlas(seed)
    held_out = atlas[-HELD_OUT_CITIES:]
    train_atlas = atlas[:-HELD_OUT_CITIES]
    chat = [{"tag": "chat", **row} for row in conversations(held_out, _DOMAIN[:1])]
    return {
        "general.jsonl": conversations(train_atlas, _GENERAL),
        "domain.jsonl": conversations(train_atlas, _DOMAIN),
        "eval.jsonl": conversations(held_out, _DOMAIN),
        "tools.jsonl": [tool_conversation(city) for city in train_atlas],
        "tools_eval.jsonl": [tool_conversation(city) for city in held_out] + chat,
    }


def data_file_text(rows: Sequence[dict[str, object]]) -> str:
    """A data file's text: one JSON object per line, keys sorted."""
    return "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)


def write_demo_data(data_dir: Path, seed: int = 0) -> list[Path]:
    """Write the data files of `seed` into `data_dir` (the target is not touched)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in demo_conversations(seed).items():
        (data_dir / name).write_text(data_file_text(rows), encoding="utf-8")
        written.append(data_dir / name)
    return written


@attrs.frozen(repr=False, eq=False, slots=False)
class DemoAssets(Record):
    """Paths of the built assets."""

    root: Path
    target_dir: Path
    general_data: Path
    domain_data: Path
    eval_data: Path
    mask_token_id: int


def build_demo_assets(
    root: Path, *, seed: int = 0, pretrain_steps: int = 400, force: bool = False
) -> DemoAssets:
    """Build (or reuse) the tiny target, tokenizer and datasets under `root`."""
    root = Path(root)
    target_dir = root / "target"
    data_dir = root / "data"
    stamp = root / "assets.json"
    wanted = {"version": ASSETS_VERSION, "seed": seed, "pretrain_steps": pretrain_steps}
    assets_paths = {
        "general_data": data_dir / "general.jsonl",
        "domain_data": data_dir / "domain.jsonl",
        "eval_data": data_dir / "eval.jsonl",
    }
    if not force and stamp.is_file():
        try:
            recorded = json.loads(stamp.read_text(encoding="utf-8"))
        except ValueError:
            recorded = None
        if isinstance(recorded, dict) and recorded.get("key") == wanted:
            return DemoAssets(
                root=root,
                target_dir=target_dir,
                mask_token_id=int(recorded["mask_token_id"]),
                **assets_paths,
            )

    atlas = make_atlas(seed)
    # The target knows the whole world (held-out cities included): the drafter is what is
    # evaluated on conversations it never trained on.
    world = conversations(atlas, _GENERAL + _DOMAIN)
    texts = [
        str(m["content"])
        for row in world
        for m in row["messages"]  # type: ignore[attr-defined]
    ]
    target_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(texts, out_dir=target_dir)
    mask_token_id = spare_token_ids(tokenizer)[0]
    vocab_size = len(tokenizer)

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=TARGET_HIDDEN,
        intermediate_size=4 * TARGET_HIDDEN,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        # Qwen3's theta, so a drafter that fell back to a class default (10000) would show.
        rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"},
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    rendered = [
        tokenizer.apply_chat_template(row["messages"], tokenize=False)  # type: ignore[arg-type]
        for row in world
    ]
    _pretrain(model, tokenizer, [str(r) for r in rendered], steps=pretrain_steps, seed=seed)
    model.save_pretrained(target_dir, safe_serialization=True)

    write_demo_data(data_dir, seed)
    stamp.write_text(
        json.dumps({"key": wanted, "mask_token_id": mask_token_id}, indent=2) + "\n",
        encoding="utf-8",
    )
    return DemoAssets(root=root, target_dir=target_dir, mask_token_id=mask_token_id, **assets_paths)


def _pretrain(
    model: Qwen3ForCausalLM,
    tokenizer: object,
    texts: Sequence[str],
    *,
    steps: int,
    seed: int,
    batch_size: int = 16,
) -> None:
    """Teach the tiny target its world (plain next-token training, AdamW, cosine)."""
    encode = tokenizer  # a PreTrainedTokenizerFast
    encoded = [encode(text)["input_ids"] for text in texts]  # type: ignore[operator]
    pad = int(tokenizer.pad_token_id)  # type: ignore[attr-defined]
    rng = random.Random(f"dflash-demo-pretrain:{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1
    )
    model.train()
    started = time.perf_counter()
    loss_value = float("nan")
    for step in range(steps):
        rows = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        longest = max(len(r) for r in rows)
        ids = torch.full((batch_size, longest), pad, dtype=torch.long)
        attention = torch.zeros((batch_size, longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            attention[i, : len(row)] = 1
        labels = ids.masked_fill(attention == 0, -100)
        out = model(input_ids=ids, attention_mask=attention, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = float(out.loss.detach())
        if (step + 1) % 100 == 0:
            logger.info("target pretraining step %d/%d loss %.3f", step + 1, steps, loss_value)
    model.train(False)
    logger.info(
        "pretrained the tiny target: %d steps, final loss %.3f, %.1fs",
        steps,
        loss_value,
        time.perf_counter() - started,
    )


__all__ = [
    "CITY_FACTS_TOOL",
    "DATA_FILES",
    "HELD_OUT_CITIES",
    "DemoAssets",
    "build_demo_assets",
    "conversations",
    "data_file_text",
    "demo_conversations",
    "make_atlas",
    "tool_conversation",
    "write_demo_data",
]
