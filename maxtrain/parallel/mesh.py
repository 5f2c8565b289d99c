"""The device mesh: the device grid for a resolved config (maxtrain.config.resolve), and the mesh and the
logical rules in scope while a step is traced. Logical names -> mesh axes: maxtrain.parallel.rules.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")  # stage (the pipeline) outermost


def make_mesh(config, devices=None) -> Mesh:
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


@contextlib.contextmanager
def activate(mesh: Mesh, rules: tuple):
    """Mesh + logical rules in scope, so the model's logical constraints take effect under jit."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield
