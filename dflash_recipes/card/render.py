"""Render a model card (README.md) from :class:`~dflash_recipes.card.facts.CardFacts`.

The card opens with YAML front matter in the Hub's model-card conventions, as released DFlash
drafters write it (z-lab's cards: ``library_name: transformers``, ``pipeline_tag:
text-generation``, tags ``dflash``, ``speculative-decoding``, ``draft-model``, a ``license``):
``base_model`` (the target's Hub id, when known), ``license`` (when the recipe states one),
``datasets`` (when known), ``tags`` (with the drafter kind). Then prose: what it is, how it was
trained, what it measured (or "not measured"), and how to serve it, with the engines' flags for
its block size: vLLM's ``num_speculative_tokens`` is ``block_size - 1`` (the proposals after
the anchor), SGLang's ``--speculative-num-draft-tokens`` is the block size itself.

Pure: the same facts give the same bytes (no time stamps), so a re-export regenerates the
same card for the same run.
"""

from __future__ import annotations

import json

import yaml

from dflash_recipes.card.facts import (
    CARD_DATA_FILE,
    CardFacts,
    DataFile,
    DrafterFacts,
    Measurement,
    TrainingFacts,
)
from dflash_recipes.checkpoint.kinds.registry import FAMILY, kind_facts
from dflash_recipes.recipe.choices import SUPERVISED_PARTS

#: As released DFlash drafters' cards say (the drafter loads with AutoModel and remote code).
LIBRARY_NAME = "transformers"
PIPELINE_TAG = "text-generation"
#: Tags every card carries; the drafter kind is added when it is not plain DFlash.
BASE_TAGS = (FAMILY, "speculative-decoding", "draft-model", "dflash-recipes")
#: Placeholder for the drafter in the serving commands: a Hub id or a local directory.
DRAFTER = "DRAFTER"


def vllm_speculative_tokens(block_size: int) -> int:
    """vLLM's ``num_speculative_tokens`` for a drafter of `block_size`: the masked positions."""
    return block_size - 1


def sglang_draft_tokens(block_size: int) -> int:
    """SGLang's ``--speculative-num-draft-tokens`` for a drafter of `block_size`: the block."""
    return block_size


def front_matter(facts: CardFacts) -> dict[str, object]:
    """The card's YAML metadata, in the order the Hub's own cards write it."""
    meta: dict[str, object] = {}
    if facts.training.base_model is not None:
        meta["base_model"] = facts.training.base_model
    if facts.license is not None:
        meta["license"] = facts.license
    meta["library_name"] = LIBRARY_NAME
    meta["pipeline_tag"] = PIPELINE_TAG
    tags = list(BASE_TAGS)
    if facts.drafter.kind not in tags:
        tags.append(facts.drafter.kind)
    meta["tags"] = tags
    if facts.training.datasets:
        meta["datasets"] = list(facts.training.datasets)
    return meta


def _count(value: int | None) -> str:
    return f"{value:,}" if value is not None else "not recorded"


def _what_it_is(d: DrafterFacts, t: TrainingFacts) -> list[str]:
    layers = ", ".join(
        f"{name} x{d.layer_types.count(name)}" for name in dict.fromkeys(d.layer_types)
    )
    window = f", sliding window {d.sliding_window}" if d.sliding_window is not None else ""
    rows = [
        ("kind", d.head),
        (
            "target",
            f"`{t.target}` ({d.num_target_layers} layers, hidden {d.hidden_size}, "
            f"vocabulary {d.vocab_size})",
        ),
        ("block size", f"{d.block_size} ({d.drafted_tokens} proposals per verification step)"),
        ("draft layers", f"{d.num_hidden_layers} ({layers}{window})"),
        (
            "attention",
            f"{d.num_attention_heads} heads, {d.num_key_value_heads} key/value heads, "
            f"head_dim {d.head_dim}; MLP {d.intermediate_size}",
        ),
        ("taps (target_layer_ids)", json.dumps(list(d.target_layer_ids))),
        ("mask token id", str(d.mask_token_id)),
        (
            "parameters",
            f"{d.parameters:,} in {d.tensors} tensors ({d.dtype}, {d.weights_bytes:,} bytes)",
        ),
    ]
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _data_table(files: tuple[DataFile, ...]) -> list[str]:
    if not files:
        return ["- Data files: none recorded."]
    lines = ["- Data files:", "", "  | file | role | bytes | sha256 |", "  |---|---|---|---|"]
    for f in files:
        size = f"{f.size:,}" if f.size is not None else "-"
        digest = f"`{f.sha256}`" if f.sha256 is not None else f"- ({f.note or 'not recorded'})"
        lines.append(f"  | `{f.name}` | {f.role} | {size} | {digest} |")
    return [*lines, ""]


def _how_trained(t: TrainingFacts) -> list[str]:
    if t.warm_start is not None:
        start = f"- Warm start: from {t.warm_start}."
    elif t.resumed_from_step is not None:
        start = (
            f"- Start: resumed from the run's step-{t.resumed_from_step} checkpoint (a resumed "
            "plan does not record the first run's warm start)."
        )
    else:
        start = "- Start: from scratch (fresh initialisation)."
    lines = [start]
    if t.capture is not None:
        lines.append(f"- Offline: from the target's captured hidden states (`{t.capture}`).")
    lines += _data_table(t.data_files)
    per_step = (
        f"{t.sequences_per_step} sequences per step ({t.batch})"
        if t.sequences_per_step is not None
        else f"sequences per step: {t.batch} (processes not recorded)"
    )
    steps = f"{t.steps:,} optimiser steps" if t.steps is not None else "not recorded"
    lines.append(f"- Steps: {steps} (the plan: {t.planned}); {per_step}.")
    supervised = "assistant tokens only" if t.answer_only_loss else "every token"
    if t.answer_only_loss and tuple(t.supervised_parts) != SUPERVISED_PARTS:
        supervised += f" ({', '.join(t.supervised_parts)})"
    seen = ""
    if t.steps is not None and t.sequences_per_step is not None:
        seen = f"; {t.steps * t.sequences_per_step:,} sequences drawn in all"
    if t.dataset_tokens is None:
        held = "not recorded (no tokenized-data cache entry of the training data was found)"
    else:
        held = (
            f"the tokenized training set holds {t.dataset_tokens:,} tokens "
            f"({_count(t.supervised_tokens)} supervised) in {_count(t.conversations)} "
            "conversations"
        )
    lines.append(
        f"- Tokens: {held}; loss on {supervised}, at most {t.training_seq_len} tokens per "
        f"sequence{seen}."
    )
    lines += [
        f"- Objective: {t.objective}.",
        f"- Optimiser: {t.optimiser}; seed {t.seed}.",
        f"- Target dtype in training: {t.target_dtype}.",
        f"- Plan fingerprint: `{t.plan_fingerprint}` (the sha256 of the compiled run plan).",
    ]
    return lines


def _measured(m: Measurement | None) -> list[str]:
    if m is None:
        return [
            "Not measured. Measure it with greedy speculative decoding against the target and "
            "write the figures here with:",
            "",
            "```bash",
            "dflash-recipe eval RECIPE_OR_PLAN --write-card THIS_DIRECTORY --prompts HELD_OUT",
            "```",
        ]
    where = (
        f"held-out eval during training, at step {m.step}"
        if m.source == "training"
        else "`dflash-recipe eval` of these weights"
    )
    per_prompt = f"{m.tau_per_prompt_mean:.3f}" if m.tau_per_prompt_mean is not None else "-"
    prompts = f"`{m.prompts_file}`" if m.prompts_file is not None else "-"
    rows = [
        ("acceptance length tau (pooled)", f"**{m.tau:.3f}**"),
        ("tau, mean of per-prompt means", per_prompt),
        ("measured by", where),
        ("block size", str(m.block_size)),
        ("max new tokens", str(m.max_new_tokens) if m.max_new_tokens is not None else "-"),
        ("thinking mode", m.thinking_mode or "-"),
        ("prompts", f"{m.num_prompts} from {prompts}"),
        ("prompts sha256", f"`{m.prompts_sha256}`" if m.prompts_sha256 else "-"),
        ("chat template", f"{m.chat_template or '-'}, sha256 `{m.chat_template_sha256 or '-'}`"),
        ("head drafted with", m.head or "-"),
        ("decoding", m.decoding or "greedy"),
        ("output equals greedy decoding", "-" if m.lossless is None else str(m.lossless).lower()),
    ]
    sampled = m.decoding is not None and m.decoding.startswith("sampling")
    how = (
        "Speculative sampling against the target, the verification accepting each proposal by "
        "the rejection rule that keeps the target's distribution"
        if sampled
        else "Greedy speculative decoding against the target, the verification keeping the "
        "longest correct prefix plus one token"
    )
    lines = [
        f"{how}; tau is comparable only at the same settings:",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
    ]
    if m.per_tag:
        lines += [
            "",
            "Per workload (the prompts' tags), at the same settings:",
            "",
            "| workload | prompts | tau (pooled) |",
            "|---|---|---|",
            *(f"| {t.tag} | {t.num_prompts} | {t.tau:.3f} |" for t in m.per_tag),
        ]
    return lines


def _serving(facts: CardFacts) -> list[str]:
    block = facts.drafter.block_size
    target = facts.training.base_model or "TARGET"
    config = json.dumps(
        {
            "method": FAMILY,
            "model": DRAFTER,
            "num_speculative_tokens": vllm_speculative_tokens(block),
        }
    )
    lines = [
        f"`{DRAFTER}` is this repository's id or the directory holding these files"
        + (
            ""
            if facts.training.base_model
            else f"; `TARGET` is the target (`{facts.training.target}`)"
        )
        + f". The block size is {block}: vLLM drafts `num_speculative_tokens` "
        f"{vllm_speculative_tokens(block)} (block size - 1), SGLang takes the block size.",
        "",
        "vLLM:",
        "",
        "```bash",
        f"vllm serve {target} --speculative-config '{config}'",
        "```",
        "",
        "SGLang:",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target} "
        f"--speculative-algorithm {FAMILY.upper()} "
        f"--speculative-draft-model-path {DRAFTER} "
        f"--speculative-num-draft-tokens {sglang_draft_tokens(block)}",
        "```",
        "",
        "Transformers: `AutoModel.from_pretrained(DRAFTER, trust_remote_code=True)` builds the "
        "drafter from `dflash.py` (it drafts for the target; it is not a language model alone).",
    ]
    head = kind_facts(facts.drafter.kind).head_name
    if head is not None:
        lines += [
            "",
            f"> vLLM's `{FAMILY}` method has no {head} head: it would serve the "
            "DFlash backbone without it, or refuse the head's tensors.",
        ]
    for note in facts.serving_notes:
        lines += ["", f"> {note.removeprefix('warning: ')}"]
    return lines


def render_card(facts: CardFacts) -> str:
    """The whole README.md: front matter, then the card's sections (ends with a newline)."""
    meta = yaml.safe_dump(front_matter(facts), sort_keys=False, allow_unicode=True)
    d, t = facts.drafter, facts.training
    short = t.target.rsplit("/", 1)[-1]
    head = kind_facts(d.kind).head_name
    kind = "" if head is None else f" with a {head} head"
    lines = [
        "---",
        meta.rstrip("\n"),
        "---",
        "",
        f"# {short} DFlash drafter{kind}, block size {d.block_size}",
        "",
    ]
    if facts.description:
        lines += [facts.description.strip(), ""]
    lines += [
        f"A DFlash drafter (block-diffusion speculative decoding) for `{t.target}`: it drafts "
        f"{d.drafted_tokens} tokens in one forward pass from the target's hidden states, and the "
        "target verifies them in one pass. It is the drafter only and must run with its target. "
        f"Exported by dflash-recipes {facts.tool_version}.",
        "",
        "## What it is",
        "",
        *_what_it_is(d, t),
        "",
        "## How it was trained",
        "",
        *_how_trained(t),
        "",
        "## What it measured",
        "",
        *_measured(facts.measurement),
        "",
        "## How to serve it",
        "",
        *_serving(facts),
        "",
        "## Files",
        "",
        "`model.safetensors` (the drafter's own tensors; it borrows the target's embeddings and "
        "lm_head), `config.json` (`dflash_config`: block size, mask token id, taps), `dflash.py` "
        f"(remote code for transformers), and `{CARD_DATA_FILE}` (this card's data, which "
        "`dflash-recipe eval --write-card` regenerates it from).",
    ]
    if facts.license is not None:
        lines += ["", f"License: {facts.license}."]
    return "\n".join(lines) + "\n"


__all__ = [
    "BASE_TAGS",
    "DRAFTER",
    "LIBRARY_NAME",
    "PIPELINE_TAG",
    "front_matter",
    "render_card",
    "sglang_draft_tokens",
    "vllm_speculative_tokens",
]
