"""The executor commands through the CLI: run, export, eval (in process, tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from testkit.compiling import SMALL_BLOCKS, TINY_SCRATCH

from dflash_recipes.cli import main

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def _eval_args(run_dir: Path) -> list[str]:
    """`dflash-recipe eval` of a run's export on 2 demo prompts, 12 new tokens, JSON out."""
    prompts = REPO / "dflash_recipes" / "demo_data" / "data" / "eval.jsonl"
    return [
        "eval",
        str(run_dir / "plan.json"),
        "--checkpoint",
        str(run_dir / "export"),
        "--prompts",
        str(prompts),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--json",
    ]


def test_run_then_export_and_eval(tmp_path: Path) -> None:
    out = tmp_path / "run"
    runner = CliRunner()
    args = [
        "run",
        str(TINY_SCRATCH),
        f"training.output_dir={out}",
        "training.max_steps=2",
        "training.save_steps=1",
        "training.save_total_limit=null",
        *SMALL_BLOCKS,
        "--no-progress",
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "done: 2 steps" in result.output

    # Export the step-1 checkpoint with the run's plan.json (found next to it).
    exported = tmp_path / "step1"
    result = runner.invoke(main, ["export", str(out / "checkpoint-00000001"), str(exported)])
    assert result.exit_code == 0, result.output
    weights = load_file(str(exported / "model.safetensors"))
    saved = load_file(str(out / "checkpoint-00000001" / "model.safetensors"))
    assert weights.keys() == saved.keys()
    assert all(torch.equal(weights[k], saved[k]) for k in weights)
    config = json.loads((exported / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]

    result_args = _eval_args(out)
    result = runner.invoke(main, result_args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["lossless"] is True
    assert 1.0 <= report["tau"] <= 4.0
    assert report["num_prompts"] == 2
    per_prompt = report["tau_per_prompt"]
    assert report["tau_pooled"] == report["tau"]
    assert report["tau_per_prompt_mean"] == pytest.approx(sum(per_prompt) / len(per_prompt))

    text_args = [a for a in result_args if a != "--json"]
    result = runner.invoke(main, text_args)
    assert result.exit_code == 0, result.output
    assert f"tau, pooled over all verification steps: {report['tau']:.3f}" in result.output
    mean = f"{report['tau_per_prompt_mean']:.3f}"
    assert f"tau, mean of per-prompt means (z-lab's benchmark figure): {mean}" in result.output


def test_export_without_plan_says_how(tmp_path: Path) -> None:
    lonely = tmp_path / "checkpoint-00000001"
    lonely.mkdir()
    result = CliRunner().invoke(main, ["export", str(lonely), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "--plan" in result.output
    assert not (tmp_path / "out").exists()


def test_overrides_on_a_plan_are_refused(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}", encoding="utf-8")
    result = CliRunner().invoke(main, ["run", str(plan), "training.max_steps=3"])
    assert result.exit_code == 2
    assert "overrides apply to recipes" in result.output


def test_run_fails_its_acceptance_gate_after_the_export(tmp_path: Path) -> None:
    # training.eval_min_tau (issue 38): the run trains, saves and exports, then exits 1 with
    # one line when its last held-out tau is below the gate; its card records that tau.
    out = tmp_path / "run"
    args = [
        "run",
        str(TINY_SCRATCH),
        f"training.output_dir={out}",
        "training.max_steps=2",
        "training.eval_steps=2",
        *SMALL_BLOCKS,
        "--no-progress",
    ]
    result = CliRunner().invoke(main, [*args, "training.eval_min_tau=100"])
    assert result.exit_code == 1, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("acceptance gate failed: measured tau ")
    assert last.endswith(
        " is below the required 100 (training.eval_min_tau, held-out eval at step 2)"
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tau = next(row["tau"] for row in rows if row["kind"] == "eval")
    assert f"measured tau {tau:.3g} is below" in last
    card = (out / "export" / "README.md").read_text(encoding="utf-8")
    assert f"| acceptance length tau (pooled) | **{tau:.3f}** |" in card
    assert "| measured by | held-out eval during training, at step 2 |" in card
    # A gate the measurement reaches passes (tau >= 1 always): the finished run, exit 0.
    again = CliRunner().invoke(main, [*args, "training.eval_min_tau=1"])
    assert again.exit_code == 0, again.output
    assert "already finished" in again.output and "acceptance gate" not in again.output


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--rdzv-endpoint", "node001:29500"], "--rdzv-endpoint"),
        (["--rdzv-id", "4242"], "--rdzv-id"),
    ],
)
def test_rendezvous_options_without_a_launch_are_a_usage_error(
    options: list[str], named: str, tmp_path: Path
) -> None:
    # before: the run trained as one process and ignored them, on every node of a job
    out = f"training.output_dir={tmp_path / 'out'}"
    result = CliRunner().invoke(
        main, ["run", str(TINY_SCRATCH), out, "training.max_steps=1", *options]
    )
    assert result.exit_code == 2, result.output
    assert f"{named} applies only to a torchrun launch, and this command starts none" in (
        result.output
    )
    assert "--nproc-per-node N" in result.output
    assert "Traceback" not in result.output


def test_verbose_reaches_the_processes_torchrun_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash_recipes.executor.launch as launch

    launched: list[list[str]] = []

    def record(argv: list[str]) -> int:
        launched.append(list(argv))
        return 0

    monkeypatch.setattr(launch, "launch_torchrun", record)
    for command in (["run"], ["capture", "--output", str(tmp_path / "capture")]):
        result = CliRunner().invoke(
            main,
            [
                *command,
                str(TINY_SCRATCH),
                f"training.output_dir={tmp_path / 'out'}",
                "--nproc-per-node",
                "2",
                "-v",
            ],
        )
        assert result.exit_code == 0, result.output
    run_argv, capture_argv = launched
    for argv in (run_argv, capture_argv):
        worker = argv[argv.index("dflash_recipes.cli") + 1 :]
        assert "-v" in worker, worker


def test_run_prints_the_held_out_tau_first_and_warns_when_far_below_the_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary line and the one warning line `run` prints (the training is stubbed)."""
    from dflash_recipes.executor.training import fit
    from dflash_recipes.executor.training.summary import TrainSummary

    def trained(*args: object, **kwargs: object) -> TrainSummary:
        return TrainSummary(
            steps=300,
            resumed_from_step=None,
            final_loss=0.03,
            accuracy_by_position=(0.0, 0.99),
            acceptance_length_estimate=7.65,
            tokens_per_second=1.0,
            export_dir=str(tmp_path / "run" / "export"),
            warm_start=None,
            data_summary="",
            last_eval_tau=1.06,
            planned_steps=300,
            steps_this_run=300,
        )

    monkeypatch.setattr(fit, "run_plan", trained)
    args = ["run", str(TINY_SCRATCH), f"training.output_dir={tmp_path / 'run'}", "--no-progress"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-2].startswith("done: 300 steps, held-out tau 1.06, loss 0.0300, ")
    assert lines[-1].startswith(
        "warning: the held-out tau 1.06 gains only 1% of what the training-batch estimate 7.65 "
        "gains over 1: the drafter predicts its training conversations far better than new ones"
    )


def test_a_dflash2_drafter_warm_starts_from_dflash1_then_runs_exports_and_evals(
    tmp_path: Path,
) -> None:
    """The tiny DFlash 2 path through the CLI: a DFlash 1 export warm-starts its backbone, it
    trains (the selector's accuracy logged beside the unary one), exports in the z-lab DFlash 2
    layout and evaluates losslessly with the selector, tau with and without it reported."""
    runner = CliRunner()
    common = ["training.max_steps=2", "training.save_steps=2", *SMALL_BLOCKS, "--no-progress"]
    plain = tmp_path / "plain"
    result = runner.invoke(
        main, ["run", str(TINY_SCRATCH), f"training.output_dir={plain}", *common]
    )
    assert result.exit_code == 0, result.output
    arch = "dflash.dflash_architecture_config"
    out = tmp_path / "d2"
    args = [
        "run",
        str(TINY_SCRATCH),
        f"training.output_dir={out}",
        f"dflash.dflash_init_checkpoint={plain / 'export'}",
        f"{arch}.projector_type=dflash2",
        f"{arch}.conv_kernel_size=2",
        f"{arch}.conv_group_size=8",
        f"{arch}.selector_rank=4",
        f"{arch}.selector_top_k=4",
        "dflash.dflash_selector_loss_alpha=0.5",
        *common,
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "done: 2 steps" in result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert train and all(len(r["selector_accuracy_by_position"]) == 4 for r in train)
    assert all(r["selector_accuracy_by_position"][0] is None for r in train)

    weights = load_file(str(out / "export" / "model.safetensors"))
    source = load_file(str(plain / "export" / "model.safetensors"))
    new = set(weights) - set(source)
    assert set(source) <= set(weights) and len(new) == 2 * 4 + 3
    assert "candidate_selector.successor_codebook" in new
    assert "layers.1.mlp_conv.kernel_projection.weight" in new
    # the new parts trained away from their identity / zero start
    assert weights["candidate_selector.successor_codebook"].abs().sum() > 0
    assert weights["layers.0.attention_conv.kernel_projection.weight"].abs().sum() > 0
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"]["selector_top_k"] == 4

    result = runner.invoke(main, _eval_args(out))
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    assert report["lossless"] is True
    assert 1.0 <= report["tau"] <= 4.0
    assert 1.0 <= report["tau_without_head"] <= 4.0
