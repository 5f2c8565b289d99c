"""Whether a run is already finished, from its files alone: a rerun of a finished run says so before anything
is compiled, restored or read (the restore and the compile take a minute on a real model)."""

from __future__ import annotations

import json

from maxtrain.checkpoint.describe import as_written_now
from maxtrain.config.schema import model_keys
from maxtrain.runtime import storage


def finished_step(c) -> int | None:
    """The run's newest saved step when it is at or past `steps`, not judged a spike, and of this model (any
    doubt, and the run starts as usual: the restore says what is wrong)."""
    if not c.enable_checkpointing or c.load_full_state_path:
        return None
    directory = storage.path(c.base_output_directory, "base_output_directory") / c.run_name / "checkpoints"
    try:
        steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()]
        if not steps or max(steps) < c.steps:
            return None
        newest = max(steps)
        verdicts = json.loads((directory / "trust.json").read_text()) if (directory / "trust.json").exists() else {}
        saved = json.loads((directory / str(newest) / "model" / "metadata").read_text())
    except (OSError, ValueError):
        return None
    if str(newest) in verdicts.get("rejected", {}):
        return None
    saved = as_written_now(saved)
    return newest if all(saved.get(k) == c[k] for k in model_keys()) else None
