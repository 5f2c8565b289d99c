"""What every key has in common, beside the declarations (maxtrain.config.schema): how the mesh keys are named,
the bounds of jax's number types, the keys that were replaced, and the one error type a config problem raises."""

from __future__ import annotations

import re

from maxtrain.runtime.errors import ConfigError  # noqa: F401 (its home is runtime.errors; imported from here too)


def parallelism_key(group: str, axis: str) -> str:
    """The key that sizes mesh `axis` in `group` (ici or dcn): MaxText's names, `pipeline` for stage."""
    return f"{group}_{'pipeline' if axis == 'stage' else axis}_parallelism"


INT_MAX = 2**31 - 1  # steps and sizes reach jax as int32
FLOAT32_MAX = 3.4028234663852886e38  # float keys reach jax as float32: larger is inf there
# Keys that were replaced: what to write instead.
RENAMED = {"learning_rate_schedule": "renamed lr_schedule_type (MaxText's name): cosine | wsd | linear | constant",
           "enable_tensorboard": "replaced by metrics_backends (default tensorboard,jsonl; metrics_backends=jsonl "
                                 "writes no tensorboard events)"}

# Values config.load derives from the keys alone and adds to the config (those that need the devices:
# maxtrain.config.resolve.DERIVED).
DERIVED_AT_LOAD = ("run_name_derived", "moe_mlp_dim", "num_params", "num_active_params")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
