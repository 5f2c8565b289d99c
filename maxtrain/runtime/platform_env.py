"""The CPU platform chosen up front on a machine without accelerators, so libtpu stays silent.

With no platform asked for (JAX_PLATFORMS unset), JAX tries every backend it knows, TPU among them when
libtpu is installed (the `tpu` extra); on a machine without TPU chips libtpu then prints its start-up
errors (`E0000 ... unexpected worker hostname`) before JAX falls back to the CPU. Where the machine has
no TPU and no GPU, the entry points ask for the CPU, which is what JAX would end up with anyway.
"""

from __future__ import annotations

import os


def has_accelerator() -> bool:
    """TPU chips or a GPU, found the way JAX finds them (PCI vendor ids, device nodes), without loading any
    runtime."""
    try:
        from jax._src import hardware_utils
        return (hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
                or hardware_utils.has_visible_nvidia_gpu() or hardware_utils.num_available_amd_gpus(stop_at=1) > 0)
    except (ImportError, AttributeError, OSError):  # another jax: leave the choice to it
        return True


def quiet_without_accelerators() -> None:
    """Call before anything initializes a JAX backend. A platform the user chose (JAX_PLATFORMS or
    jax_platforms) is left as it is."""
    import jax
    if (os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ or jax.config.jax_platforms
            or has_accelerator()):
        return
    jax.config.update("jax_platforms", "cpu")
