"""Whole-process `dflash-recipe lint` over 200 generated recipes (target < 2 s).

The recipes vary what lint checks (block sizes, draft dims, taps, head variants, loss
settings, overrides of most sections) and are all clean, so the run exits 0. Baselines
measured in the same run, interleaved: `python -c pass` and `dflash-recipe lint` of one recipe
(start-up plus one file), from which the cost per extra file follows.

Usage: python benchmarks/bench_lint.py [--repeats 7] [--count 200]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from _measure import (
    Command,
    dflash_recipe_argv,
    interleaved,
    median_rss_mb,
    median_seconds,
    print_table,
    verdict,
)

TARGET_SECONDS = 2.0


def recipe_text(index: int, rng: random.Random) -> str:
    """A clean recipe, different from its neighbours in what lint checks."""
    heads = rng.choice([8, 16, 32])
    kv = rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0])
    layers = rng.randint(1, 6)
    taps = sorted(rng.sample(range(36), k=rng.randint(1, 6)))
    block = rng.choice([4, 8, 10, 16, 24, 32])
    projector = ("dflash", "domino", "dspark")[index % 3]
    lines = [
        f"# generated recipe {index}",
        f"#   dflash-recipe lint recipes/r{index:03d}.yaml",
        "model:",
        f"  model_name_or_path: /hf-local/models/target-{index % 7}",
        f"  dtype: {rng.choice(['bfloat16', 'float16', 'float32'])}",
        "  trust_remote_code: false",
        "data:",
        f"  data_path: /data/train-{index}.jsonl",
        "  chat_template: null",
        f"  answer_only_loss: {rng.choice(['true', 'false'])}",
        "training:",
        f"  output_dir: /scratch/run-{index}",
        f"  learning_rate: {rng.choice(['1.0e-4', '6e-4', '3.0e-4'])}",
        f"  num_train_epochs: {rng.randint(1, 6)}",
        f"  max_steps: {rng.choice(['null', '1000', '20000'])}",
        f"  per_device_train_batch_size: {rng.randint(1, 8)}",
        f"  gradient_accumulation_steps: {rng.randint(1, 4)}",
        f"  training_seq_len: {rng.choice([2048, 3072, 4096])}",
        f"  warmup_ratio: {rng.choice(['0.0', '0.04', '0.1'])}",
        f"  lr_scheduler_type: {rng.choice(['cosine', 'linear', 'constant'])}",
        "  max_grad_norm: 1.0",
        "  weight_decay: 0.0",
        f"  seed: {index}",
        "  save_steps: 5000",
        "  save_total_limit: 2",
        "  logging_steps: 100",
        "dflash:",
    ]
    if index % 2:
        lines.append(f"  dflash_init_checkpoint: /hf-local/drafters/d{index}")
    lines += [
        f"  dflash_block_size: {block}",
        f"  dflash_mask_token_id: {rng.randint(1000, 151935)}",
        f"  dflash_num_anchors: {rng.choice([128, 256, 512])}",
        f"  dflash_loss_objective: {rng.choice(['decay', 'dpace'])}",
        f"  dflash_dpace_alpha: {rng.choice(['0.5', '1.0', '0.25'])}",
        f"  dflash_self_logit_distillation: {rng.choice(['true', 'false'])}",
        "  dflash_architecture_config:",
        f"    num_hidden_layers: {layers}",
        f"    num_attention_heads: {heads}",
        f"    num_key_value_heads: {kv}",
        f"    head_dim: {rng.choice([64, 128])}",
        f"    intermediate_size: {rng.choice([4096, 9728, 12288])}",
        "    rms_norm_eps: 1.0e-6",
        f"    target_layer_ids: [{', '.join(str(t) for t in taps)}]",
        f"    projector_type: {projector}",
        f"    attention_sink: {rng.choice(['true', 'false'])}",
    ]
    if projector == "domino":
        lines += ["    emb_dim: 256", "    gru_hidden_dim: 1024"]
    elif projector == "dspark":
        confidence = rng.choice(["true", "false"])
        lines += ["    markov_rank: 256", f"    use_confidence_head: {confidence}"]
    return "\n".join(lines) + "\n"


def write_recipes(folder: Path, count: int) -> None:
    rng = random.Random(0)
    for index in range(count):
        path = folder / f"family-{index % 10}" / f"r{index:03d}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(recipe_text(index, rng), encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()

    cli = dflash_recipe_argv()
    all_name = f"dflash-recipe lint recipes/ ({args.count} files)"
    one_name = "dflash-recipe lint recipes/family-0/r000.yaml"
    commands = {
        "python -c pass": Command([sys.executable, "-c", "pass"]),
        one_name: Command([*cli, "lint", "recipes/family-0/r000.yaml"]),
        all_name: Command([*cli, "lint", "recipes/"]),
    }
    with tempfile.TemporaryDirectory(prefix="bench-lint-") as tmp:
        workdir = Path(tmp)
        write_recipes(workdir / "recipes", args.count)
        samples = interleaved(commands, workdir, args.repeats)

    base = median_seconds(samples["python -c pass"])
    rows = [
        [
            name,
            f"{median_seconds(runs):.3f}",
            f"{min(s.seconds for s in runs):.3f}",
            f"{median_seconds(runs) / base:.2f}x",
            f"{median_rss_mb(runs):.1f}",
        ]
        for name, runs in samples.items()
    ]
    print(f"whole-process times, median of {args.repeats} interleaved runs ({' '.join(cli)})")
    print_table(["command", "median s", "min s", "/ pass", "peak RSS MB"], rows)
    all_s, one_s = median_seconds(samples[all_name]), median_seconds(samples[one_name])
    per_file_ms = (all_s - one_s) / (args.count - 1) * 1000
    print()
    print(
        f"lint of {args.count} recipes: {all_s:.3f} s whole process (target < {TARGET_SECONDS} s:"
        f" {verdict(all_s < TARGET_SECONDS)}); {per_file_ms:.2f} ms per extra recipe, "
        f"start-up and one recipe {one_s:.3f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
