"""The run's directory, base_output_directory/run_name: made at start, its config.yml and starts.jsonl written
once the state is ready, and removed again when this start made it and failed before its first step."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import yaml

from maxtrain.config import load as config_lib, yaml_file

from maxtrain.config import keys as config_keys
from maxtrain.observe import run_record
from maxtrain.runtime import storage


def make(c: config_lib.Config) -> tuple[Path, bool]:
    """The run's directory, and whether this start created it."""
    run_dir = storage.path(c.base_output_directory, "base_output_directory") / c.run_name
    storage.check_bucket(run_dir, "base_output_directory")
    created = not run_dir.exists()
    if jax.process_index() == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise config_keys.ConfigError("base_output_directory",
                                         f"cannot write {run_dir}: {e.strerror or storage.error_text(e)}") from None
    return run_dir, created


def write_config(c: config_lib.Config, run_dir: Path, record: dict) -> None:
    """Only once the state is initialized or restored: a refused resume leaves the run's files as they were.
    config.yml is the first start's resolved config (it loads again as a config) and stays; every start adds
    its record (command line, versions, devices, its config) to starts.jsonl, and says how this start's config
    differs from config.yml's."""
    if jax.process_index() != 0:
        return
    first = run_dir / "config.yml"
    try:
        kept = _read_yaml(first)
        if kept is None:
            first.write_text(c.to_yaml())
        f = storage.open_append(run_dir / "starts.jsonl")
        try:
            f.write(json.dumps(record, default=str) + "\n")
        finally:
            f.close()
    except OSError as e:
        raise config_keys.ConfigError("base_output_directory",
                                     f"cannot write {run_dir}: {e.strerror or storage.error_text(e)}") from None
    changed = run_record.differences(kept, c) if kept is not None else ""
    if changed:
        print(f"note: this start's config differs from {first} (the first start's): {changed}", flush=True)


def last_start_config(run_dir: Path) -> dict | None:
    """The resolved config of the run's last start (starts.jsonl), or None."""
    try:
        lines = (run_dir / "starts.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["config"] if lines else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_yaml(path: Path) -> dict | None:
    """config.yml's keys; None if there is none (or it is not a mapping: written again)."""
    try:
        kept = yaml_file.safe_load(path.read_text()) if path.exists() else None
    except yaml.YAMLError:
        return None
    return kept if isinstance(kept, dict) else None


def remove_if_unused(run_dir: Path) -> None:
    """A start that fails before its first step leaves nothing behind: the directory it created goes,
    unless a step was written to it (metrics or a checkpoint)."""
    if jax.process_index() != 0 or not run_dir.is_dir():
        return
    checkpoints = run_dir / "checkpoints"
    if _has_steps(run_dir / "metrics.jsonl") or (checkpoints.is_dir() and any(
            p.name.isdigit() for p in checkpoints.iterdir())):
        return
    storage.rmtree(run_dir)


def _has_steps(metrics: Path) -> bool:
    """Whether metrics.jsonl holds a step's record (a start's own record is written before any step)."""
    if not metrics.exists():
        return False
    for line in metrics.read_text().splitlines():
        try:
            if "start" not in json.loads(line):
                return True
        except ValueError:  # a line cut short by a kill: a step was being written
            return True
    return False
