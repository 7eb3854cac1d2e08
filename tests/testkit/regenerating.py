"""What the regenerate tests share: the demo target and data, the test server, recipes, plans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.plan.run_plan import RunPlan

ROOT = Path(__file__).resolve().parents[2]


TARGET = ROOT / "dflash_recipes" / "demo_data" / "target"


DOMAIN = ROOT / "dflash_recipes" / "demo_data" / "data" / "domain.jsonl"


SERVER = ROOT / "tools" / "openai_test_server.py"


class Server:
    def __init__(self, url: str) -> None:
        self.url = url

    def control(self, **knobs: object) -> None:
        httpx.post(f"{self.url}/control", json=knobs).raise_for_status()

    def stats(self) -> dict[str, int]:
        data = httpx.get(f"{self.url}/stats").json()
        assert isinstance(data, dict)
        return data


def _conversations(n: int) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in DOMAIN.read_text().splitlines()[:n]]
    for row in rows:  # the original answers, which the target would not give
        row["messages"][1]["content"] = "an answer from some other model"
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _recipe(tmp_path: Path, data: Path, *, name: str = "recipe.yaml", **regenerate: object) -> Path:
    lines = [f"    {k}: {json.dumps(v)}" for k, v in regenerate.items()]
    text = f"""
model: {{model_name_or_path: {TARGET}, dtype: float32}}
data: {{data_path: {data}}}
training:
  output_dir: {tmp_path / "run"}
  max_steps: 1
  per_device_train_batch_size: 2
  training_seq_len: 128
  device: cpu
  save_steps: 1
  logging_steps: 1
dflash:
  dflash_block_size: 4
  dflash_mask_token_id: 384
  dflash_num_anchors: 4
  dflash_architecture_config:
    num_hidden_layers: 1
    num_attention_heads: 4
    num_key_value_heads: 2
    head_dim: 32
    intermediate_size: 128
    target_layer_ids: [3]
regenerate:
    max_new_tokens: 48
{chr(10).join(lines)}
"""
    path = tmp_path / name
    path.write_text(text)
    return path


def _plan(recipe: Path, *overrides: str) -> RunPlan:
    result = compile_file(recipe, overrides)
    assert result.plan is not None, result.diagnostics
    return result.plan


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]
