"""The memory estimate follows the precision choices, the step's chunk budget and the taps-only
target forward, each by the amount the shapes give; and it lands within 10% of what the H200
measured at gpu_check's step shape (../shared/gpu-h200-2026-12/README.md)."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest
from testkit.fixture_8b import make_fixture, seed_8b_plan

from dflash_recipes.checkpoint.tensor_layout import expected_layout, layout_spec_for
from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.plan.resources.chunk_budget import MAX_CHUNK_LOGITS
from dflash_recipes.plan.resources.estimate import (
    GIB,
    TargetDims,
    decoder_layer_index,
    estimate_resources,
    read_target_dims,
    target_dims,
)
from dflash_recipes.plan.run_plan import RunPlan

ROOT = Path(__file__).resolve().parents[3]
TINY_SCRATCH = ROOT / "recipes" / "tiny" / "tiny_scratch.yaml"


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_8b_precision")
    make_fixture(out, target_weights=True)
    return out


def _plan(fixture: Path, *extra: str) -> RunPlan:
    return seed_8b_plan(fixture, *extra)


def _drafter_numel(plan: RunPlan) -> tuple[int, int]:
    """Parameters and tensors of the plan's drafter, from its layout."""
    facts = plan.base_model.facts
    taps = plan.draft.target_layer_ids
    assert facts is not None and taps is not None
    spec = layout_spec_for(
        plan.draft.architecture,
        hidden_size=facts.hidden_size,
        n_taps=len(taps),
        vocab_size=facts.vocab_size,
    )
    layout = expected_layout(spec)
    return sum(math.prod(shape) for shape in layout.values()), len(layout)


# ---------------------------------------------------------------------------------------------
# the master dtype
# ---------------------------------------------------------------------------------------------


def test_a_bfloat16_master_halves_weights_gradients_and_adam_moments(qwen3_8b: Path) -> None:
    f32 = estimate_resources(_plan(qwen3_8b))
    bf16 = estimate_resources(_plan(qwen3_8b, "training.drafter_master_dtype=bfloat16"))
    numel, tensors = _drafter_numel(_plan(qwen3_8b))
    assert (f32.memory.drafter_weights, bf16.memory.drafter_weights) == (4 * numel, 2 * numel)
    assert (f32.gradient_bytes, bf16.gradient_bytes) == (4 * numel, 2 * numel)
    # two moments in the parameters' dtype, one float32 step counter per tensor
    assert f32.memory.optimizer_states == 8 * numel + 4 * tensors
    assert bf16.memory.optimizer_states == 4 * numel + 4 * tensors
    assert f32.memory.target_weights == bf16.memory.target_weights


def test_a_bfloat16_master_under_bf16_autocast_saves_no_weight_copies(qwen3_8b: Path) -> None:
    """What the drafter saves shrinks by autocast's weight copies and the activations that
    follow the weights' dtype (residual stream, norms, roped q/k), computed from the shapes."""
    plan = _plan(qwen3_8b)
    f32 = estimate_resources(plan).activation_parts
    bf16 = estimate_resources(_plan(qwen3_8b, "training.drafter_master_dtype=bfloat16"))
    arch, training = plan.draft.architecture, plan.training
    facts = plan.base_model.facts
    assert facts is not None and arch.num_hidden_layers is not None
    assert arch.num_attention_heads is not None and arch.num_key_value_heads is not None
    assert arch.head_dim is not None
    numel, _ = _drafter_numel(plan)
    b, t, h = training.per_device_train_batch_size, training.training_seq_len, facts.hidden_size
    q = plan.draft.objective.num_anchors * plan.draft.block_size
    qd = q * arch.num_attention_heads * arch.head_dim
    kvd = (t + q) * arch.num_key_value_heads * arch.head_dim
    per_layer = b * (
        q * h * 2  # input norm's normed states: 4 -> 2 bytes
        + (t + q) * h * 2  # [context ; x]: one bf16 tensor for k and v, not two casts
        + q * h * 2 * 2  # post-attention norm: normed 4 -> 2, one cast fewer for gate/up
        + qd * 2 * 2  # roped q and the attention output: 4 -> 2 bytes
        + kvd * 2  # roped k
    )
    once = b * q * h * 2  # the final norm's normed states
    saved = numel * 2 + arch.num_hidden_layers * per_layer + once
    assert f32.drafter_saved - bf16.activation_parts.drafter_saved == saved
    assert f32.step_inputs == bf16.activation_parts.step_inputs  # taps stay float32 + a bf16 copy


def test_a_float16_target_is_autocast_like_a_bfloat16_one(qwen3_8b: Path) -> None:
    bf16 = estimate_resources(_plan(qwen3_8b)).activation_parts
    fp16 = estimate_resources(_plan(qwen3_8b, "model.dtype=float16")).activation_parts
    fp32 = estimate_resources(_plan(qwen3_8b, "model.dtype=float32")).activation_parts
    assert fp16 == bf16
    assert fp32.drafter_saved > bf16.drafter_saved  # float32 matmuls, no autocast


# ---------------------------------------------------------------------------------------------
# the chunk budget
# ---------------------------------------------------------------------------------------------


def _loss_bytes(plan: RunPlan, rows: int) -> int:
    """A chunk of `rows` block positions: bf16 logits, float32 logits, log-probabilities and one
    gradient per logit, and the rows' bf16 states with their float32 gradient."""
    facts = plan.base_model.facts
    assert facts is not None
    return rows * (facts.vocab_size * (3 * 4 + 2) + facts.hidden_size * (2 + 4))


def test_the_loss_peak_is_one_chunk_of_the_steps_budget(qwen3_8b: Path) -> None:
    plan = _plan(qwen3_8b)
    facts = plan.base_model.facts
    assert facts is not None
    b = plan.training.per_device_train_batch_size
    k, n = plan.draft.block_size, plan.draft.objective.num_anchors
    per_block = b * k * facts.vocab_size
    # no device size: the fixed floor, as on CPU (27 blocks of 16 at a 152k vocabulary)
    floor = estimate_resources(plan)
    blocks = MAX_CHUNK_LOGITS // per_block
    assert blocks == 27
    assert floor.activation_parts.loss_peak == _loss_bytes(plan, blocks * b * k)
    # an override of one block's logits: one block per chunk
    one = estimate_resources(plan, chunk_logits=per_block)
    assert one.activation_parts.loss_peak == _loss_bytes(plan, b * k)
    # a 141 GiB device leaves room for every block in one chunk: no recompute
    whole = estimate_resources(plan, device_bytes=141 * GIB)
    assert whole.activation_parts.loss_peak == _loss_bytes(plan, n * b * k)
    recompute = 2 * n * b * k * facts.hidden_size * facts.vocab_size  # a second lm_head forward
    assert floor.step.drafter_flops - whole.step.drafter_flops == recompute
    assert whole.memory.total > floor.memory.total
    # a device too small for the step keeps the floor (the estimate then refuses it)
    small = estimate_resources(plan, device_bytes=24 * GIB)
    assert small.activation_parts.loss_peak == floor.activation_parts.loss_peak


def test_the_chunk_budget_only_sizes_from_a_cuda_device(qwen3_8b: Path) -> None:
    plan = _plan(qwen3_8b)
    cpu = estimate_resources(plan, device="cpu", device_bytes=141 * GIB)
    assert (
        cpu.activation_parts.loss_peak
        == estimate_resources(plan, device="cpu").activation_parts.loss_peak
    )


# ---------------------------------------------------------------------------------------------
# the taps-only target forward
# ---------------------------------------------------------------------------------------------


def _truncated(dims: TargetDims, layers: int) -> TargetDims:
    """The target without its decoder layers from `layers` on."""
    shapes = {
        name: shape
        for name, shape in dims.shapes.items()
        if (index := decoder_layer_index(name)) is None or index < layers
    }
    return attrs.evolve(dims, shapes=shapes, num_hidden_layers=layers)


def test_without_a_teacher_only_the_taps_are_kept_and_later_layers_never_run(
    qwen3_8b: Path,
) -> None:
    plan = _plan(qwen3_8b)
    taps = plan.draft.target_layer_ids
    assert taps == (1, 9, 17, 25, 33)
    full = read_target_dims(qwen3_8b / "base")
    assert full.num_hidden_layers == 36
    estimate = estimate_resources(plan, target=full)
    cut = estimate_resources(plan, target=_truncated(full, max(taps) + 1))
    # layers 34 and 35 cost nothing: no state held, no FLOP counted
    assert estimate.activation_parts.target_forward_peak == cut.activation_parts.target_forward_peak
    assert estimate.step.target_flops == cut.step.target_flops
    b, t = plan.training.per_device_train_batch_size, plan.training.training_seq_len
    bth, pd = b * t * full.hidden_size, 2
    layer_tmp = (
        b
        * t
        * pd
        * (
            3 * full.intermediate_size
            + 3 * full.hidden_size
            + 2 * full.num_attention_heads * full.head_dim
            + 2 * full.num_key_value_heads * full.head_dim
        )
    )
    kept = (len(taps) + 1) * bth * pd  # the five tapped outputs and the running layer's input
    expected = max(kept + layer_tmp, 2 * len(taps) * bth * pd)  # or the outputs and their concat
    assert estimate.activation_parts.target_forward_peak == expected


def test_a_teacher_objective_keeps_the_taps_and_the_logits(qwen3_8b: Path) -> None:
    plain = _plan(qwen3_8b)
    teacher = _plan(qwen3_8b, "dflash.dflash_self_logit_distillation=true")
    full = read_target_dims(qwen3_8b / "base")
    taps_only = estimate_resources(plain, target=full).activation_parts.target_forward_peak
    everything = estimate_resources(teacher, target=full).activation_parts.target_forward_peak
    b, t = plain.training.per_device_train_batch_size, plain.training.training_seq_len
    bth = b * t * full.hidden_size
    taps = plain.resolved_draft().target_layer_ids
    # hooks keep the tapped outputs (bf16) and the running layer's input; the logits in bf16
    kept = (len(taps) + 1) * bth * 2
    assert everything >= kept + b * t * full.vocab_size * 2
    # never every layer's output: no output_hidden_states on the teacher's path either
    assert everything < (full.num_hidden_layers + 1) * bth * 2 + b * t * full.vocab_size * 2
    assert everything > taps_only
    # and the whole target runs
    cut = _truncated(full, 34)
    assert (
        estimate_resources(teacher, target=full).step.target_flops
        > estimate_resources(teacher, target=cut).step.target_flops
    )


# ---------------------------------------------------------------------------------------------
# gradients at the peak
# ---------------------------------------------------------------------------------------------


def test_gradients_count_at_the_peak_only_when_they_outlive_a_micro_step(qwen3_8b: Path) -> None:
    one = estimate_resources(_plan(qwen3_8b))
    accumulated = estimate_resources(_plan(qwen3_8b, "training.gradient_accumulation_steps=2"))
    assert one.memory.gradients == 0
    assert accumulated.memory.gradients == one.gradient_bytes
    assert accumulated.memory.total - one.memory.total == one.gradient_bytes
    ddp = estimate_resources(_plan(qwen3_8b), world_size=2)
    assert ddp.memory.gradients == one.gradient_bytes  # DDP's buckets


# ---------------------------------------------------------------------------------------------
# against the H200's measurement
# ---------------------------------------------------------------------------------------------

#: gpu_check's `step` on the H200 (../shared/gpu-h200-2026-12/README.md and gpu_check.log):
#: torch.cuda.max_memory_allocated with the fixed chunk floor, and (step_variants.log) the peak
#: of the same step unchunked.
MEASURED_CHUNKED_GIB = 30.14
MEASURED_UNCHUNKED_GIB = 43.07


def _gpu_check_step_plan(tmp_path: Path) -> tuple[RunPlan, TargetDims]:
    """gpu_check's QWEN3_8B_DIMS step: a 5-layer Qwen3-8B drafter (5 taps) on a 6-layer
    Qwen3-8B-wide bf16 target, 1 x 4096 tokens, 512 anchors of 16, as its make_plan builds it."""
    result = compile_file(TINY_SCRATCH, overrides=(f"training.output_dir={tmp_path / 'x'}",))
    plan = result.plan
    assert plan is not None and plan.base_model.facts is not None
    hidden, vocab, seq, block = 4096, 151936, 4096, 16
    facts = attrs.evolve(
        plan.base_model.facts,
        hidden_size=hidden,
        num_hidden_layers=6,
        vocab_size=vocab,
        max_position_embeddings=seq + block,
    )
    arch = attrs.evolve(
        plan.draft.architecture,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
    )
    draft = attrs.evolve(
        plan.draft,
        block_size=block,
        mask_token_id=vocab - 1,
        target_layer_ids=(1, 2, 3, 4, 5),
        architecture=arch,
        objective=attrs.evolve(plan.draft.objective, num_anchors=512),
    )
    training = attrs.evolve(plan.training, per_device_train_batch_size=1, training_seq_len=seq)
    base = attrs.evolve(plan.base_model, facts=facts, dtype="bfloat16")
    plan = attrs.evolve(plan, base_model=base, draft=draft, training=training)
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": 6,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    return plan, target_dims(config)


def test_the_estimate_is_within_10_percent_of_the_h200_peak(tmp_path: Path) -> None:
    plan, target = _gpu_check_step_plan(tmp_path)
    chunked = estimate_resources(plan, world_size=1, device="cuda", target=target)
    estimated = (chunked.memory.total - chunked.memory.allowance) / GIB
    assert estimated / MEASURED_CHUNKED_GIB == pytest.approx(1.0, abs=0.10)
    unchunked = estimate_resources(
        plan, world_size=1, device="cuda", target=target, chunk_logits=2**62
    )
    estimated = (unchunked.memory.total - unchunked.memory.allowance) / GIB
    assert estimated / MEASURED_UNCHUNKED_GIB == pytest.approx(1.0, abs=0.10)
