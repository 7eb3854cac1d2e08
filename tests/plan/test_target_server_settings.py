"""The plan's `target_server` settings: URL rules, vLLM's layer ids, the plan part, the `vllm
serve` command, and plans without a served target left byte for byte as they were."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from dflash_recipes.errors import PlanError
from dflash_recipes.plan.run_plan import (
    ArchitecturePlan,
    BaseModelPlan,
    DataPlan,
    DraftPlan,
    ObjectivePlan,
    RunPlan,
    TargetServerPlan,
    TrainingPlan,
)
from dflash_recipes.plan.target_server_settings import (
    default_port,
    default_served_model_name,
    server_address,
    server_identity,
    server_root,
    server_url_problem,
    target_server_plan,
    vllm_layer_ids,
    vllm_serve_command,
)
from dflash_recipes.recipe.sections import TargetServerSection


def handmade_plan() -> RunPlan:
    """A plan built by hand with fixed values (no path of this machine)."""
    return RunPlan(
        base_model=BaseModelPlan(path="/models/target", dtype="bfloat16", trust_remote_code=False),
        data=DataPlan(data_path="/data/train.jsonl", chat_template=None, answer_only_loss=True),
        training=TrainingPlan(
            output_dir="/runs/a",
            learning_rate=1e-4,
            num_train_epochs=1,
            max_steps=10,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=1,
            training_seq_len=128,
            warmup_ratio=0.0,
            lr_scheduler_type="cosine",
            max_grad_norm=1.0,
            weight_decay=0.0,
            seed=0,
            save_steps=10,
            save_total_limit=None,
            logging_steps=1,
            eval_steps=None,
            device="cpu",
            fsdp=False,
            report_to=(),
            run_name="a",
            logging_dir="/runs/a/tb",
        ),
        draft=DraftPlan(
            block_size=16,
            mask_token_id=5,
            target_layer_ids=(1, 5),
            architecture=ArchitecturePlan(
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                intermediate_size=64,
                rms_norm_eps=1e-6,
                projector_type="dflash",
                emb_dim=None,
                gru_hidden_dim=None,
                markov_rank=None,
                use_confidence_head=False,
                attention_sink=False,
            ),
            objective=ObjectivePlan(
                num_anchors=4,
                loss_objective="decay",
                loss_decay_factor=7.0,
                dpace_alpha=0.5,
                self_logit_distillation=False,
                domino_backbone_loss_weight=1.0,
                dspark_tv_weight=1.0,
                dspark_confidence_weight=0.1,
            ),
        ),
    )


def served(**fields: object) -> TargetServerPlan:
    """A resolved TargetServerPlan (Qwen3-8B's taps, with the final layer), fields replaced."""
    values: dict[str, object] = {
        "urls": ("http://gpu0:8000",),
        "storage_dir": "/dev/shm/dflash-hs",
        "served_model_name": "Qwen3-8B",
        "max_in_flight": 8,
        "timeout_s": 120.0,
        "retries": 3,
        "backoff_s": 2.0,
        "lock_timeout_s": 30.0,
        "keep_files": "delete",
        "capture_dir": None,
        "api_key_env": None,
        "vllm_layer_ids": (2, 10, 18, 26, 34, 36),
        "tap_rows": (0, 1, 2, 3, 4),
        "final_row": 5,
        "dtype": "bfloat16",
        "max_model_len": 4097,
        **fields,
    }
    return TargetServerPlan(**values)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# plans without a served target are unchanged
# ---------------------------------------------------------------------------------------------


def test_a_plan_without_a_served_target_keeps_its_json_and_fingerprint() -> None:
    plan = handmade_plan()
    assert plan.target_server is None
    data = plan.to_dict()
    assert "target_server" not in data  # left out, not null
    assert b"target_server" not in plan.canonical_json()
    # the fingerprint this plan has without the key (format 12: computed when data.supervise,
    # data.unrenderable_rows and regenerate.thinking were added, which changed every plan's
    # JSON; format 11 gave 98732fde2c753112..., format 10, before target_server existed,
    # c87b80e9df827695...)
    assert plan.fingerprint == "6eccda62823d264c067aed58ae06f6054cfce74dab53827a60502db9ede23d71"
    again = RunPlan.from_json(plan.to_json())
    assert again == plan and again.target_server is None


def test_a_plan_with_a_served_target_round_trips_through_json() -> None:
    plan = attrs.evolve(handmade_plan(), target_server=served())
    data = json.loads(plan.to_json())
    assert data["target_server"]["vllm_layer_ids"] == [2, 10, 18, 26, 34, 36]
    assert data["target_server"]["keep_files"] == "delete"
    assert plan.fingerprint != handmade_plan().fingerprint
    assert RunPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"urls": ("ftp://gpu0:8000",)}, "target_server.urls.0: 'ftp://gpu0:8000' must start"),
        ({"urls": ()}, "target_server.urls: urls must be a non-empty list"),
        ({"max_in_flight": 0}, "target_server.max_in_flight"),
        ({"keep_files": "move"}, "move not in literal"),
        ({"tap_rows": (0, 9)}, "row 9 is not on the file's layer axis of 6 ids"),
        ({"final_row": 6}, "row 6 is not on the file's layer axis of 6 ids"),
        ({"max_model_len": 0}, "target_server.max_model_len"),
        ({"dtype": "auto"}, "auto not in literal"),
    ],
)
def test_a_tampered_served_target_is_refused_by_its_dotted_path(
    fields: dict[str, object], problem: str
) -> None:
    plan = attrs.evolve(handmade_plan(), target_server=served(**fields))
    with pytest.raises(PlanError, match="recompile it") as info:
        RunPlan.from_json(plan.to_json())
    assert problem in str(info.value)


# ---------------------------------------------------------------------------------------------
# URLs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("localhost:8000", "must start with http:// or https://"),
        ("grpc://gpu0:8000", "(scheme: grpc)"),
        ("http://:8000", "has no host name"),
        ("http://gpu0:99999", "is not a valid URL"),
        ("http://user:pw@gpu0:8000", "carries credentials"),
        ("http://gpu0:8000/?x=1", "must not carry a query"),
        ("http://gpu0:8000/v1/completions", "names an endpoint"),
        ("http://gpu0:8000/health", "names an endpoint"),
    ],
)
def test_a_url_that_is_no_server_says_why(url: str, why: str) -> None:
    found = server_url_problem(url)
    assert found is not None and why in found


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://GPU0:8000", "http://gpu0:8000"),
        ("http://gpu0:8000/", "http://gpu0:8000"),
        ("http://gpu0:8000/v1", "http://gpu0:8000"),
        ("http://gpu0:8000/v1/", "http://gpu0:8000"),
        ("https://gateway.example/vllm-a/v1", "https://gateway.example/vllm-a"),
    ],
)
def test_a_server_is_recorded_by_its_root(url: str, root: str) -> None:
    assert server_url_problem(url) is None
    assert server_root(url) == root


def test_two_spellings_of_one_server_are_the_same_server() -> None:
    assert server_identity("http://gpu0/v1") == server_identity("HTTP://gpu0:80")
    assert server_identity("http://gpu0:8000") != server_identity("http://gpu0:8001")
    assert server_identity("http://gpu0:8000") != server_identity("https://gpu0:8000")
    assert server_address("https://gpu0") == "gpu0:443"
    assert server_address("http://[::1]:8000") == "[::1]:8000"


def test_the_default_port_is_the_first_urls_else_vllms() -> None:
    assert default_port(served(urls=("http://gpu0:8123", "http://gpu1:8000"))) == 8123
    assert default_port(served(urls=("http://gpu0",))) == 8000


# ---------------------------------------------------------------------------------------------
# layer ids and the plan part
# ---------------------------------------------------------------------------------------------


def test_layer_ids_are_the_taps_plus_one_ascending_and_the_final_layer_with_a_teacher() -> None:
    # Qwen3-8B (36 layers), z-lab's taps: the shared page's example
    assert vllm_layer_ids((1, 9, 17, 25, 33), 36, teacher=False) == (2, 10, 18, 26, 34)
    assert vllm_layer_ids((1, 9, 17, 25, 33), 36, teacher=True) == (2, 10, 18, 26, 34, 36)
    assert vllm_layer_ids((33, 1), 36, teacher=False) == (2, 34)  # the file's order: ascending
    # a tap on the last decoder layer is id L, the state the teacher logits come from: once
    assert vllm_layer_ids((1, 35), 36, teacher=True) == (2, 36)


def _plan_with_taps(taps: tuple[int, ...], *, teacher: bool, layers: int = 8) -> RunPlan:
    from dflash_recipes.checkpoint.target_facts import RopePlan, TargetFacts

    plan = handmade_plan()
    facts = TargetFacts(
        model_type="qwen3",
        architectures=("Qwen3ForCausalLM",),
        hidden_size=32,
        num_hidden_layers=layers,
        vocab_size=256,
        max_position_embeddings=4096,
        rope=RopePlan(rope_theta=1e6),
    )
    objective = attrs.evolve(plan.draft.objective, self_logit_distillation=teacher)
    return attrs.evolve(
        plan,
        base_model=attrs.evolve(plan.base_model, facts=facts),
        draft=attrs.evolve(plan.draft, target_layer_ids=taps, objective=objective),
    )


def test_the_plan_part_maps_each_tap_and_the_final_layer_to_its_row() -> None:
    plan = _plan_with_taps((5, 1, 7), teacher=True)
    section = TargetServerSection(urls=("http://gpu0:8000/v1",), storage_dir="hs")
    server = target_server_plan(
        section,
        storage_dir=Path("/dev/shm/hs"),
        capture_dir=None,
        base_model=plan.base_model,
        training=plan.training,
        draft=plan.draft,
    )
    assert server.vllm_layer_ids == (2, 6, 8)  # tap 7 is the last layer: id 8 = L, once
    assert server.tap_rows == (1, 0, 2)  # taps in the drafter's order
    assert server.final_row == 2
    assert server.urls == ("http://gpu0:8000",)
    assert server.served_model_name == "target"
    assert (server.dtype, server.max_model_len) == ("bfloat16", 129)
    assert (server.max_in_flight, server.timeout_s, server.retries) == (8, 120.0, 3)
    assert (server.backoff_s, server.lock_timeout_s, server.keep_files) == (2.0, 30.0, "delete")

    without = _plan_with_taps((5, 1), teacher=False)
    server = target_server_plan(
        section,
        storage_dir=Path("/dev/shm/hs"),
        capture_dir=None,
        base_model=without.base_model,
        training=without.training,
        draft=without.draft,
    )
    assert (server.vllm_layer_ids, server.tap_rows, server.final_row) == ((2, 6), (1, 0), None)


def test_a_schema_level_plan_has_no_layer_ids_yet() -> None:
    plan = handmade_plan()  # no facts read
    server = target_server_plan(
        TargetServerSection(urls=("http://gpu0:8000",), storage_dir="hs"),
        storage_dir=Path("/hs"),
        capture_dir=None,
        base_model=plan.base_model,
        training=plan.training,
        draft=plan.draft,
    )
    assert (server.vllm_layer_ids, server.tap_rows, server.final_row) == (None, None, None)
    with pytest.raises(ValueError, match="schema-level plan"):
        vllm_serve_command("/models/target", server, port=8000)


def test_the_served_name_defaults_to_the_folder_or_the_hub_id_of_a_cache_folder() -> None:
    assert default_served_model_name("/hf-local/Qwen/Qwen3-8B") == "Qwen3-8B"
    cache = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/0123abc"
    assert default_served_model_name(cache) == "Qwen/Qwen3-8B"


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def test_the_command_serves_what_the_plan_needs() -> None:
    argv = vllm_serve_command("/models/Qwen3-8B", served(), port=8001, tensor_parallel_size=4)
    assert argv[:3] == ["vllm", "serve", "/models/Qwen3-8B"]
    options = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert options["--served-model-name"] == "Qwen3-8B"
    assert options["--dtype"] == "bfloat16"
    assert options["--max-model-len"] == "4097"
    assert options["--port"] == "8001"
    assert options["--tensor-parallel-size"] == "4"
    speculative = json.loads(options["--speculative_config"])
    assert speculative == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 10, 18, 26, 34, 36]}
        },
    }
    kv = json.loads(options["--kv_transfer_config"])
    assert kv == {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": "/dev/shm/dflash-hs",
            "use_synchronization_lock": True,
        },
    }
    assert "--tensor-parallel-size" not in vllm_serve_command("/m", served(), port=8000)
