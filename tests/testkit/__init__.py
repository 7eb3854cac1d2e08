"""The one home of what tests, benchmarks and tools share: fixture writers and tiny models.

pytest puts `tests/` on sys.path (`pythonpath` in pyproject.toml), so a test imports
`from testkit.st_fixtures import write_base_model`; the benchmarks get the same path from
`benchmarks/_measure.py`. A test module never imports another test module.

- :mod:`testkit.st_fixtures` -- tiny safetensors checkpoints and config.json files (no torch).
- :mod:`testkit.recipe_samples` -- recipe YAML texts and the line/column finders for them.
- :mod:`testkit.compiling` -- compiling in tmp_path and picking diagnostics out of the result.
- :mod:`testkit.cli_runner` -- invoking `dflash-recipe` in-process, failing on a traceback.
- :mod:`testkit.tiny` -- tiny resolved run plans, tiny random targets, weights far from init.
- :mod:`testkit.fixture_8b` -- a Qwen3-8B-scale warm-start fixture (sparse, compile-only).
"""
