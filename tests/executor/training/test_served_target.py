"""`run` with a target served by vLLM (issue 50): the trainer holds only what the drafter shares
with the target, each batch's states come from local servers that answer as vLLM does
(tests/testkit/vllm_server.py: the real HTTP, file and lock protocol, on 127.0.0.1), and a
run through them trains what a run with the target in-process trains."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file
from testkit.compiling import SMALL_RUN, tiny_served_recipe
from testkit.vllm_server import VllmServer, dead_url, launch, wait_for_port

from dflash_recipes.compiler.compilation import compile_file
from dflash_recipes.errors import ServedStatesError, TargetServerUnavailable
from dflash_recipes.executor.target_server import batch_states
from dflash_recipes.executor.training.fit import run_plan
from dflash_recipes.executor.training.setup import models as models_module
from dflash_recipes.plan.run_plan import RunPlan

REPO = Path(__file__).resolve().parents[3]
TARGET = REPO / "dflash_recipes" / "demo_data" / "target"
STEPS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe(tmp_path: Path, urls: list[str] | None, storage: Path) -> Path:
    """The tiny from-scratch recipe with a target_server section that fails fast."""
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.yaml"
    fast = {"retries": 0, "backoff_s": 0, "timeout_s": 20}
    return tiny_served_recipe(path, urls, storage, settings=fast)


def _plan(recipe: Path, output: Path, *overrides: str) -> RunPlan:
    result = compile_file(
        recipe,
        overrides=(
            f"training.output_dir={output}",
            *SMALL_RUN,
            f"training.max_steps={STEPS}",
            f"training.save_steps={STEPS}",
            "training.eval_steps=0",  # no measured evaluation: no decoder in the trainer
            *overrides,
        ),
    )
    assert result.plan is not None, [str(d) for d in result.diagnostics]
    return result.plan


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [float(r["loss"]) for r in rows if r["kind"] == "train"]


def _export(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


@contextlib.contextmanager
def _serving(storage: Path, plan: RunPlan, port: int = 0) -> Iterator[VllmServer]:
    """A server of the demo target started for exactly the plan's vLLM layer ids."""
    assert plan.target_server is not None and plan.target_server.vllm_layer_ids is not None
    ids = list(plan.target_server.vllm_layer_ids)
    name = plan.target_server.served_model_name
    started = wait_for_port(
        launch(TARGET, storage, ids, dtype="float32", port=port, served_name=name)
    )
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def port() -> int:
    """A port to start the test's servers on (the plans name it before they start)."""
    return int(dead_url().rsplit(":", 1)[1])


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    "overrides",
    [(), ("dflash.dflash_self_logit_distillation=true",)],
    ids=["plain", "teacher"],
)
def test_a_run_through_the_server_trains_what_the_in_process_target_trains(
    tmp_path: Path,
    storage: Path,
    port: int,
    overrides: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # one conversation per row: the server computes each conversation alone, the in-process
    # target then runs the very same shapes, so the two runs are equal bit for bit
    one = ("training.per_device_train_batch_size=1", *overrides)
    local = _plan(_recipe(tmp_path, None, storage), tmp_path / "local", *one)
    served = _plan(_recipe(tmp_path, [_url(port)], storage), tmp_path / "served", *one)
    run_plan(local, progress=False)

    def no_whole_target(plan: RunPlan) -> None:
        raise AssertionError("the trainer loaded the whole target")

    # the trainer holds only the embeddings, final norm and lm_head (no decoder layer)
    monkeypatch.setattr(models_module, "load_base_model", no_whole_target)
    with _serving(storage, served, port) as server:
        summary = run_plan(served, progress=False)
        assert server.stats()["answered"] >= STEPS  # (and the batches prepared ahead)
    assert summary.steps == STEPS
    assert _losses(tmp_path / "served") == _losses(tmp_path / "local")
    ours, theirs = _export(tmp_path / "served"), _export(tmp_path / "local")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert not list(storage.glob("*.safetensors"))  # every file read and deleted


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_batch_gets_the_states_the_in_process_target_gives_it(
    tmp_path: Path, storage: Path, port: int, packing: bool
) -> None:
    """Several conversations a batch, padded or packed: each conversation's served states are
    the ones the in-process target gives it in that batch (up to float rounding), in place."""
    from dflash_recipes.executor.dist_env import detect_dist_env
    from dflash_recipes.executor.model.convert import load_base_model, load_tokenizer
    from dflash_recipes.executor.model.target_states import target_states
    from dflash_recipes.executor.training.setup.train_data import build_train_data

    served = _plan(
        _recipe(tmp_path, [_url(port)], storage),
        tmp_path / "served",
        f"data.packing={str(packing).lower()}",
        "dflash.dflash_self_logit_distillation=true",
    )
    env = detect_dist_env("cpu", {})
    target = load_base_model(served)
    spec = served.resolved_draft()
    with _serving(storage, served, port):
        data = build_train_data(served, load_tokenizer(served), env, verify_capture=False)
        try:
            batch = next(data.stream(0, 0))
            states = data.captured_states(batch)
        finally:
            data.close()
    assert states is not None and states.documents_alone and states.last_hidden is not None
    assert (batch.document_ids is not None) is packing
    with torch.no_grad():
        every = [*spec.target_layer_ids, target.config.num_hidden_layers - 1]
        local = target_states(
            target, batch.input_ids, None, every, with_logits=False, document_ids=batch.document_ids
        ).tapped
    real = batch.attention_mask.bool()
    width = states.tapped.shape[-1]
    torch.testing.assert_close(states.tapped[real], local[..., :width][real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        states.last_hidden[real], local[..., width:][real], rtol=1e-4, atol=1e-4
    )
    assert torch.count_nonzero(states.tapped[~real]) == 0  # padding and filler stay zero


def test_a_dead_server_among_two_costs_nothing(tmp_path: Path, storage: Path, port: int) -> None:
    served = _plan(_recipe(tmp_path, [dead_url(), _url(port)], storage), tmp_path / "run")
    with _serving(storage, served, port):
        assert run_plan(served, progress=False).steps == STEPS


def test_when_no_server_answers_the_finished_steps_are_saved_and_a_rerun_resumes_exactly(
    tmp_path: Path, storage: Path, port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _plan(_recipe(tmp_path, [_url(port)], storage), tmp_path / "whole")
    plan = _plan(_recipe(tmp_path, [_url(port)], storage), tmp_path / "cut")
    asked = 0
    call = batch_states.ServedBatchStates.__call__
    with _serving(storage, reference, port) as server:
        run_plan(reference, progress=False)

        def fails_from_the_third_batch(
            self: batch_states.ServedBatchStates, batch: Any, names: Any = None
        ) -> Any:
            nonlocal asked
            asked += 1
            if asked == 3:  # the server errors on every request from the third batch on
                server.control(fail_500=10**6)
            return call(self, batch, names)

        monkeypatch.setattr(batch_states.ServedBatchStates, "__call__", fails_from_the_third_batch)
        with pytest.raises(TargetServerUnavailable) as failed:
            run_plan(plan, progress=False)
        assert f"127.0.0.1:{port}" in str(failed.value)
        saved = sorted(p.name for p in (tmp_path / "cut").glob("checkpoint-*"))
        assert saved == ["checkpoint-00000002"]  # the last finished step, kept

        monkeypatch.undo()
        server.reset()
        resumed = run_plan(plan, progress=False)
    assert resumed.resumed_from_step == 2 and resumed.steps == STEPS
    ours, theirs = _export(tmp_path / "cut"), _export(tmp_path / "whole")
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize(
    "overrides", [(), ("dflash.dflash_self_logit_distillation=true",)], ids=["plain", "teacher"]
)
def test_a_capture_from_the_server_trains_offline_what_the_server_trains_online(
    tmp_path: Path, storage: Path, port: int, overrides: tuple[str, ...]
) -> None:
    from dflash_recipes.executor.data.capture import capture_plan
    from dflash_recipes.files.capture_manifest import read_manifest

    recipe = _recipe(tmp_path, [_url(port)], storage)
    online = _plan(recipe, tmp_path / "online", *overrides)
    capture = tmp_path / "capture"
    with _serving(storage, online, port):
        summary = capture_plan(online, capture, progress=False)
        run_plan(online, progress=False)
    assert summary.complete
    manifest = read_manifest(capture)
    assert manifest.last_hidden_state == bool(overrides)
    assert not list(storage.glob("*.safetensors"))
    local = _recipe(tmp_path, None, storage)  # offline: no server, no target decoder
    offline = _plan(local, tmp_path / "offline", f"data.hidden_states_path={capture}", *overrides)
    run_plan(offline, progress=False)
    assert _losses(tmp_path / "offline") == _losses(tmp_path / "online")
    ours, theirs = _export(tmp_path / "offline"), _export(tmp_path / "online")
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_server_that_tokenizes_again_stops_the_run_naming_the_conversation(
    tmp_path: Path, storage: Path, port: int
) -> None:
    plan = _plan(_recipe(tmp_path, [_url(port)], storage), tmp_path / "run")
    with _serving(storage, plan, port) as server:
        server.control(wrong_token_at=3)  # a BOS or chat-template drift on the server
        with pytest.raises(ServedStatesError) as failed:
            run_plan(plan, progress=False)
        asked = server.stats()["requests"]
    message = str(failed.value)
    assert "the first difference is at position 3" in message and "not retried" in message
    named = int(message.split("conversation ", 1)[1].split(":", 1)[0])
    sent = int(message.split(" tokens sent", 1)[0].rsplit("(", 1)[1])
    data = _local_data(plan)
    first = data.conversation_indices(next(data.stream(0, 0)))
    assert named in first  # a conversation of the first batch, by its index in the data
    assert len(data.dataset.examples[named].input_ids) == sent
    assert asked <= 2 * plan.training.per_device_train_batch_size  # never retried
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # nothing trained, nothing saved


def _local_data(plan: RunPlan) -> Any:
    """The plan's training data as the run reads it (its conversations and their order)."""
    from dflash_recipes.executor.dist_env import detect_dist_env
    from dflash_recipes.executor.model.convert import load_tokenizer
    from dflash_recipes.executor.training.setup.train_data import build_train_data

    local = attrs.evolve(plan, target_server=None)
    env = detect_dist_env("cpu", {})
    return build_train_data(local, load_tokenizer(local), env, verify_capture=False)


def test_a_server_started_for_other_taps_stops_the_run_at_its_first_answer(
    tmp_path: Path, storage: Path, port: int
) -> None:
    plan = _plan(_recipe(tmp_path, [_url(port)], storage), tmp_path / "run")
    assert plan.target_server is not None and plan.target_server.vllm_layer_ids is not None
    other = [*plan.target_server.vllm_layer_ids, 6]  # started with the final layer too
    name = plan.target_server.served_model_name
    launched = launch(TARGET, storage, other, dtype="float32", port=port, served_name=name)
    server = wait_for_port(launched)
    try:
        with pytest.raises(ServedStatesError) as failed:
            run_plan(plan, progress=False)
    finally:
        server.stop()
    message = str(failed.value)
    assert f"127.0.0.1:{port}" in message
    assert str(len(other)) in message and str(len(plan.target_server.vllm_layer_ids)) in message
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def _train_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def test_a_packed_run_through_the_server_trains_what_the_in_process_packed_run_trains(
    tmp_path: Path, storage: Path, port: int
) -> None:
    """Packed rows: the in-process target runs the row at once under per-document masks, the
    server each conversation alone, so the states agree to float rounding, not bit for bit:
    every step's loss and gradient norm agree to 1e-4 (Adam's first steps amplify rounding in
    near-zero gradient entries, so the weights are compared through the losses they give)."""
    packed = ("data.packing=true", "training.training_seq_len=160")
    local = _plan(_recipe(tmp_path, None, storage), tmp_path / "local", *packed)
    served = _plan(_recipe(tmp_path, [_url(port)], storage), tmp_path / "served", *packed)
    first = next(_local_data(served).stream(0, 0))
    assert first.document_ids is not None and int(first.document_ids.max()) >= 1  # 2+ a row
    run_plan(local, progress=False)
    with _serving(storage, served, port):
        run_plan(served, progress=False)
    ours, theirs = _train_rows(tmp_path / "served"), _train_rows(tmp_path / "local")
    assert len(ours) == len(theirs) == STEPS
    for a, b in zip(ours, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


#: Rank 1's servers go away at its third batch (a sitecustomize of the ranks' processes).
_RANK1_LOSES_ITS_SERVERS = """
import os

from dflash_recipes.errors import TargetServerUnavailable
from dflash_recipes.executor.target_server import batch_states

_call = batch_states.ServedBatchStates.__call__
_asked = [0]


def _failing(self, batch, names=None):
    _asked[0] += 1
    if os.environ.get("RANK") == "1" and _asked[0] >= 3:
        raise TargetServerUnavailable("rank 1's target servers are gone")
    return _call(self, batch, names)


batch_states.ServedBatchStates.__call__ = _failing
"""


@pytest.mark.slow
def test_ranks_stop_together_when_one_ranks_servers_fail(
    tmp_path: Path, storage: Path, port: int
) -> None:
    """Every rank learns at the same micro-step that a rank's servers failed: all save the
    finished steps and stop (no rank left waiting in a collective), and a rerun resumes."""
    import os
    import subprocess
    import sys

    plan = _plan(
        _recipe(tmp_path, [_url(port)], storage),
        tmp_path / "run",
        "training.max_steps=4",
        "training.save_steps=10",
        "training.per_device_train_batch_size=1",
        "training.distributed_timeout_s=60",  # a rank left waiting fails the test in a minute
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json(), encoding="utf-8")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(_RANK1_LOSES_ITS_SERVERS, encoding="utf-8")
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "dflash_recipes", "run", str(plan_file)]
    command += ["--nproc-per-node", "2", "--no-progress"]
    with _serving(storage, plan, port):
        failing = {
            **env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), env.get("PYTHONPATH")])),
        }
        failed = subprocess.run(command, env=failing, capture_output=True, text=True, timeout=240)
        assert failed.returncode != 0
        assert "rank 1's target servers are gone" in failed.stderr
        assert "another rank could not get its batch's states" in failed.stderr  # rank 0
        saved = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
        assert saved == ["checkpoint-00000002"]  # the steps both ranks finished
        resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()
    train = _train_rows(tmp_path / "run")
    assert [row["step"] for row in train] == [1, 2, 3, 4]  # 1-2 before the failure, 3-4 after


def _few_conversations(tmp_path: Path, count: int) -> Path:
    """The first `count` conversations of the demo's training file (an epoch of count / 2
    steps at the small run's two rows a batch)."""
    lines = (REPO / "dflash_recipes" / "demo_data" / "data" / "domain.jsonl").read_text()
    path = tmp_path / f"few-{count}.jsonl"
    path.write_text("".join(lines.splitlines(keepends=True)[:count]), encoding="utf-8")
    return path


def test_kept_states_train_later_epochs_and_a_rerun_without_the_server(
    tmp_path: Path, storage: Path, port: int
) -> None:
    data = _few_conversations(tmp_path, 6)  # 3 steps an epoch: 6 steps are two epochs
    two_epochs = (f"data.data_path={data}", "training.max_steps=6", "training.save_steps=6")
    kept = tmp_path / "kept"
    keep = ("target_server.keep_files=capture", f"target_server.capture_dir={kept}")
    recipe = _recipe(tmp_path, [_url(port)], storage)
    deleting = _plan(recipe, tmp_path / "deleting", *two_epochs)
    keeping = _plan(recipe, tmp_path / "keeping", *two_epochs, *keep)
    with _serving(storage, deleting, port) as server:
        run_plan(deleting, progress=False)
        # every conversation asked in each epoch (and a batch prepared ahead of the last step)
        assert server.stats()["answered"] >= 12
        server.reset()
        run_plan(keeping, progress=False)
        assert server.stats()["answered"] == 6  # later epochs read what the first one kept
    assert _losses(tmp_path / "keeping") == _losses(tmp_path / "deleting")
    assert len(list(kept.glob("states-*/*.safetensors"))) == 6
    assert not list(storage.glob("*.safetensors"))

    # no server at all: a rerun trains from the kept states, the same steps
    offline = _plan(
        _recipe(tmp_path, [dead_url()], storage), tmp_path / "offline", *two_epochs, *keep
    )
    run_plan(offline, progress=False)
    assert _losses(tmp_path / "offline") == _losses(tmp_path / "deleting")
    ours, theirs = _export(tmp_path / "offline"), _export(tmp_path / "deleting")
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)

    # a conversation that was never kept needs a server: none answers, the run stops
    more = _few_conversations(tmp_path, 8)
    unkept = _plan(
        _recipe(tmp_path, [dead_url()], storage),
        tmp_path / "unkept",
        f"data.data_path={more}",
        "training.max_steps=4",
        *keep,
    )
    with pytest.raises(TargetServerUnavailable):
        run_plan(unkept, progress=False)
