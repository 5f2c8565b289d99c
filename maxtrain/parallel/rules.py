"""The one logical -> mesh resolver: which mesh axes split each dimension of an array named with
logical axes. Flax's semantics (nn.logical_to_mesh_axes): the rules in order, each used for a dimension
not yet assigned and only where its mesh axes are all still free; and, given the sizes, only the axes
that split a dimension evenly (even_axes). The parameters' shardings, the activations' constraints,
the planners (platform defaults, fit checks, generate) and the config's checks all ask it.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def axis_rules(config) -> tuple:
    """logical_axis_rules from YAML lists to the tuples flax expects."""
    return tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in config["logical_axis_rules"])


def as_list(target) -> list[str]:
    return [] if target is None else [target] if isinstance(target, str) else list(target)


def even_axes(axes, size: int, mesh_shape) -> tuple[list[str], list[str]]:
    """(the mesh axes, in order, that split a dimension of `size` evenly together, the axes left out).
    A dimension the mesh does not divide is replicated on that axis rather than split unevenly: jax
    refuses uneven shards, and XLA would pad them."""
    kept, left, shards = [], [], 1
    for a in axes:
        if size % (shards * mesh_shape[a]):
            left.append(a)
        else:
            kept.append(a)
            shards *= mesh_shape[a]
    return kept, left


def mesh_axes(rules, names: tuple, shape=None, mesh_shape=None) -> list[list[str]]:
    """The mesh axes of each dimension of an array with logical `names` (rules as YAML lists or flax
    tuples); with `shape` and `mesh_shape`, only those that split each dimension evenly."""
    result: list[list[str] | None] = [None] * len(names)
    for name, target in rules:
        axes = as_list(target)
        if name in names and result[names.index(name)] is None and not any(
                a in used for used in result if used for a in axes):
            result[names.index(name)] = axes
    result = [r or [] for r in result]
    if shape is not None:
        result = [even_axes(axes, n, mesh_shape)[0] for axes, n in zip(result, shape)]
    return result


def shards(rules, name: str, mesh_shape, size: int | None = None) -> int:
    """How many devices split the logical dimension `name` (of `size`: as evenly as the resolver splits it)."""
    axes = mesh_axes(rules, (name,), None if size is None else (size,), mesh_shape)[0]
    return math.prod(mesh_shape[a] for a in axes)


# ---------------------------------------------------------------------------------------------
# How a sequence's positions split over devices (context parallelism): one answer, asked by the batch's
# layout, the load-balancing reorder, the attention kernels, the planners and decoding alike.

# Every logical layout a sequence's positions take: the token batch, activations, q/k/v, logits, the MLP.
SEQUENCE_LAYOUTS = (("batch", "length"), ("length",), ("batch", "length", "embed"),
                    ("batch", "length", "heads", "head_dim"), ("batch", "length", "kv_heads", "head_dim"),
                    ("batch", "heads", "length", "head_dim"), ("batch", "length", "vocab"),
                    ("batch", "length", "mlp"))


def sequence_axes(rules) -> list[str]:
    """The mesh axes that split a sequence's positions: `length`'s in the token batch's layout."""
    return mesh_axes(rules, ("batch", "length"))[1]


def sequence_shards(rules, mesh_shape) -> int:
    """How many devices split a sequence's positions (1: every device holds whole sequences)."""
    return math.prod(mesh_shape[a] for a in sequence_axes(rules))


def sequence_layout_conflict(rules) -> str | None:
    """Where the rules would split positions one way in the batch and another in some activation (the kernels
    and the load balancing assume one way): that layout and its axes, or None."""
    batch = sequence_axes(rules)
    for names in SEQUENCE_LAYOUTS:
        axes = mesh_axes(rules, names)[names.index("length")]
        if axes != batch:
            return (f"`length` splits over {axes or 'nothing'} in {list(names)} but over {batch or 'nothing'} in "
                    "the token batch ['batch', 'length']: give `length` the same mesh axes in every layout")
    return None


def partition_spec(axes) -> PartitionSpec:
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes))


def sharding_for(logical_axes: tuple, mesh: Mesh, rules: tuple, shape=None) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(mesh_axes(rules, tuple(logical_axes), shape, mesh.shape)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def in_device_memory(shardings):
    """The same shardings in the device's memory: where a host-offloaded state (pinned_host) is computed on."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def param_shardings(logical_specs, shapes, mesh: Mesh, rules: tuple):
    """NamedShardings of the parameters from their logical specs (a tree of PartitionSpecs) and shapes
    (a matching tree of arrays or ShapeDtypeStructs), each dimension only on the axes that divide it."""
    return jax.tree.map(lambda spec, x: sharding_for(tuple(spec), mesh, rules, x.shape), logical_specs, shapes,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def uneven_notes(logical_specs, shapes, rules, mesh_shape) -> list[str]:
    """One line per (logical dimension, size, mesh axis) that param_shardings leaves unsharded, for the
    run's start."""
    notes = []
    specs = jax.tree.leaves(logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for spec, x in zip(specs, jax.tree.leaves(shapes)):
        for name, axes, n in zip(tuple(spec), mesh_axes(rules, tuple(spec)), x.shape):
            for a in even_axes(axes, n, mesh_shape)[1]:
                line = f"note: {name} ({n}) is not divisible by {a}={mesh_shape[a]}: left unsharded on that axis"
                if line not in notes:
                    notes.append(line)
    return notes


# ---------------------------------------------------------------------------------------------
# Inside a traced step, with the mesh and the rules in scope (mesh.activate): the same resolver.


def _active() -> tuple[Any, tuple]:
    """(the mesh in scope, the rules in scope), or (None, ()) where either is missing (the init's shape
    probe outside the mesh)."""
    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    return (None, ()) if mesh.empty or not rules else (mesh, tuple(rules))


def traced_platform() -> str:
    """The platform the step is traced for: the mesh's devices (TPU ones under an ahead-of-time compile
    for a topology, from a CPU process), else this process's."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.devices()[0].platform if mesh.empty else mesh.abstract_device.platform


def active_mesh():
    """The mesh in scope with its rules, or None."""
    return _active()[0]


def active_axes(logical: tuple, shape=None) -> tuple[tuple[str, ...], ...]:
    """The mesh axes each logical dimension maps to under the mesh and rules in scope, as tuples; with
    `shape`, only those that split each dimension evenly (even_axes)."""
    mesh, rules = _active()
    if mesh is None:
        return tuple(() for _ in logical)
    return tuple(tuple(a) for a in mesh_axes(rules, tuple(logical), shape, mesh.shape))


def active_spec(logical: tuple) -> PartitionSpec:
    return partition_spec(active_axes(logical))


def active_shards(logical: tuple) -> tuple[int, ...]:
    """How many devices split each logical dimension under the mesh and rules in scope."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(math.prod(mesh.shape[a] for a in axes) for axes in active_axes(logical))


def splits_evenly(logical: tuple, shape) -> bool:
    """Whether an array of `shape` with those logical dimensions divides over the devices that split them
    (not, e.g., the batch-of-1 trace at init)."""
    return all(n % k == 0 for n, k in zip(shape, active_shards(logical)))


def length_shards() -> int:
    """sequence_shards under the mesh and rules in scope (1 outside a mesh)."""
    mesh, rules = _active()
    return 1 if mesh is None else sequence_shards(rules, mesh.shape)


def constrain(x, logical: tuple):
    """The activation `x`, whose dimensions have the `logical` names, laid out as the rules say (as
    nn.with_logical_constraint), except that a dimension is left unsharded on a mesh axis that does not
    divide it, as its parameters are (even_axes). Nothing outside a mesh."""
    if active_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, partition_spec(active_axes(logical, x.shape)))
