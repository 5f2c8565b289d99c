"""Multi-process start-up through JAX's own runtime (jax.distributed): nothing home-made.

Every host runs the same command. JAX's coordination service connects the processes, detects a dead
one by missed heartbeats, and XLA SPMD does the rest. Must run before anything touches devices.
"""

from __future__ import annotations

import os

import jax

from maxtrain.config import Config

# Environment variables by which the cluster says this is one of several processes.
_CLUSTER_HINTS = (
    ("SLURM_NTASKS", lambda v: int(v) > 1),                          # SLURM srun
    ("TPU_WORKER_HOSTNAMES", lambda v: "," in v),                    # Cloud TPU pod slice
    ("MEGASCALE_NUM_SLICES", lambda v: int(v) > 1),                  # TPU multislice
    ("JOBSET_NAME", lambda v: bool(v)),                              # GKE JobSet
    ("JAX_COORDINATOR_ADDRESS", lambda v: bool(v)),
)


def _cluster_detected() -> bool:
    for name, test in _CLUSTER_HINTS:
        value = os.environ.get(name)
        try:
            if value is not None and test(value):
                return True
        except ValueError:
            continue
    return False


def wanted(c: Config) -> bool:
    if c.distributed_init == "auto":
        return bool(c.coordinator_address) or _cluster_detected()
    return c.distributed_init == "true"


def initialize(c: Config) -> None:
    """jax.distributed.initialize() when the run is multi-process; a no-op otherwise."""
    if not wanted(c) or jax.distributed.is_initialized():
        return
    # CPU processes need a collectives implementation; this setting only affects the CPU backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {"heartbeat_timeout_seconds": c.distributed_heartbeat_timeout_seconds}
    if c.coordinator_address:  # explicit; otherwise JAX auto-detects Cloud TPU / SLURM / GKE
        kwargs.update(coordinator_address=c.coordinator_address)
    if c.num_processes > 0:
        kwargs.update(num_processes=c.num_processes)
    if c.process_id >= 0:
        kwargs.update(process_id=c.process_id)
    jax.distributed.initialize(**kwargs)
