"""What every reader takes from the frozen target: taps, the decoder stack, packed rows.

Checked on more than one family: the tiny Qwen3/Llama targets of testkit.tiny and the family
matrix's targets (testkit.families), whose sliding windows (8 tokens) and attention chunks are
shorter than the documents used here, so those layers are exercised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.families import FAMILIES, Family, build_target, missing_reason
from testkit.tiny import tiny_plan, tiny_target
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from dflash_recipes.compiler.codes import TARGET_NO_DECODER
from dflash_recipes.diagnostics import Severity, code_severity
from dflash_recipes.errors import CheckpointError, PlanError
from dflash_recipes.executor.model import target_states as target_module
from dflash_recipes.executor.model.convert import convert, lm_head
from dflash_recipes.executor.model.draft import taps_from_hidden_states
from dflash_recipes.executor.model.masks import document_causal_mask
from dflash_recipes.executor.model.target_states import (
    CAUSAL_SDPA,
    causal_attention,
    check_packed_isolation,
    decoder_layers,
    decoder_stack,
    document_position_ids,
    final_norm,
    isolation_lengths,
    stop_after_layer,
    target_states,
)

_BY_NAME = {family.name: family for family in FAMILIES}
#: Families whose layers carry a state from token to token: no mask isolates a document.
RECURRENT = {"qwen3_next"}


def _family(name: str) -> Family:
    family = _BY_NAME[name]
    reason = missing_reason(family)
    if reason is not None:
        pytest.skip(reason)
    return family


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_target_states_skips_the_lm_head_unless_logits_are_asked_for(
    tmp_path: Path, family: str
) -> None:
    plan = tiny_plan(tmp_path, target_model_type=family)
    model = convert(tiny_target(plan), plan)
    head_calls: list[int] = []
    lm_head(model).register_forward_hook(lambda *_: head_calls.append(1))
    ids = torch.randint(0, 100, (2, 12))
    attention = torch.ones_like(ids)
    attention[1, :3] = 0  # left padding is passed through
    taps = [0, 2]
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        head_calls.clear()
        states = target_states(model, ids, attention, taps, with_logits=False)
        assert head_calls == []  # no [B, S, vocab] product
        assert states.logits is None
        assert torch.equal(states.tapped, taps_from_hidden_states(full.hidden_states, taps))
        with_logits = target_states(model, ids, attention, taps, with_logits=True)
        assert head_calls == [1]
        assert with_logits.logits is not None
        assert torch.equal(with_logits.logits, full.logits)
        assert torch.equal(with_logits.tapped, states.tapped)


@pytest.mark.parametrize("name", ["qwen3", "llama", "gemma3_text", "llama4_text", "qwen3_next"])
def test_the_forward_stops_after_the_deepest_tap_without_raising_through_the_model(
    name: str,
) -> None:
    model = build_target(_family(name))
    layers = decoder_layers(model)
    taps = [len(layers) - 3, 0]
    calls: list[int] = []
    for k, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, k=k: calls.append(k))
    finished: list[str] = []  # FSDP2's root needs its post-forward: the forward must end
    decoder_stack(model).register_forward_hook(lambda *_: finished.append("decoder"))
    ids = torch.randint(0, 300, (2, 12))
    attention = torch.ones_like(ids)
    with torch.no_grad():
        reference = target_states(model, ids, attention, taps, with_logits=False).tapped
        calls.clear()
        finished.clear()
        stop = stop_after_layer(taps, needs_logits=False)
        ours = target_states(model, ids, attention, taps, with_logits=False, stop_after=stop)
    assert torch.equal(ours.tapped, reference)
    assert calls == list(range(max(taps) + 1))  # layers after the deepest tap never ran
    assert finished == ["decoder"]  # nothing raised through the model's modules
    assert model.config.num_hidden_layers == len(layers)  # the config is the model's again
    assert stop_after_layer(taps, needs_logits=True) is None  # logits need the whole target


def test_a_family_whose_loop_runs_every_layer_still_gives_the_same_taps() -> None:
    model = build_target(_family("gpt_oss"))  # its decoder loops over every layer
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        whole = target_states(model, ids, None, [0], with_logits=False).tapped
        cut = target_states(model, ids, None, [0], with_logits=False, stop_after=0).tapped
    assert torch.equal(whole, cut)


@pytest.mark.parametrize("name", ["qwen3", "llama", "gemma3_text", "gpt_oss", "deepseek_v3"])
def test_a_tap_on_the_last_layer_is_its_output_before_the_final_norm(name: str) -> None:
    # What vLLM (id num_hidden_layers) and SGLang feed a drafter; transformers'
    # output_hidden_states[-1] is after the final norm.
    model = build_target(_family(name))
    last = len(decoder_layers(model)) - 1
    ids = torch.randint(0, 300, (1, 20))
    attention = torch.ones_like(ids)
    seen: list[Tensor] = []
    final_norm(model).register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        seen.clear()
        tapped = target_states(model, ids, attention, [last], with_logits=False).tapped
    assert torch.equal(tapped, seen[0])  # the final norm's input: the residual stream
    assert not torch.allclose(tapped, full.hidden_states[-1])  # not the normed state
    assert torch.allclose(final_norm(model)(tapped), full.hidden_states[-1], atol=1e-5)
    with pytest.raises(ValueError, match="last layer: output_hidden_states"):
        taps_from_hidden_states(full.hidden_states, [0, last])


def test_llama4_decoder_layers_are_found_where_get_decoder_does_not_lead() -> None:
    model = build_target(_family("llama4_text"))
    assert model.get_decoder() is model  # transformers' own lookup answers with the model
    layers = decoder_layers(model)
    assert layers is model.model.layers  # type: ignore[union-attr]
    assert decoder_stack(model) is model.model


def test_a_model_without_a_decoder_stack_names_its_class_and_the_code() -> None:
    class Headless(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])

    with pytest.raises(CheckpointError) as raised:
        decoder_layers(Headless())
    # the code `dflash-recipe` documents with the compiler's (registered once, an error)
    assert str(raised.value).startswith(f"[{TARGET_NO_DECODER}] Headless has no decoder stack")
    assert code_severity("target-no-decoder") is Severity.ERROR


def _documents(lengths: tuple[int, ...], seed: int = 3) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 380, (1, n), generator=generator) for n in lengths]


def _packed_vs_alone(model: nn.Module, lengths: tuple[int, ...], taps: list[int]) -> list[float]:
    docs = _documents(lengths)
    document_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    with torch.no_grad():
        packed = target_states(
            model,  # type: ignore[arg-type]
            torch.cat(docs, dim=1),
            None,
            taps,
            with_logits=True,
            document_ids=document_ids,
        )
        errors, start = [], 0
        for ids in docs:
            alone = target_states(
                model,  # type: ignore[arg-type]
                ids,
                torch.ones_like(ids),
                taps,
                with_logits=True,
            )
            part = slice(start, start + ids.shape[1])
            for ours, theirs in ((packed.tapped, alone.tapped), (packed.logits, alone.logits)):
                assert ours is not None and theirs is not None
                errors.append(float((ours[:, part] - theirs).norm() / theirs.norm()))
            start += ids.shape[1]
    return errors


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.name not in RECURRENT])
def test_a_packed_row_gives_each_document_the_states_it_gets_alone(name: str) -> None:
    model = build_target(_family(name))
    last = len(decoder_layers(model)) - 1
    # documents longer than the windows and chunks (8 tokens), three of them, one very short;
    # the last the longest (a mask reading positions as indices is right on the first document)
    errors = _packed_vs_alone(model, (13, 3, 22), [0, 1, last])
    assert max(errors) < 1e-4, errors


def _old_packing(
    model: nn.Module, document_ids: Tensor, *, dtype: torch.dtype
) -> tuple[object, Tensor]:
    # What packing did before: one 4-D boolean block-diagonal mask for every layer.
    del model, dtype
    return document_causal_mask(document_ids), document_position_ids(document_ids)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "gpt_oss"])
def test_the_run_start_check_catches_a_packing_that_leaks(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Eager attention adds a boolean mask (no mask at all), and one mask for every layer drops
    # the sliding window: the silent failures of issue 48, re-created.
    model = build_target(_family(name))
    monkeypatch.setattr(target_module, "packed_attention", _old_packing)
    assert max(_packed_vs_alone(model, (21, 17), [0, 1])) > 0.05
    with pytest.raises(PlanError, match="packing would train on states the target never produces"):
        check_packed_isolation(model, [0, 1], with_logits=False)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "mixtral"])
def test_the_run_start_check_passes_and_says_what_it_cost(name: str) -> None:
    model = build_target(_family(name))
    report = check_packed_isolation(model, [0, 1], with_logits=True)
    assert report.worst <= report.tolerance == 1e-3  # float32's tolerance
    assert min(report.document_tokens) > 8  # longer than the 8-token windows and chunks
    line = report.describe()
    assert "packing isolation check" in line and " s)" in line


def test_a_recurrent_target_cannot_be_packed_and_says_which_layers() -> None:
    model = build_target(_family("qwen3_next"))
    with pytest.raises(PlanError, match=r"'linear_attention' layers \(Qwen3NextForCausalLM\)"):
        check_packed_isolation(model, [0, 1], with_logits=False)


def test_the_check_documents_cover_the_window_within_the_row() -> None:
    model = build_target(_family("gemma3_text"))
    first, second = isolation_lengths(model, limit=4096)
    assert first > 8 and second > 8  # past the 8-token sliding window
    assert sum(isolation_lengths(model, limit=20)) <= 20  # never more than a row


@pytest.mark.parametrize(
    ("name", "implementation"),
    [
        *((name, "eager") for name in ("llama", "mistral", "gemma3_text", "llama4_text")),
        # flex compiles its kernel on the CPU (seconds): the windowed and the chunked family
        ("gemma3_text", "flex_attention"),
        ("llama4_text", "flex_attention"),
        ("mistral", "flex_attention"),  # no layer_types: one 4-D block mask, taken whole
    ],
)
def test_every_attention_implementation_keeps_packed_documents_apart(
    name: str, implementation: str
) -> None:
    """Eager's additive float mask and flex's block mask (SDPA's boolean one: the families'
    default, above), each built by transformers for the layer type (full, sliding, chunked)
    from the packed positions."""
    family = _family(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family.config(), attn_implementation=implementation)
    model.eval()
    assert model.config._attn_implementation == implementation
    last = len(decoder_layers(model)) - 1
    errors = _packed_vs_alone(model, (13, 3, 22), [0, 1, last])
    assert max(errors) < 1e-4, errors


@pytest.mark.parametrize(
    "name", ["qwen3", "gemma2", "gemma3_text", "gpt_oss", "llama", "qwen3_next"]
)
def test_right_padded_rows_need_no_mask(name: str) -> None:
    """Training hands the target no 2-D mask (no host read-back of its padding test): every
    real position's states equal those under the padding mask, windows and eager included."""
    model = build_target(_family(name))
    last = len(decoder_layers(model)) - 1
    ids = torch.randint(3, 380, (3, 21))
    attention = torch.ones_like(ids)
    attention[1, 14:] = 0  # right padding, as training batches are padded
    attention[2, 9:] = 0
    with torch.no_grad():
        masked = target_states(model, ids, attention, [0, last], with_logits=True)
        free = target_states(model, ids, None, [0, last], with_logits=True)
    real = attention.bool()
    torch.testing.assert_close(free.tapped[real], masked.tapped[real], rtol=1e-5, atol=1e-5)
    assert free.logits is not None and masked.logits is not None
    torch.testing.assert_close(free.logits[real], masked.logits[real], rtol=1e-5, atol=1e-5)


class _Reads(TorchDispatchMode):
    """Counts the ops that read a device value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3_text", "llama4_text"])
def test_a_packed_forward_reads_nothing_back_from_the_device(name: str) -> None:
    """Packed masks built without positions: no packed-sequence detection reads the device."""
    model = build_target(_family(name))
    ids = torch.randint(3, 380, (2, 24))
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])
    with torch.no_grad(), _Reads() as counter:
        target_states(model, ids, None, [0, 1], with_logits=False, document_ids=docs)
    assert counter.reads == 0


#: Families whose unpadded forward is prepared without a host read-back: attention-only
#: ``layer_types``, or no layer types and no window or chunks.
_PREPARED = {
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt_oss",
    "olmo2",
    "deepseek_v3",
    "glm",
    "glm4",
    "glm4_moe",
    "granite",
    "llama4_text",
}


def _prepared(name: str, model: nn.Module) -> bool:
    """What the rule says of `model` (checked against :data:`_PREPARED` by the test)."""
    config = model.config
    declared = getattr(config, "layer_types", None) or []
    if declared:
        return "linear_attention" not in declared
    window = getattr(config, "sliding_window", None) or getattr(
        config, "attention_chunk_size", None
    )
    return not window


@pytest.mark.parametrize("implementation", ["default", "eager"])
@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_an_unpadded_forward_is_the_models_own_and_reads_nothing_back(
    name: str, implementation: str
) -> None:
    """Unpadded rows: the states equal the model's own masked forward (transformers' mask
    preparation), and where the rule prepares the mask no value is read back from the device;
    the model's attention implementation is its own again afterwards. "default": the family's
    own choice (SDPA, or eager for a family without SDPA support)."""
    family = _family(name)
    torch.manual_seed(0)
    chosen = {} if implementation == "default" else {"attn_implementation": implementation}
    model = AutoModelForCausalLM.from_config(family.config(), **chosen)
    model.eval()
    implementation = model.config._attn_implementation  # SDPA where the family has it
    last = len(decoder_layers(model)) - 1
    ids = torch.randint(3, 380, (2, 21))
    with torch.no_grad():
        reference = target_states(model, ids, torch.ones_like(ids), [0, last], with_logits=True)
        with _Reads() as counter:
            free = target_states(model, ids, None, [0, last], with_logits=True)
    torch.testing.assert_close(free.tapped, reference.tapped, rtol=1e-5, atol=1e-5)
    assert free.logits is not None and reference.logits is not None
    torch.testing.assert_close(free.logits, reference.logits, rtol=1e-5, atol=1e-5)
    assert _prepared(name, model) == (name in _PREPARED)
    if name in _PREPARED:
        assert counter.reads == 0, name
    assert model.config._attn_implementation == implementation
    prepared = causal_attention(model, ids, dtype=torch.float32)
    runs_sdpa_unprepared = implementation == "sdpa" and not getattr(
        model.config, "layer_types", None
    )
    assert (prepared.implementation == CAUSAL_SDPA) == (runs_sdpa_unprepared and name in _PREPARED)
