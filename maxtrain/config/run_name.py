"""The run's name when the config gives none: the config file's stem and a short hash of what defines the run.

Two commands that train the same model on the same data with the same optimizer share a directory (so a rerun
with more steps resumes); any other difference in the model, optimizer or data gives another name (so a new
model starts a new run instead of being refused by the old run's checkpoints). Keys that only say how long,
how often, where, on which mesh or how fast are left out of the hash: those whose group
(maxtrain.config.schema.GROUPS) does not define the run. Only the values that differ from
base.yml's defaults enter it: a key added later, at a default that keeps the old behaviour, keeps every
existing name.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from maxtrain.config.schema import declared

HASH_CHARS = 8


def defining(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The keys that define the run and differ from base.yml, sorted."""
    keys = declared()
    return {k: values[k] for k in sorted(defaults) if keys[k].hashed and values[k] != defaults[k]}


def derive(config_file: str, values: Mapping[str, Any], defaults: Mapping[str, Any],
           global_batch: int | None = None) -> str:
    """`<config file's stem>-<hash>`, e.g. shakespeare-3f0c9a1e: a plain name (config.RUN_NAME). The global batch
    (known once the devices are: config.resolve) enters the hash: the same per-device batch on 8 devices is
    another run than on 1 (another data order, another optimization)."""
    stem = re.sub(r"^[^A-Za-z0-9]+", "", re.sub(r"[^A-Za-z0-9._-]", "_", Path(config_file).stem)) or "run"
    defined = defining(values, defaults) | ({"global_batch_size": global_batch} if global_batch else {})
    text = json.dumps(defined, sort_keys=True, separators=(",", ":"))
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]}"


def with_global_batch(values: Mapping[str, Any], defaults: Mapping[str, Any], global_batch: int) -> str:
    """A derived name again, now that the global batch is known (the stem is the load's)."""
    return derive(values["run_name"].rsplit("-", 1)[0], values, defaults, global_batch)


def note(config_file: str, name: str) -> str:
    """What the start says of a derived name."""
    return (f"run_name: {name} (derived from {Path(config_file).name} and the keys that define the model, "
            "optimizer and data; the same command resumes it; set run_name=... to choose one)")
