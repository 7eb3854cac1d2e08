"""What `compile --device-memory` reports about a plan's memory: the `resources-exceed-device`
error with what would fit, and nothing (not even the fit search loaded) when it fits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.compiling import tiny_scratch_plan

from dflash_recipes.compiler.codes import RESOURCES_EXCEED_DEVICE
from dflash_recipes.compiler.resource_report import device_diagnostic
from dflash_recipes.diagnostics import Severity
from dflash_recipes.plan.resources.estimate import GIB, estimate_resources, gib
from dflash_recipes.plan.resources.fit import exceed_message, fit_advice

_FITS_WITHOUT_THE_SEARCH = """
import json, sys
from dflash_recipes.compiler.resource_report import device_diagnostic
from dflash_recipes.plan.resources.estimate import estimate_resources
from dflash_recipes.plan.run_plan import RunPlan

plan = RunPlan.from_json(open(sys.argv[1], encoding="utf-8").read())
finding = device_diagnostic(plan, estimate_resources(plan), 1000.0, recipe_file=None)
print(json.dumps({"finding": finding is not None,
                  "fit": "dflash_recipes.plan.resources.fit" in sys.modules}))
"""


def test_a_plan_that_does_not_fit_is_an_error_naming_the_device(tmp_path: Path) -> None:
    plan = tiny_scratch_plan(tmp_path / "out")
    resources = estimate_resources(plan)
    device = resources.memory.total / GIB / 2
    finding = device_diagnostic(plan, resources, device, recipe_file="recipe.yaml")
    assert finding is not None
    assert (finding.severity, finding.code, finding.path, finding.file) == (
        Severity.ERROR,
        RESOURCES_EXCEED_DEVICE,
        "training",
        "recipe.yaml",
    )
    assert finding.message.startswith(
        f"the plan needs about {gib(resources.memory.total)} GiB per rank on 1 rank(s) ("
    )
    # the words `run` refuses the same plan with on a device of that size
    device_bytes = int(device * GIB)
    advice = fit_advice(plan, device_bytes, world_size=1, device=resources.device)
    where = f"--device-memory {device:g}"
    assert (finding.message, finding.hint) == exceed_message(
        plan, resources, device_bytes, advice, where=where
    )
    assert finding.message.endswith(f"more than {where} ({gib(device_bytes)} GiB)")


def test_a_plan_that_fits_reports_nothing_and_never_loads_the_fit_search(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_scratch_plan(tmp_path / "out").to_json(), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-c", _FITS_WITHOUT_THE_SEARCH, str(plan_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(done.stdout) == {"finding": False, "fit": False}


def test_the_disk_line_says_the_checkpoints_on_disk_during_a_save(tmp_path: Path) -> None:
    """Issue 49: "x 2 kept" for save_total_limit 1 meant the peak while a save is written (the
    limit plus the new one before the oldest goes), not what stays."""
    from dflash_recipes.compiler.resource_report import render_resources

    plan = tiny_scratch_plan(tmp_path / "out", "training.save_total_limit=1")
    disk = estimate_resources(plan).disk
    (line,) = [x for x in render_resources(estimate_resources(plan)).splitlines() if "disk:" in x]
    assert line.startswith(
        f"disk: checkpoint {gib(disk.checkpoint_bytes)} GiB (2 on disk while one is saved, "
        f"save_total_limit + 1: {gib(2 * disk.checkpoint_bytes)} GiB); export "
    )
    unlimited = tiny_scratch_plan(tmp_path / "out", "training.save_total_limit=null")
    assert (
        f"disk: checkpoint {gib(disk.checkpoint_bytes)} GiB (no save_total_limit: every "
        "checkpoint stays); export"
    ) in render_resources(estimate_resources(unlimited))
