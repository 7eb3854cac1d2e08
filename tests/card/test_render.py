"""The model card every export carries: Hub front matter per drafter kind, serving lines for
its block size, no path of the training machine, regenerated on a re-export (issue 38)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import attrs
import pytest
import yaml
from testkit.tiny import tiny_plan

from dflash_recipes.card.facts import CARD_DATA_FILE, CARD_FILE, parse_card_data
from dflash_recipes.card.render import render_card
from dflash_recipes.executor.model.draft import DFlashDraftModel
from dflash_recipes.executor.model.export import export_drafter
from dflash_recipes.files.export_target import EXPORT_MARKER
from dflash_recipes.plan.run_plan import CardPlan, InitCheckpointPlan, RunPlan

#: The head fields each drafter kind needs in a tiny plan.
KINDS: dict[str, dict[str, object]] = {
    "dflash": {},
    "domino": {"emb_dim": 16, "gru_hidden_dim": 8},
    "dspark": {"markov_rank": 4, "use_confidence_head": True},
    "dflash2": {
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 4,
        "selector_top_k": 4,
        "selector_loss_alpha": 0.1,
    },
}


def _hub_plan(tmp_path: Path, **overrides: object) -> RunPlan:
    """A tiny plan whose target and data lie in Hugging Face cache folders."""
    target = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abcd"
    data = tmp_path / "hub" / "datasets--acme--chats" / "snapshots" / "4567ef01" / "train.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n', encoding="utf-8")
    held_out = tmp_path / "eval" / "heldout.jsonl"
    held_out.parent.mkdir()
    held_out.write_text('{"messages": [{"role": "user", "content": "yo"}]}\n', encoding="utf-8")
    return tiny_plan(
        tmp_path, path=str(target), data_path=str(data), eval_data_path=str(held_out), **overrides
    )


def _export(plan: RunPlan, out: Path) -> tuple[dict[str, object], str]:
    export_drafter(DFlashDraftModel(plan.resolved_draft()), plan, out)
    text = (out / CARD_FILE).read_text(encoding="utf-8")
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert isinstance(meta, dict)
    return meta, text


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_gets_hub_front_matter_and_the_prose(kind: str, tmp_path: Path) -> None:
    card = CardPlan(description="A drafter for the demo.", license="apache-2.0")
    plan = attrs.evolve(_hub_plan(tmp_path, projector_type=kind, **KINDS[kind]), card=card)
    meta, text = _export(plan, tmp_path / "export")
    assert meta["base_model"] == "Qwen/Qwen3-8B"  # from the target's cache folder
    assert meta["license"] == "apache-2.0"
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    tags = meta["tags"]
    assert isinstance(tags, list)
    assert {"dflash", "speculative-decoding", kind} <= set(tags)
    assert meta["datasets"] == ["acme/chats"]
    # The prose: what it is, how it was trained, what it measured.
    assert "A drafter for the demo." in text
    spec = plan.resolved_draft()
    assert f"| kind | {spec.head_description} |" in text
    assert f"| taps (target_layer_ids) | {json.dumps(list(spec.target_layer_ids))} |" in text
    assert f"| mask token id | {spec.mask_token_id} |" in text
    data = Path(str(plan.data.data_path))
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    assert f"| `train.jsonl` | training | {data.stat().st_size:,} | `{digest}` |" in text
    assert f"`{plan.fingerprint}`" in text
    objective, training = plan.draft.objective, plan.training
    assert (
        "- Objective: cross-entropy with decay position weights "
        f"exp(-(k-1)/{objective.loss_decay_factor:g}); {objective.num_anchors} blocks per sequence"
    ) in text
    # the kind's own loss terms: Domino's and DSpark's weights, DFlash 2's selector settings
    own = {
        "dflash": "blocks per sequence.",
        "domino": "domino_backbone_loss_weight 1.",
        "dspark": "dspark_tv_weight 1; dspark_confidence_weight 0.1.",
        "dflash2": "selector_loss_alpha 0.1; selector_missing_gold skip.",
    }
    line = next(line for line in text.splitlines() if line.startswith("- Objective:"))
    assert line.endswith(own[kind]), line
    assert (
        f"- Optimiser: AdamW, learning rate {training.learning_rate:g}, "
        f"{training.lr_scheduler_type} schedule, warmup ratio {training.warmup_ratio:g}"
    ) in text
    assert "## What it measured\n\nNot measured." in text
    # the card and its data are part of the export (an earlier export, replaceable)
    marker = json.loads((tmp_path / "export" / EXPORT_MARKER).read_text(encoding="utf-8"))
    assert {CARD_FILE, CARD_DATA_FILE} <= set(marker["files"])


def test_without_a_hub_id_the_card_leaves_base_model_out(tmp_path: Path) -> None:
    # A local target whose Hub id is unknown: no guessed id (the Hub refuses unknown ones).
    meta, text = _export(tiny_plan(tmp_path), tmp_path / "export")
    assert "base_model" not in meta and "datasets" not in meta and "license" not in meta
    assert "`TARGET` is the target (`target`)" in text
    explicit = attrs.evolve(
        tiny_plan(tmp_path), card=CardPlan(base_model="acme/Target-1B", datasets=("acme/d",))
    )
    meta, _ = _export(explicit, tmp_path / "again")
    assert meta["base_model"] == "acme/Target-1B" and meta["datasets"] == ["acme/d"]


@pytest.mark.parametrize("block_size", [4, 10, 16])
def test_serving_lines_carry_the_block_sizes_speculative_token_counts(
    block_size: int, tmp_path: Path
) -> None:
    plan = _hub_plan(tmp_path, block_size=block_size)
    _, text = _export(plan, tmp_path / "export")
    vllm = next(line for line in text.splitlines() if line.startswith("vllm serve"))
    config = json.loads(vllm.split("--speculative-config ")[1].strip("'"))
    assert config == {
        "method": "dflash",
        "model": "DRAFTER",
        "num_speculative_tokens": block_size - 1,
    }
    assert vllm.startswith("vllm serve Qwen/Qwen3-8B ")
    sglang = next(line for line in text.splitlines() if "sglang.launch_server" in line)
    assert sglang.endswith(f"--speculative-num-draft-tokens {block_size}")
    assert "--speculative-algorithm DFLASH" in sglang


def test_no_path_of_the_training_machine_appears(tmp_path: Path) -> None:
    warm = tmp_path / "released" / "export"
    plan = _hub_plan(tmp_path)
    plan = attrs.evolve(
        plan,
        data=attrs.evolve(plan.data, hidden_states_path=str(tmp_path / "capture")),
        init_checkpoint=InitCheckpointPlan(path=str(warm), tensor_count=25),
        card=CardPlan(description="Trained on our chats."),
    )
    metrics = Path(plan.training.output_dir) / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    settings = {
        "prompt_file": str(tmp_path / "eval" / "heldout.jsonl"),
        "chat_template_source": f"data.chat_template {tmp_path / 'tpl' / 'chat.jinja'}",
    }
    row = {"kind": "eval", "step": 3, "tau": 2.0, "block_size": 4, "settings": settings}
    metrics.write_text(json.dumps(row) + "\n", encoding="utf-8")
    out = tmp_path / "export"
    _, text = _export(plan, out)
    data = (out / CARD_DATA_FILE).read_text(encoding="utf-8")
    for written in (text, data):
        assert str(tmp_path) not in written
        assert "/" + tmp_path.parts[1] + "/" not in written  # not even another /tmp path
    # ... while the names that replace the paths are there.
    assert "`heldout.jsonl`" in text and "data.chat_template chat.jinja" in text
    assert "`export`" in text and "(`capture`)" in text  # the warm start, the capture folder


def test_a_reexport_regenerates_the_card(tmp_path: Path) -> None:
    out = tmp_path / "export"
    first = attrs.evolve(tiny_plan(tmp_path), card=CardPlan(description="first words"))
    _export(first, out)
    second = attrs.evolve(
        tiny_plan(tmp_path, block_size=8), card=CardPlan(description="second words")
    )
    _, text = _export(second, out)
    assert "first words" not in text and "second words" in text
    assert text.count("## What it is") == 1 and text.count("---\n") == 2
    assert "| block size | 8 (7 proposals per verification step) |" in text
    facts = parse_card_data((out / CARD_DATA_FILE).read_text(encoding="utf-8"))
    assert render_card(facts) == text  # the card is its data, rendered
