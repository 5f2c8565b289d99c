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
    return resolve.resolve(c, devices)
