"""The run's name when the config gives none: the config file's stem and a short hash of what defines the run.

Two commands that train the same model on the same data with the same optimizer share a directory (so a rerun
with more steps resumes); any other difference in the model, optimizer or data gives another name (so a new
model starts a new run instead of being refused by the old run's checkpoints). Keys that only say how long,
how often, where, on which mesh or how fast are left out of the hash. Only the values that differ from
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

from maxtrain.config.keys import parallelism_key
from maxtrain.parallel.mesh import MESH_AXES

# Keys that do not change what is trained (the model, optimizer, data and their order): how long and how
# often, where the outputs go, how the work is laid out on the devices, and the other entry points' keys.
NOT_DEFINING = frozenset({
    "run_name", "base_output_directory", "steps", "learning_rate_schedule_steps", "log_period", "dry_run", "compilation_cache_dir",
    "eval_files", "eval_sources", "eval_interval", "eval_steps", "grain_worker_count", "prepared_dir", "prepare_workers",
    "enable_checkpointing", "async_checkpointing", "checkpoint_period", "max_num_checkpoints_to_keep",
    "local_checkpoint_directory", "local_checkpoint_period", "failure_interval_hours",
    "nan_policy", "max_nonfinite_steps", "loss_spike_factor",
    "metrics_backends", "enable_goodput_recording", "peak_tflops_per_device", "profiler", "profiler_start_step", "profiler_steps",
    "compile_topology", "compile_topology_num_slices",
    "prompt", "prompt_ids", "prompt_file", "generate_batch_size", "max_new_tokens", "temperature", "top_k", "top_p",
    "sampling_seed", "sample_interval", "sample_prompts",
    "distributed_init", "coordinator_address", "num_processes", "process_id", "distributed_heartbeat_timeout_seconds",
    "per_device_batch_size",  # the global batch (per device x devices) is what defines the run: derive() adds it
    "logical_axis_rules", "context_parallel_load_balance", "context_parallel_strategy", "scan_unroll", "remat_policy",
    "mlp_chunk_size", "loss_chunk_size", "attention", "moe_grouped_matmul",
    *(parallelism_key(group, axis) for group in ("ici", "dcn") for axis in MESH_AXES),
    "num_pipeline_microbatches", "num_layers_per_pipeline_stage", "num_pipeline_repeats",
})
HASH_CHARS = 8


def defining(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The keys that define the run and differ from base.yml, sorted."""
    return {k: values[k] for k in sorted(defaults) if k not in NOT_DEFINING and values[k] != defaults[k]}


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
