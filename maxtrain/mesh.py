"""Device mesh from the config, and logical-axis-name -> NamedSharding translation.

This is the only module that names mesh axes. Everything else speaks logical names.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtrain.config import MESH_AXES, Config


def num_slices(devices=None) -> int:
    """The units the dcn_* axes split: TPU slices, or, where devices carry no slice index (GPU and
    CPU clusters), processes, i.e. hosts, as in mesh_utils' `process_is_granule`."""
    devices = devices or jax.devices()
    if devices[0].platform == "tpu":
        return 1 + max(getattr(d, "slice_index", 0) for d in devices)
    return len({d.process_index for d in devices})


def make_mesh(config: Config, devices=None) -> Mesh:
    devices = devices or jax.devices()
    ici = [config.mesh_ici[a] for a in MESH_AXES]
    dcn = [config.mesh_dcn[a] for a in MESH_AXES]
    if config.num_slices > 1:
        # TPU: slices are the granules of the hybrid mesh; GPU and CPU clusters: processes (hosts).
        grid = _on_torus(mesh_utils.create_hybrid_device_mesh, ici, dcn, devices,
                         process_is_granule=devices[0].platform != "tpu")
    elif devices[0].platform in ("tpu", "gpu"):
        grid = _on_torus(mesh_utils.create_device_mesh, ici, devices)  # topology-aware ordering
    else:
        grid = np.asarray(devices).reshape(ici)
    return Mesh(grid, MESH_AXES)


def _on_torus(create, *args, **kwargs):
    """mesh_utils' topology-aware device grid; where an axis spans no whole set of torus dimensions (8 on
    a 4x4x4 slice), one dimension is split between axes, as MaxText's allow_split_physical_axes does."""
    try:
        return create(*args, **kwargs)
    except NotImplementedError:
        return create(*args, **kwargs, allow_split_physical_axes=True)


def axis_rules(config: Config) -> tuple:
    """logical_axis_rules from YAML lists to the tuples flax expects."""
    return tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in config.logical_axis_rules)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: tuple):
    """Mesh + logical rules in scope, so the model's logical constraints take effect under jit."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def logical_to_sharding(logical_specs, mesh: Mesh, rules: tuple):
    """Tree of logical PartitionSpecs -> tree of NamedShardings."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def sharding_for(logical_axes: tuple, mesh: Mesh, rules: tuple) -> NamedSharding:
    return logical_to_sharding(PartitionSpec(*logical_axes), mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
