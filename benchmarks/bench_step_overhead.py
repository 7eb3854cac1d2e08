"""Per-step fixed costs of a training step: before/after, and against a plain PyTorch step.

    python benchmarks/bench_step_overhead.py [--shapes tiny medium] [--rounds 0]
        [--threads 1]

Shapes (issue 15): ``tiny`` = seq 128, batch 2, 8 anchors, block 8, target 8 layers x 64,
drafter 2 layers x 64; ``medium`` = seq 1024, batch 2, 128 anchors, block 16, target 8 x 256,
drafter 2 x 256; ``medium512`` = medium with 512 anchors. Targets are random Qwen3 models
written to a temporary folder; data is random, fully supervised, unpadded.

Three steps, each with its own copy of the same drafter, run in interleaved rounds (the order
rotates every round, so a noisy neighbour slows all three alike); figures are medians:

- ``before``: the old settings reproduced here: one sha256-seeded generator and one
  ``sample_anchors`` call per row, the split mask at a fixed 8 chunks, the per-tensor-loop
  gradient clipping and AdamW (``foreach=False``), the loss's old ``log_softmax`` + ``gather``
  cross-entropy and ``argmax`` accuracy, and the old per-step host syncs (loss, counts,
  gradient norm and tokens read back every step); the old step's always-built prefix tokens
  are gone from the code and no longer reproduced;
- ``after``: what ``run`` runs, through the step library (issue 53): the step from
  ``train_step.build_step`` (the target loaded from the plan, the drafter, AdamW and the
  schedule), ``prepare_rows`` (anchors and the split mask through the prefetch thread's
  function; the loop runs it on that thread, here it runs inside the step), then
  ``optimizer_step`` (``step_inputs``, ``DraftStep``, backward, clipping, the non-finite
  guard, AdamW, the schedule) and the trainer's metric window;
- ``plain``: a plain PyTorch step written here: the same target forward, anchors from one
  ``torch.rand`` + ``topk``, one packed drafter forward under the dense block mask, lm_head,
  the decay-weighted cross-entropy, backward, ``clip_grad_norm_`` and a default ``AdamW``
  (not at ``medium512``, where its dense mask would take minutes per step).

Each step is split into target forward, drafter forward (fusion, drafter, lm_head, loss),
backward, optimizer (clipping, AdamW, zero_grad, scheduler) and everything else (anchors, mask,
embeddings, labels, metrics). In ``after`` nothing of the step is replaced: the target forward
is the one phase function wrapped (``step.target_states``, as in the other two), the drafter
forward is timed by forward hooks on the step module, the backward ends at the last gradient
accumulated (parameter hooks), and the optimizer phase runs from there to the end of
``optimizer_step`` (its ``zero_grad``, at the start, counts as everything else).

Targets: at ``tiny`` the project's step is no slower than the plain step within 5%
(plain / after >= 0.95); at the medium shapes after is no slower than
before (before / after >= 1, within the same 5% of noise).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from _measure import print_table, verdict
from torch import Tensor, nn

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.executor.data.train_dataset import Batch
from dflash_recipes.executor.dist_env import detect_dist_env
from dflash_recipes.executor.kinds import dflash as dflash_kind
from dflash_recipes.executor.model.convert import (
    embed_tokens,
    lm_head,
)
from dflash_recipes.executor.model.masks import build_dense_block_mask, build_split_block_mask
from dflash_recipes.executor.model.target_states import target_states
from dflash_recipes.executor.training import loss as loss_module
from dflash_recipes.executor.training import metrics as metrics_module
from dflash_recipes.executor.training import step as step_module
from dflash_recipes.executor.training.anchors import (
    AnchorBatch,
    block_inputs,
    block_labels,
    sample_anchors,
)
from dflash_recipes.executor.training.step import DraftStep, step_inputs
from dflash_recipes.executor.training.train_step import (
    TrainStep,
    build_step,
    optimizer_step,
    prepare_rows,
)
from dflash_recipes.plan.attention_chunks import split_chunk_count

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny" / "tiny_scratch.yaml"
VOCAB = 512
MASK_TOKEN = VOCAB - 1
PHASES = ("target forward", "drafter forward", "backward", "optimizer", "everything else")

#: name -> (seq, batch, anchors, block, width, target layers, heads, rounds)
SHAPES: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (128, 2, 8, 8, 64, 8, 4, 40),
    "medium": (1024, 2, 128, 16, 256, 8, 4, 6),
    "medium512": (1024, 2, 512, 16, 256, 8, 4, 3),
}


class Timer:
    """Seconds per phase of one step; the phase's clock runs while its block runs."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.started: dict[str, float] = {}

    def start(self, name: str, at: float | None = None) -> None:
        self.started[name] = time.perf_counter() if at is None else at

    def stop(self, name: str, at: float | None = None) -> None:
        ended = time.perf_counter() if at is None else at
        self.spent[name] += ended - self.started.pop(name)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.spent[name] += time.perf_counter() - started


_current: list[Timer] = []


def _timed_target_states(*args: object, **kwargs: object) -> object:
    """The trainer's target_states, timed as the ``target forward`` phase."""
    with _current[-1].phase("target forward"):
        return target_states(*args, **kwargs)  # type: ignore[arg-type]


def _make_target(directory: Path, width: int, layers: int, heads: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=width // heads,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)


class Shape:
    """One shape's target, drafters, batch and the three step functions."""

    def __init__(self, name: str, folder: Path) -> None:
        seq, batch, anchors, block, width, layers, heads, _ = SHAPES[name]
        self.name = name
        target_dir = folder / name
        _make_target(target_dir, width, layers, heads)
        result = compile_file(
            RECIPE,
            overrides=(
                f"model.model_name_or_path={target_dir}",
                "training.output_dir=/tmp/dflash-bench-unused",
                "training.max_steps=1000",
                f"training.per_device_train_batch_size={batch}",
                f"training.training_seq_len={seq}",
                f"dflash.dflash_block_size={block}",
                f"dflash.dflash_num_anchors={anchors}",
                f"dflash.dflash_mask_token_id={MASK_TOKEN}",
                "dflash.dflash_architecture_config.num_hidden_layers=2",
                f"dflash.dflash_architecture_config.num_attention_heads={heads}",
                f"dflash.dflash_architecture_config.num_key_value_heads={max(1, heads // 2)}",
                f"dflash.dflash_architecture_config.head_dim={width // heads}",
                f"dflash.dflash_architecture_config.intermediate_size={2 * width}",
            ),
        )
        assert result.plan is not None, result.diagnostics
        self.plan = result.plan
        self.spec = self.plan.resolved_draft()
        self.objective = self.plan.draft.objective
        self.env = detect_dist_env("cpu", {})
        # The measured step, built as run builds it (the target from the plan's folder).
        self.train: TrainStep = build_step(self.plan, env=self.env)
        self.train.models.training_modes()
        self.model = self.train.models.target
        drafter = self.train.models.drafter
        self.head = lm_head(self.model)
        self.embed = embed_tokens(self.model)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(3, MASK_TOKEN, (batch, seq), generator=gen)
        ones = torch.ones_like(ids)
        self.batch = Batch(ids, ones, ones.clone(), epoch=0, next_index=batch)
        self.seq, self.anchors, self.block, self.heads = seq, anchors, block, heads
        # The baselines' own copies of the same (untrained) drafter.
        self.drafters = {v: copy.deepcopy(drafter) for v in ("before", "plain")}
        for d in self.drafters.values():
            d.train(True)
        lr, wd = self.plan.training.learning_rate, self.plan.training.weight_decay

        def params(variant: str) -> list[nn.Parameter]:
            return [p for p in self.drafters[variant].parameters() if p.requires_grad]

        self.params = {v: params(v) for v in self.drafters}
        self.optimizers: dict[str, torch.optim.Optimizer] = {
            "before": torch.optim.AdamW(
                self.params["before"], lr=lr, weight_decay=wd, foreach=False
            ),
            "plain": torch.optim.AdamW(self.params["plain"], lr=lr, weight_decay=wd),
        }
        self.schedulers = {
            v: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0)
            for v, o in self.optimizers.items()
        }
        self.steps = {"before": DraftStep(self.drafters["before"], self.head, self.objective)}
        self.window = metrics_module.MetricWindow(block)
        self.step_count = 0
        self._hook_after_phases()

    def _hook_after_phases(self) -> None:
        """Timing hooks on the measured step (nothing of it replaced): the step module's
        forward, and each trainable parameter's gradient accumulation (the backward's end)."""
        models = self.train.models

        def forward_started(_module: nn.Module, _args: object) -> None:
            _current[-1].start("drafter forward")

        def forward_ended(_module: nn.Module, _args: object, _out: object) -> None:
            timer = _current[-1]
            timer.stop("drafter forward")
            timer.start("backward")

        def accumulated(_param: Tensor) -> None:
            self.backward_ended = time.perf_counter()

        models.step.register_forward_pre_hook(forward_started)
        models.step.register_forward_hook(forward_ended)
        for param in models.trainable:
            param.register_post_accumulate_grad_hook(accumulated)  # type: ignore[no-untyped-call]
        self.backward_ended = 0.0

    def describe(self) -> str:
        spec = self.spec
        chunks = split_chunk_count(
            self.batch.input_ids.shape[0],
            self.anchors,
            self.block,
            self.seq,
            heads=spec.num_attention_heads,
        )
        return (
            f"{self.name}: seq {self.seq}, batch {self.batch.input_ids.shape[0]}, "
            f"{self.anchors} anchors, block {self.block}, target {spec.num_target_layers} x "
            f"{spec.hidden_size}, drafter {spec.num_hidden_layers} x {spec.hidden_size} "
            f"({spec.num_attention_heads} heads), vocab {spec.vocab_size}; split attention: "
            f"{chunks} chunk(s) now, 8 before"
        )

    # -- the three steps ------------------------------------------------------------------------

    def run(self, variant: str) -> tuple[dict[str, float], float, float]:
        """One step of `variant`: (seconds per phase, total seconds, loss)."""
        timer = Timer()
        _current.append(timer)
        started = time.perf_counter()
        try:
            if variant == "plain":
                loss = self._plain(timer)
            else:
                loss = self._project(timer, before=variant == "before")
        finally:
            _current.pop()
        total = time.perf_counter() - started
        spent = dict(timer.spent)
        spent["everything else"] = total - sum(
            v for k, v in spent.items() if k != "everything else"
        )
        return spent, total, loss

    def _project(self, timer: Timer, *, before: bool) -> float:
        if before:
            return self._before(timer)
        # What run runs: the rows prepared as the prefetch thread prepares them (here inside
        # the step), then one optimiser step of one micro-batch; the hooks split it.
        rows = self.batch
        prepared = prepare_rows(
            self.train,
            rows.input_ids,
            rows.loss_mask,
            epoch=rows.epoch,
            next_index=rows.next_index,
        )
        out = optimizer_step(self.train, [prepared], index=self.step_count)
        ended = time.perf_counter()
        timer.stop("backward", at=self.backward_ended)
        timer.start("optimizer", at=self.backward_ended)
        timer.stop("optimizer", at=ended)
        self.window.add_step(out.micro, out.grad_norm)  # as fit's loop does
        self.step_count += 1
        return float(out.loss)

    def _before(self, timer: Timer) -> float:
        """The step as the trainer ran it before issue 15 (see the module docstring)."""
        batch, spec, objective = self.batch, self.spec, self.objective
        anchors, valid = _old_batch_anchors(batch, spec.block_size, objective.num_anchors)
        step_module.build_split_block_mask = _eight_chunks  # type: ignore[assignment]
        try:
            inputs = step_inputs(
                self.model,
                spec,
                objective,
                batch,
                AnchorBatch(anchors=anchors, valid=valid),
                step=self.step_count,
                total_steps=1000,
            )
        finally:
            step_module.build_split_block_mask = build_split_block_mask
        # The kind's objective calls token_ce by the name it imported; the counts live in loss.
        new_ce, new_counts = dflash_kind.token_ce, loss_module._position_counts
        dflash_kind.token_ce, loss_module._position_counts = _old_token_ce, _old_counts
        try:
            with timer.phase("drafter forward"):
                out = self.steps["before"](inputs)
        finally:
            dflash_kind.token_ce, loss_module._position_counts = new_ce, new_counts
        local = out.weight_sum
        scale = local / local if float(local) > 0 else torch.ones_like(local)
        loss = out.loss * scale
        with timer.phase("backward"):
            loss.backward()  # type: ignore[no-untyped-call]
        # The old window: every value read back to the host every micro-step.
        _ = float(out.loss.detach())
        _ = out.per_position_correct.detach().cpu(), out.per_position_count.detach().cpu()
        _ = int(batch.attention_mask.sum())
        self.drafters["before"].train(True)  # the old loop set the modes every step
        self.model.train(False)
        with timer.phase("optimizer"):
            params = self.params["before"]
            _ = float(torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False))
            self.optimizers["before"].step()
            self.schedulers["before"].step()
            self.optimizers["before"].zero_grad(set_to_none=True)
        self.step_count += 1
        return float(out.loss.detach())

    def _plain(self, timer: Timer) -> float:
        spec = self.spec
        ids, attention = self.batch.input_ids, self.batch.attention_mask
        block, n = spec.block_size, self.objective.num_anchors
        drafter = self.drafters["plain"]
        with torch.no_grad():
            with timer.phase("target forward"):
                taps = spec.target_layer_ids
                tapped = target_states(self.model, ids, attention, taps, with_logits=False).tapped
            # Anchors: one torch.rand + topk over the eligible positions (all of them here).
            seq = ids.shape[1]
            keys = torch.rand(ids.shape[0], seq - block)
            anchors = torch.topk(keys, n, dim=1, largest=False).indices.sort(dim=1).values
            valid = torch.ones_like(anchors, dtype=torch.bool)
            block_ids, q_pos = block_inputs(
                ids, anchors, valid, block_size=block, mask_token_id=spec.mask_token_id
            )
            embeds = self.embed(block_ids)
            mask = build_dense_block_mask(anchors, block, seq, valid)
            labels, label_mask = block_labels(
                ids, self.batch.loss_mask, anchors, valid, block_size=block
            )
            c_pos = torch.arange(seq).expand(ids.shape[0], seq)
            k = torch.arange(block, dtype=torch.float32)
            decay = torch.exp(-(k - 1) / self.objective.loss_decay_factor) * (k >= 1)
        with timer.phase("drafter forward"):
            context = drafter.fuse_context(tapped)
            hidden = drafter(embeds, context, q_pos, c_pos, mask)
            logits = self.head(hidden).view(ids.shape[0], n, block, -1)
            ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(
                labels
            )
            weights = decay * label_mask
            loss = (ce * weights).sum() / weights.sum()
        with timer.phase("backward"):
            loss.backward()  # type: ignore[no-untyped-call]
        with timer.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(self.params["plain"], 1.0)
            self.optimizers["plain"].step()
            self.optimizers["plain"].zero_grad(set_to_none=True)
        return float(loss.detach())


def _old_token_ce(logits: Tensor, labels: Tensor, label_mask: Tensor) -> Tensor:
    """The loss's per-position cross-entropy before issue 15 (log_softmax + gather)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    safe_labels = torch.where(label_mask, labels, torch.zeros_like(labels))
    nll = -torch.gather(log_probs, -1, safe_labels.unsqueeze(-1)).squeeze(-1)
    return torch.where(label_mask, nll, torch.zeros_like(nll))


def _old_counts(logits: Tensor, labels: Tensor, label_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The accuracy counts before issue 15 (argmax, slow on CPU)."""
    with torch.no_grad():
        hit = (logits.argmax(dim=-1) == labels) & label_mask
        k = labels.shape[-1]
        correct = hit.reshape(-1, k).sum(dim=0)
        count = label_mask.reshape(-1, k).sum(dim=0)
    return correct.long(), count.long()


def _eight_chunks(
    anchors: Tensor, block_size: int, ctx_len: int, valid: Tensor, **_: object
) -> object:
    """The split mask as it was before issue 15: always 8 chunks."""
    return build_split_block_mask(anchors, block_size, ctx_len, valid, num_chunks=8)


def _old_batch_anchors(batch: Batch, block_size: int, num_anchors: int) -> tuple[Tensor, Tensor]:
    """The trainer's anchor sampling before issue 15: one sha256-seeded generator per row."""
    rows = []
    for row in range(batch.input_ids.shape[0]):
        digest = hashlib.sha256(f"dflash-anchors:0:{batch.epoch}:{row}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        drawn = sample_anchors(
            batch.loss_mask[row : row + 1],
            batch.attention_mask[row : row + 1],
            block_size=block_size,
            num_anchors=num_anchors,
            generator=generator,
        )
        rows.append((drawn.anchors[0], drawn.valid[0]))
    width = max(1, max(int(a.shape[0]) for a, _ in rows))
    anchors = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for row, (a, v) in enumerate(rows):
        anchors[row, : a.shape[0]] = a
        valid[row, : v.shape[0]] = v
    return anchors, valid


def measure(shape: Shape, rounds: int, variants: list[str]) -> dict[str, dict[str, float]]:
    """Median seconds per phase and in total (key ``total``) of each variant."""
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for index in range(rounds + 2):  # two warm-up rounds
        turn = index % len(variants)
        order = variants[turn:] + variants[:turn]
        for variant in order:
            spent, total, _ = shape.run(variant)
            if index >= 2:
                samples[variant].append({**spent, "total": total})
    return {
        v: {k: statistics.median(s[k] for s in samples[v]) for k in (*PHASES, "total")}
        for v in variants
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "medium"])
    parser.add_argument("--rounds", type=int, default=0, help="rounds per shape (0: its default)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    step_module.target_states = _timed_target_states  # type: ignore[assignment]
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            shape = Shape(name, Path(tmp))
            rounds = args.rounds or SHAPES[name][-1]
            # The dense mask of 512 blocks of 16 is 8192 x 9216 per row: the plain step would
            # take minutes there, so that shape compares before and after only.
            variants = ["before", "after"] + (["plain"] if name != "medium512" else [])
            losses = {v: shape.run(v)[2] for v in variants}
            print(f"\n{shape.describe()}; {args.threads} thread(s), {rounds} interleaved rounds")
            print(
                "first-step loss (same weights, each its own anchors): "
                + ", ".join(f"{v} {value:.4f}" for v, value in losses.items())
            )
            median = measure(shape, rounds, variants)
            header = ["phase (ms)", "before", "after", "plain", "before/after"]
            rows = []
            for phase in (*PHASES, "total"):
                b, a = (median[v][phase] * 1e3 for v in ("before", "after"))
                p = f"{median['plain'][phase] * 1e3:.2f}" if "plain" in median else "-"
                rows.append([phase, f"{b:.2f}", f"{a:.2f}", p, _ratio(b, a)])
            print_table(header, rows)
            after = median["after"]
            share = after["everything else"] / after["total"]
            print(
                f"everything else: {share:.1%} of the step after, "
                f"{median['before']['everything else'] / median['before']['total']:.1%} before"
            )
            speedup = median["before"]["total"] / after["total"]
            vs_plain = median["plain"]["total"] / after["total"] if "plain" in median else math.nan
            if name == "tiny":
                ok = vs_plain >= 0.95
                outcomes.append(
                    f"{name}: after {speedup:.2f}x before; plain / after = {vs_plain:.2f} "
                    f"(target >= 0.95: {verdict(ok)})"
                )
            else:
                ok = speedup >= 0.95
                plain = f"{vs_plain:.2f}" if math.isfinite(vs_plain) else "not run"
                outcomes.append(
                    f"{name}: before / after = {speedup:.2f} (no regression, target >= 0.95: "
                    f"{verdict(ok)}); plain / after = {plain}"
                )
    print()
    for line in outcomes:
        print(line)


def _ratio(before: float, after: float) -> str:
    return f"{before / after:.2f}x" if after > 0 and math.isfinite(before / after) else "-"


if __name__ == "__main__":
    main()
