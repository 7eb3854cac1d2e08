"""A run directory with a metrics.jsonl written by the schema helpers, for report tests."""

from __future__ import annotations

import json
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run: Path, accuracies: list[float], *, with_eval: bool) -> Path:
    run.mkdir(parents=True)
    rows = []
    for step in (10, 20, 30):
        acc = [0.0] + [a * step / 30 for a in accuracies]
        rows.append(
            {
                "kind": "train",
                "step": step,
                "loss": 5.0 / step,
                "lr": 1e-4,
                "accuracy_by_position": acc,
                "train_batch_tau_estimate": 1.0 + sum(acc[1:]),
                "tokens_per_second": 1000.0,
            }
        )
    if with_eval:
        rows.append({"kind": "eval", "step": 30, "tau": 2.5, "lossless": True})
    rows.append({"kind": "summary", "steps": 30})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run
