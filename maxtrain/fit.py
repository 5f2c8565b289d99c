"""Will it fit? The memory a run needs per device against what the device has, before it is allocated.

Two checks, each before the memory it guards is touched: the train state's shards (from the abstract
state, before init or restore) and the compiled step's whole footprint (XLA's memory analysis:
arguments, temporaries, outputs; before the first batch). A config that cannot fit is one line with
the numbers, instead of an allocator failure deep in XLA or a host that swaps until it is killed.
"""

from __future__ import annotations

import os

import jax

from maxtrain import summary
from maxtrain.errors import UserError

GiB = 1024**3
ADVICE = ("shard more (ici_fsdp_parallelism), remat_policy=full, bfloat16 weights, or a smaller model or "
          "per_device_batch_size")


class FitError(UserError):
    kind = "memory"


def device_memory(device) -> tuple[float, str]:
    """(bytes one device may use, where that figure comes from). CPU devices share the host's RAM."""
    if device.platform == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n = jax.local_device_count()
        return ram / n, f"{ram / GiB:.1f} GiB of host memory" + (f" shared by {n} CPU devices" if n > 1 else "")
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return (float(limit), f"{device.device_kind}") if limit else (float("inf"), "unknown")


def _check(what: str, need: float, device) -> None:
    have, source = device_memory(device)
    if need > have:
        raise FitError(f"{what} needs {need / GiB:.2f} GiB per device, more than the {have / GiB:.2f} GiB a device "
                       f"has ({source}); {ADVICE}")


def check_state(trainer) -> None:
    """The parameters and optimizer state alone, from their shapes and shardings."""
    need = sum(summary.shard_bytes(x) for x in jax.tree.leaves(trainer.abstract_state))
    _check("the train state", need, trainer.mesh.devices.flat[0])


def check_compiled(compiled, mesh, what: str = "the train step") -> None:
    """A compiled program (the train step: state, batch, activations and temporaries; or the init)."""
    _check(what, summary.memory_report(compiled)["total"] * GiB, mesh.devices.flat[0])
