"""The `serve-target` command: the one `vllm serve` line that serves what a plan's target needs."""

from __future__ import annotations

import os
import shlex
import shutil
import sys

import click

from dflash_recipes.cli.group import _ANY_PATH_STR, EXIT_USAGE, _fail, load_plan_or_recipe, main

#: The executable `--exec` replaces this process with.
VLLM_EXECUTABLE = "vllm"
#: The environment variable vLLM reads its API key from when `--api-key` is not given.
VLLM_API_KEY_ENV = "VLLM_API_KEY"


@main.command("serve-target")
@click.argument("recipe_or_plan", type=_ANY_PATH_STR)
@click.argument("overrides", nargs=-1)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    help="The server's port (default: the port of target_server.urls[0], else 8000).",
)
@click.option(
    "--tensor-parallel-size",
    type=click.IntRange(min=1),
    help="GPUs the target is split over (vLLM's --tensor-parallel-size; default: vLLM's, 1).",
)
@click.option(
    "--exec",
    "exec_",
    is_flag=True,
    help="Run the command instead of printing it (this process becomes `vllm serve`).",
)
def serve_target_command(
    recipe_or_plan: str,
    overrides: tuple[str, ...],
    port: int | None,
    tensor_parallel_size: int | None,
    exec_: bool,
) -> None:
    """Print the `vllm serve` command that serves the target as RECIPE_OR_PLAN needs it.

    One shell-quoted line on stdout: the target's path, --served-model-name, --dtype (the
    plan's, never auto), --max-model-len (training.training_seq_len + 1), --port, and vLLM's
    hidden-states extraction (the taps as vLLM layer ids: a tap t is id t + 1, plus the last
    layer when the objective needs the target's logits) written by ExampleHiddenStatesConnector
    into target_server.storage_dir. Written for vLLM 0.24 and later. The recipe needs a
    target_server section; run one command per URL it lists (each with its --port).

    \b
    Examples:
      dflash-recipe serve-target recipe.yaml --tensor-parallel-size 4
      CUDA_VISIBLE_DEVICES=0,1,2,3 dflash-recipe serve-target plan.json --port 8000 --exec
      dflash-recipe serve-target recipe.yaml \\
          'target_server.urls=[http://localhost:8000]' target_server.storage_dir=/dev/shm/hs
    """
    from dflash_recipes.plan.target_server_settings import default_port, vllm_serve_command

    plan = load_plan_or_recipe(recipe_or_plan, overrides)
    server = plan.target_server
    if server is None:
        _fail(
            f"{recipe_or_plan} has no target_server section, so its target runs in the trainer "
            "and there is nothing to serve; add one, e.g.\n"
            "target_server:\n"
            "  urls: [http://localhost:8000]\n"
            "  storage_dir: /dev/shm/dflash-hidden-states\n"
            "(or pass the overrides 'target_server.urls=[http://localhost:8000]' "
            "target_server.storage_dir=/dev/shm/dflash-hidden-states)",
            EXIT_USAGE,
        )
    try:
        argv = vllm_serve_command(
            plan.base_model.path,
            server,
            port=port if port is not None else default_port(server),
            tensor_parallel_size=tensor_parallel_size,
        )
    except ValueError as exc:
        _fail(f"{recipe_or_plan}: {exc}", EXIT_USAGE)
    line = shlex.join(argv)
    key_env = server.api_key_env
    if not exec_:
        click.echo(line)
        if key_env is not None:
            click.echo(
                f"note: the trainer sends the key in ${key_env}; start the server with the same "
                f'key: {VLLM_API_KEY_ENV}="${key_env}" {shlex.join(argv[:2])} ...',
                err=True,
            )
        return
    executable = shutil.which(VLLM_EXECUTABLE)
    if executable is None:
        _fail(
            f"`{VLLM_EXECUTABLE}` is not on PATH, so --exec cannot start the server; install "
            "vLLM 0.24 or later (pip install 'vllm>=0.24') in this environment, or run the "
            "command without --exec where vLLM is installed"
        )
    if key_env is not None and key_env in os.environ:
        os.environ[VLLM_API_KEY_ENV] = os.environ[key_env]  # never on the command line
    click.echo(f"exec: {line}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(VLLM_EXECUTABLE, argv)


__all__ = ["serve_target_command"]
