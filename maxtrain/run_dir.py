"""The run's directory, base_output_directory/run_name: made at start, its config.yml written once the state
is ready, and removed again when this start made it and failed before its first step."""

from __future__ import annotations

from pathlib import Path

import jax

from maxtrain import config as config_lib, storage


def make(c: config_lib.Config) -> tuple[Path, bool]:
    """The run's directory, and whether this start created it."""
    run_dir = storage.path(c.base_output_directory, "base_output_directory") / c.run_name
    storage.check_bucket(run_dir, "base_output_directory")
    created = not run_dir.exists()
    if jax.process_index() == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise config_lib.ConfigError("base_output_directory",
                                         f"cannot write {run_dir}: {e.strerror or storage.error_text(e)}") from None
    return run_dir, created


def write_config(c: config_lib.Config, run_dir: Path) -> None:
    """Only once the state is initialized or restored: a refused resume leaves the run's config as it was."""
    if jax.process_index() == 0:
        try:
            (run_dir / "config.yml").write_text(c.to_yaml())
        except OSError as e:
            raise config_lib.ConfigError("base_output_directory",
                                         f"cannot write {run_dir}: {e.strerror or storage.error_text(e)}") from None


def remove_if_unused(run_dir: Path) -> None:
    """A start that fails before its first step leaves nothing behind: the directory it created goes,
    unless a step was written to it (metrics or a checkpoint)."""
    if jax.process_index() != 0 or not run_dir.is_dir():
        return
    metrics = run_dir / "metrics.jsonl"
    checkpoints = run_dir / "checkpoints"
    if (metrics.exists() and storage.size(metrics)) or (checkpoints.is_dir() and any(
            p.name.isdigit() for p in checkpoints.iterdir())):
        return
    storage.rmtree(run_dir)
