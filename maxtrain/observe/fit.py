"""Will it fit? The memory a run needs per device against what the device has, before it is allocated.

Three checks, each before the memory it guards is touched: a lower bound of the step's activations
(from the config's shapes, before anything is traced), the train state's shards (from the abstract
state, before init or restore) and the compiled step's whole footprint (XLA's memory analysis:
arguments, temporaries, outputs; before the first batch). A config that cannot fit is one line with
the numbers, instead of an allocator failure deep in XLA or a host that swaps until it is killed.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from maxtrain.observe import summary
from maxtrain.data.rows import BATCH_DTYPES
from maxtrain.runtime.errors import UserError

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
    need = sum(b.get("device", 0) for b in summary.state_bytes(trainer).values())  # not what lives on the host
    _check("the train state", need, trainer.mesh.devices.flat[0])


def check_compiled(compiled, mesh, what: str = "the train step") -> None:
    """A compiled program (the train step: state, batch, activations and temporaries; or the init)."""
    _check(what, summary.memory_report(compiled)["total"] * GiB, mesh.devices.flat[0])


def step_floor(c) -> dict[str, float]:
    """Bytes per device that any train step of this config holds at one moment, from the config alone
    (no trace, no compile): a lower bound of XLA's plan, so a batch or sequence far too large is refused
    in seconds rather than after minutes of compiling, and a config that fits is never refused.

    At the loss, at the end of the forward pass, these are all alive: the batch (an argument), every
    layer's input (kept for the backward pass under every remat_policy: `full` recomputes a layer from
    it, the others keep more), and one chunk of logits (the output of the output-matrix matmul: float32
    with logits_dot_in_fp32, else the compute dtype). Each is divided over all devices, whatever the
    mesh splits; the state, and everything else a step holds, only adds to it.
    """
    n = c.num_devices
    itemsize = 2 if c.dtype == "bfloat16" else 4
    tokens = c.global_batch_size * c.max_target_length
    rows = c.global_batch_size // c.gradient_accumulation_steps  # one micro-batch's
    positions = c.loss_chunk_size if c.loss_chunk_size > 0 else c.max_target_length
    batch_bytes = sum(np.dtype(d).itemsize for d in BATCH_DTYPES.values())
    return {"batch": tokens * batch_bytes / n,
            "layer inputs": c.base_num_decoder_layers * rows * c.max_target_length * c.base_emb_dim * itemsize / n,
            "logits": rows * positions * c.vocab_size * (4 if c.logits_dot_in_fp32 else itemsize) / n}


def check_activations(c, mesh) -> None:
    """step_floor against a device's memory, from the config alone: before the model is even traced
    (tracing a very long sequence takes minutes by itself)."""
    floor = step_floor(c)
    need = sum(floor.values())
    have, source = device_memory(mesh.devices.flat[0])
    weights = c.num_params * (2 if c.weight_dtype == "bfloat16" else 4) / c.num_devices
    if weights > have:
        return  # the parameters alone cannot fit: check_state says so, with the state's exact size
    if need > have:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in floor.items())
        raise FitError(f"the train step needs at least {need / GiB:.2f} GiB per device for its activations ({parts}), "
                       f"more than the {have / GiB:.2f} GiB a device has ({source}); {ADVICE}")
