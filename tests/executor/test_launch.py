"""The torchrun command `run --nproc-per-node` builds, and its launch.

The stop grace is tested twice over: with the installed torchrun (``--shutdown-timeout``) and
with an argument parser shaped like torch 2.10 and 2.11's, which has no such option; both
launches really start torchrun with stand-in workers and stop them with a SIGTERM to the
launcher. Parsers of every shape (with and without each option) choose the options; torch
2.9's, with neither, is refused.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_recipes.errors import LaunchError
from dflash_recipes.executor.launch import (
    DEFAULT_RDZV_ID,
    SIGNALS_TO_HANDLE_SINCE,
    WORKER_SHUTDOWN_TIMEOUT_S,
    build_torchrun_argv,
    launch_torchrun,
    stop_grace_options,
    torchrun_parser,
)
from dflash_recipes.executor.torchrun import kept_stop_signals


def _parse_as_torchrun(argv: list[str]) -> dict[str, object]:
    """Parse our command with torchrun's own parser, so the flags are ones torchrun accepts."""
    from torch.distributed.run import get_args_parser

    assert argv[:3] == [sys.executable, "-m", "dflash_recipes.executor.torchrun"]
    return vars(get_args_parser().parse_args(argv[3:]))


def test_single_node_command_is_standalone() -> None:
    argv = build_torchrun_argv(["plan.json"], nproc_per_node=2)
    assert argv == [
        sys.executable,
        "-m",
        "dflash_recipes.executor.torchrun",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        str(WORKER_SHUTDOWN_TIMEOUT_S),
        "--standalone",
        "-m",
        "dflash_recipes.cli",
        "run",
        "plan.json",
    ]
    args = _parse_as_torchrun(argv)
    assert args["standalone"] is True
    assert args["shutdown_timeout"] == WORKER_SHUTDOWN_TIMEOUT_S
    assert args["nproc_per_node"] == "2"
    assert args["module"] is True
    assert args["training_script"] == "dflash_recipes.cli"
    assert args["training_script_args"] == ["run", "plan.json"]


def test_multi_node_command_uses_c10d_rendezvous() -> None:
    argv = build_torchrun_argv(
        ["recipe.yaml", "training.max_steps=10"],
        nproc_per_node=8,
        nnodes=4,
        rdzv_endpoint="node001:29500",
        rdzv_id="123456",
    )
    args = _parse_as_torchrun(argv)
    assert args["standalone"] is False
    assert (args["nnodes"], args["nproc_per_node"]) == ("4", "8")
    assert (args["rdzv_backend"], args["rdzv_endpoint"], args["rdzv_id"]) == (
        "c10d",
        "node001:29500",
        "123456",
    )
    assert args["training_script_args"] == ["run", "recipe.yaml", "training.max_steps=10"]
    default_id = build_torchrun_argv(["p.json"], nproc_per_node=1, rdzv_endpoint="[fd00::1]:29400")
    assert _parse_as_torchrun(default_id)["rdzv_id"] == DEFAULT_RDZV_ID


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"nproc_per_node": 0}, "--nproc-per-node must be a positive integer"),
        ({"nproc_per_node": 2, "nnodes": 0}, "--nnodes must be a positive integer"),
        ({"nproc_per_node": 2, "nnodes": 2}, "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        ({"nproc_per_node": 2, "nnodes": 2, "rdzv_endpoint": "node001"}, "is not HOST:PORT"),
        ({"nproc_per_node": 2, "rdzv_endpoint": "node001:99999"}, "is not HOST:PORT"),
        ({"nproc_per_node": 2, "rdzv_endpoint": "bad host:1"}, "is not HOST:PORT"),
        ({"nproc_per_node": 2, "rdzv_id": "42"}, "--rdzv-id only applies with --rdzv-endpoint"),
        (
            {"nproc_per_node": 2, "rdzv_endpoint": "h:1", "rdzv_id": "a b"},
            "--rdzv-id 'a b' must be",
        ),
    ],
)
def test_invalid_launch_options_are_explained(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(LaunchError) as info:
        build_torchrun_argv(["plan.json"], **kwargs)  # type: ignore[arg-type]
    assert expected in str(info.value)


def test_launch_options_are_not_forwarded_to_the_workers() -> None:
    with pytest.raises(LaunchError, match="would launch again"):
        build_torchrun_argv(["plan.json", "--nproc-per-node=2"], nproc_per_node=2)


def test_launch_returns_the_exit_code() -> None:
    assert launch_torchrun([sys.executable, "-c", "raise SystemExit(3)"]) == 0 + 3
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert launch_torchrun([sys.executable, "-c", killed]) == 128 + signal.SIGTERM
    with pytest.raises(LaunchError, match="could not start"):
        launch_torchrun(["/nonexistent/torchrun-binary"])


# ---------------------------------------------------------------------------------------------
# torchruns of each shape: --shutdown-timeout (torch 2.12 and newer), --signals-to-handle only
# (torch 2.10 and 2.11), neither (torch 2.9, read in the 2.9.0 and 2.9.1 wheels' run.py)
# ---------------------------------------------------------------------------------------------


def _torchrun_parser_shaped(
    *, shutdown_timeout: bool = False, signals_to_handle: bool = True
) -> argparse.ArgumentParser:
    """torchrun's parser, for the options the launcher uses, with or without each of the two
    stop-grace options; the defaults are torch 2.10 and 2.11's shape (no --shutdown-timeout,
    --signals-to-handle with its default)."""
    parser = argparse.ArgumentParser(prog="torchrun")
    parser.add_argument("--nnodes", "--nnodes", type=str, default="1:1")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=str, default="1")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", type=str, default="static")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", type=str, default="")
    parser.add_argument("--rdzv-id", "--rdzv_id", type=str, default="none")
    parser.add_argument("--standalone", action="store_true")
    if signals_to_handle:
        parser.add_argument(
            "--signals-to-handle", "--signals_to_handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        )
    if shutdown_timeout:
        parser.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, default=None)
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("training_script", type=str)
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


@pytest.mark.parametrize(
    ("shutdown_timeout", "signals_to_handle", "expected"),
    [
        (True, True, ["--shutdown-timeout", str(WORKER_SHUTDOWN_TIMEOUT_S)]),
        (True, False, ["--shutdown-timeout", str(WORKER_SHUTDOWN_TIMEOUT_S)]),
        (False, True, ["--signals-to-handle", "SIGHUP,SIGQUIT"]),
    ],
    ids=["both-2.12-and-newer", "shutdown-timeout-only", "signals-to-handle-only-2.10-2.11"],
)
def test_the_stop_grace_is_asked_of_torchruns_own_parser(
    shutdown_timeout: bool, signals_to_handle: bool, expected: list[str]
) -> None:
    """--shutdown-timeout wherever torchrun has it, --signals-to-handle only where it has not;
    the whole command is one that torchrun's parser of that shape takes."""
    parser = _torchrun_parser_shaped(
        shutdown_timeout=shutdown_timeout, signals_to_handle=signals_to_handle
    )
    assert stop_grace_options(parser) == expected
    argv = build_torchrun_argv(["plan.json"], nproc_per_node=2, parser=parser)
    assert argv[5:7] == expected
    args = vars(parser.parse_args(argv[3:]))
    assert (args["standalone"], args["training_script_args"]) == (True, ["run", "plan.json"])
    if shutdown_timeout:
        assert args["shutdown_timeout"] == WORKER_SHUTDOWN_TIMEOUT_S
        if signals_to_handle:  # torchrun keeps handling every stop signal itself
            assert args["signals_to_handle"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_without_shutdown_timeout_torchrun_leaves_the_stop_signals_to_the_wrapper() -> None:
    old = _torchrun_parser_shaped()
    argv = build_torchrun_argv(["plan.json"], nproc_per_node=2, parser=old)
    assert "--shutdown-timeout" not in argv
    # every option is one the old torchrun takes, and it handles the signals less TERM/INT
    args = vars(old.parse_args(argv[3:]))
    assert args["signals_to_handle"] == "SIGHUP,SIGQUIT"
    assert (args["standalone"], args["training_script_args"]) == (True, ["run", "plan.json"])
    # the wrapper reads the same command and takes SIGTERM and SIGINT
    assert kept_stop_signals(argv[3:]) == (signal.SIGTERM, signal.SIGINT)
    new = build_torchrun_argv(["plan.json"], nproc_per_node=2)
    assert kept_stop_signals(new[3:]) == ()


@pytest.mark.parametrize("signals_to_handle", [True, False], ids=["2.10-and-newer", "2.9"])
def test_the_wrapper_takes_no_signal_from_a_torchrun_that_handles_them_all(
    signals_to_handle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed torchruns of either shape, told nothing about the stop signals, keep them."""
    import dflash_recipes.executor.torchrun as wrapper

    def shaped() -> argparse.ArgumentParser:
        return _torchrun_parser_shaped(signals_to_handle=signals_to_handle)

    monkeypatch.setattr(wrapper, "get_args_parser", shaped)
    argv = ["--nproc-per-node", "2", "--standalone", "-m", "dflash_recipes.cli", "run", "p"]
    assert kept_stop_signals(argv) == ()
    if signals_to_handle:
        told = ["--signals-to-handle", "SIGHUP,SIGQUIT", *argv]
        assert kept_stop_signals(told) == (signal.SIGTERM, signal.SIGINT)


def test_a_torchrun_that_can_keep_no_grace_is_refused() -> None:
    """torch 2.9's torchrun: neither option; the refusal names the torch to install."""
    from dflash_recipes.executor.versions import installed_version

    with pytest.raises(LaunchError) as info:
        build_torchrun_argv(
            ["plan.json"], nproc_per_node=2, parser=_torchrun_parser_shaped(signals_to_handle=False)
        )
    message = str(info.value)
    assert message.startswith(
        f"this torchrun (torch {installed_version('torch')}) accepts neither "
        "--shutdown-timeout nor --signals-to-handle"
    )
    assert f"pip install 'torch>={SIGNALS_TO_HANDLE_SINCE}'" in message
    assert SIGNALS_TO_HANDLE_SINCE == "2.10"
    assert "-m dflash_recipes.cli run PLAN" in message


_STAND_IN_WORKER = """
import os, signal, sys, time
from pathlib import Path

out, rank = Path(sys.argv[1]), os.environ["RANK"]
terms = []
signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
(out / f"ready{rank}").write_text("")
while not terms:
    time.sleep(0.02)
if rank == "0":
    time.sleep(3.0)  # rank 0 saves for longer than torchrun's own deadline (1 s here)
(out / f"saved{rank}").write_text(str(len(terms)))
sys.exit(128 + signal.SIGTERM)
"""


def _wait_for(paths: list[Path], process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in paths):
        assert process.poll() is None, "the launch ended before its workers were ready"
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("torchrun", ["installed", "2.11-shaped"])
def test_a_sigterm_to_the_launcher_lets_every_worker_finish_its_save(
    torchrun: str, tmp_path: Path
) -> None:
    parser = torchrun_parser() if torchrun == "installed" else _torchrun_parser_shaped()
    argv = build_torchrun_argv(["unused"], nproc_per_node=2, parser=parser)
    worker = tmp_path / "worker.py"
    worker.write_text(_STAND_IN_WORKER, encoding="utf-8")
    # torchrun as built, the stand-in worker in place of `-m dflash_recipes.cli run ...`
    argv = [*argv[: argv.index("-m", 3)], str(worker), str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    # torchrun's default deadline after a stop signal, where no option sets it (torch >= 2.12)
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "1"
    driver = "import sys\nfrom dflash_recipes.executor.launch import launch_torchrun\n"
    driver += f"sys.exit(launch_torchrun({argv!r}))\n"
    launcher = subprocess.Popen([sys.executable, "-c", driver], env=env)
    try:
        _wait_for([tmp_path / "ready0", tmp_path / "ready1"], launcher)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # each worker got the SIGTERM once and finished: rank 1's early exit did not make torchrun
    # signal rank 0 again, and nothing SIGKILLed rank 0 during its longer "save"
    saved = {p.name: p.read_text() for p in tmp_path.glob("saved*")}
    assert saved == {"saved0": "1", "saved1": "1"}


# ---------------------------------------------------------------------------------------------
# dflash-recipe run --nproc-per-node N: torchrun for real (gloo)
# ---------------------------------------------------------------------------------------------


#: Loaded by every process of the launch (PYTHONPATH): each rank writes what the trainer's
#: online path captured from the target in its first micro-step (the batch, the taps, whether
#: the target's weights were FSDP2-sharded) into a file of its own, never to stdout.
_TAPS_SITECUSTOMIZE = """
import os
from pathlib import Path

import torch

from dflash_recipes.executor.training import step as _step

_capture = _step.target_states


def _recorded(model, input_ids, attention_mask, target_layer_ids, *, stop_after, **more):
    states = _capture(
        model, input_ids, attention_mask, target_layer_ids, stop_after=stop_after, **more
    )
    tapped = states.tapped
    out = Path(os.environ["DFLASH_TEST_TAPS"]) / f"rank{os.environ.get('RANK', '-')}.pt"
    if not out.exists():
        from torch.distributed.tensor import DTensor

        report = {
            "input_ids": input_ids.cpu(),
            "attention_mask": None if attention_mask is None else attention_mask.cpu(),
            "tapped": tapped.cpu(),
            "stop_after": stop_after,
            "sharded": any(isinstance(p, DTensor) for p in model.parameters()),
        }
        torch.save(report, out)
    return states


_step.target_states = _recorded
"""


def _unsharded_taps(plan_overrides: tuple[str, ...], report: dict[str, object]) -> torch.Tensor:
    """The plain (unsharded, whole-forward) target's taps of a rank's batch, from Hugging
    Face's ``output_hidden_states``."""
    from testkit.compiling import TINY_SCRATCH

    from dflash_recipes.compiler.compilation import compile_file
    from dflash_recipes.executor.model.convert import load_base_model
    from dflash_recipes.executor.model.draft import taps_from_hidden_states

    result = compile_file(TINY_SCRATCH, overrides=plan_overrides)
    assert result.plan is not None, result.diagnostics
    target = load_base_model(result.plan)
    ids, attention = report["input_ids"], report["attention_mask"]
    assert isinstance(ids, torch.Tensor)
    # the trainer hands right-padded rows no mask: the reference runs them the same way
    assert attention is None or isinstance(attention, torch.Tensor)
    with torch.no_grad():
        states = target(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    taps = result.plan.resolved_draft().target_layer_ids
    return taps_from_hidden_states(states.hidden_states, taps).float()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "extra"),
    # Under FSDP (target and drafter sharded) every rank measures the held-out acceptance in
    # step: the sharded run evaluates at its last step.
    [(1, ()), (2, ("training.fsdp=true", "training.eval_steps=2"))],
    ids=["1-rank", "2-ranks-fsdp2"],
)
def test_run_with_nproc_per_node_trains_through_torchrun(
    nproc: int, extra: tuple[str, ...], tmp_path: Path
) -> None:
    """The trainer through torchrun, and its target taps (forward hooks, stopped after the
    deepest tap) on each rank equal the unsharded target's ``output_hidden_states`` taps of
    that rank's batch: under ``training.fsdp`` on 2 gloo ranks too, with the target sharded."""
    from testkit.compiling import SMALL_RUN, TINY_SCRATCH

    out = tmp_path / "run"
    hooks, taps_dir = tmp_path / "hooks", tmp_path / "taps"
    hooks.mkdir()
    taps_dir.mkdir()
    (hooks / "sitecustomize.py").write_text(_TAPS_SITECUSTOMIZE, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hooks), env.get("PYTHONPATH")]))
    env["DFLASH_TEST_TAPS"] = str(taps_dir)
    overrides = (
        f"training.output_dir={out}",
        *SMALL_RUN,
        "training.max_steps=2",
        "training.per_device_train_batch_size=1",
        *extra,
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_recipes",
            "run",
            str(TINY_SCRATCH),
            *overrides,
            "--nproc-per-node",
            str(nproc),
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("done: 2 steps, "), done.stderr[-3000:]
    assert (out / "export" / "model.safetensors").is_file()
    assert "unrecognized arguments" not in done.stderr

    from testkit.numerics import assert_equal_up_to_rounding

    reports = sorted(taps_dir.glob("rank*.pt"))
    assert [p.name for p in reports] == [f"rank{r}.pt" for r in range(nproc)]
    batches = []
    for path in reports:
        report = torch.load(path, weights_only=True)
        assert report["sharded"] is (nproc > 1)  # training.fsdp sharded the target's layers
        assert report["stop_after"] is not None  # the forward stopped after the deepest tap
        expected = _unsharded_taps(overrides, report)
        assert_equal_up_to_rounding(
            report["tapped"], expected, what=f"{path.stem}'s taps vs the unsharded target's"
        )
        batches.append(report["input_ids"])
    if nproc > 1:  # each rank tapped its own share of the batch
        assert not torch.equal(batches[0], batches[1])


def test_run_passes_skip_memory_check_to_every_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run --skip-memory-check --nproc-per-node N` reruns the command with the flag in each
    worker (issue 49), and a single-process run hands it to run_plan."""
    from click.testing import CliRunner
    from testkit.compiling import tiny_scratch_plan

    from dflash_recipes.cli import main
    from dflash_recipes.executor import launch
    from dflash_recipes.executor.training import fit

    plan = tmp_path / "plan.json"
    plan.write_text(tiny_scratch_plan(tmp_path / "run").to_json())
    launched: list[list[str]] = []

    def fake_launch(argv: list[str]) -> int:
        launched.append(argv)
        return 0

    monkeypatch.setattr(launch, "launch_torchrun", fake_launch)
    result = CliRunner().invoke(
        main, ["run", str(plan), "--skip-memory-check", "--nproc-per-node", "2"]
    )
    assert result.exit_code == 0, result.output
    (argv,) = launched
    assert argv[argv.index(str(plan)) :] == [str(plan), "--skip-memory-check"]
    given: list[bool] = []

    def fake_run_plan(plan: object, **kwargs: object) -> object:
        given.append(bool(kwargs["skip_memory_check"]))
        raise SystemExit(0)

    monkeypatch.setattr(fit, "run_plan", fake_run_plan)
    CliRunner().invoke(main, ["run", str(plan), "--skip-memory-check"])
    CliRunner().invoke(main, ["run", str(plan)])
    assert given == [True, False]
