"""What every entry point that runs on devices does first (train, generate; the benchmarks too): the
config resolved for this process's devices. No entry point's code lives
here, so the entry points import it and none imports another."""

from __future__ import annotations

import os

import jax

from maxtrain.config import load as config_lib, resolve

from maxtrain.config import keys as config_keys
from maxtrain.launch import distributed
from maxtrain.runtime import pathways


def load_config(argv: list[str], devices=None) -> resolve.Resolved:
    """Parse and validate, start jax.distributed if the run is multi-process, then fit the mesh."""
    c = config_lib.load(argv)
    distributed.initialize(c)  # before anything touches devices
    devices = devices or pathways.devices()
    if jax.process_count() > 1 and c.num_epochs != -1 and c.dataset_type not in ("synthetic", "prepared"):
        # Streamed files: each row of the batch reads its own share of them, and the shares end at different
        # steps; the processes whose rows ran out would stop while the others wait for them in the step.
        raise config_keys.ConfigError("num_epochs", f"{c.num_epochs}: streamed files with several processes end "
                                     "at different steps: use -1 (repeat) and end the run with steps, or "
                                     "dataset_type=prepared (exact epochs)")
    if c.compilation_cache_dir:  # a rerun of the same program loads its executables instead of compiling
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(c.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        if jax.process_count() > 1 and devices[0].platform == "cpu":
            same_cache_keys_on_every_cpu_process()
    return resolve.resolve(c, devices)


def same_cache_keys_on_every_cpu_process() -> None:
    """JAX keys a cached executable by the devices' topology fingerprint, and on CPU each process's differs
    (jax 0.12), while only process 0 writes entries: every other process missed the cache on every start,
    compiled the whole step again, and the first step waited for it (8 s of a tiny 2-process start). On CPU
    the devices' kind keys it alike; the compile options in the key already name every device by id."""
    from jax._src import cache_key  # no public switch: the key's parts are internal
    accelerator_config, by_kind = getattr(cache_key, "_hash_accelerator_config", None), \
        getattr(cache_key, "_hash_devices", None)
    if accelerator_config is None or by_kind is None or getattr(accelerator_config, "cpu_by_kind", False):
        return

    def hashed(hash_obj, devices):
        if all(d.platform == "cpu" for d in devices.flat):
            return by_kind(hash_obj, devices)
        return accelerator_config(hash_obj, devices)
    hashed.cpu_by_kind = True
    cache_key._hash_accelerator_config = hashed
