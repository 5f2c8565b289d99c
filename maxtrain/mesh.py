"""The device mesh: its shape resolved from the config and the devices (with_devices), the device grid,
and logical-axis-name -> NamedSharding translation.

This is the only module that names mesh axes. Everything else speaks logical names.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxtrain.config import INT_MAX, MESH_AXES, Config, ConfigError


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


# Inside a traced step (mesh and rules active): what the shard_map regions of attention, moe and model
# ask of the mesh, by logical names.


def active_axes(logical: tuple, shape=None) -> tuple[tuple[str, ...], ...]:
    """The mesh axes each logical dimension maps to under the active mesh and rules, as tuples; with
    `shape`, only those that split each dimension evenly (even_axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not nn.get_logical_axis_rules():
        return tuple(() for _ in logical)
    axes = [_as_list(s) for s in nn.logical_to_mesh_axes(logical)]
    if shape is not None:
        axes = [even_axes(a, n, mesh.shape)[0] for a, n in zip(axes, shape)]
    return tuple(tuple(a) for a in axes)


def active_shards(logical: tuple) -> tuple[int, ...]:
    """How many devices split each logical dimension under the active mesh and rules."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(math.prod(mesh.shape[a] for a in axes) for axes in active_axes(logical))


def splits_evenly(logical: tuple, shape) -> bool:
    """Whether an array of `shape` with those logical dimensions divides over the devices that split them
    (not, e.g., the batch-of-1 trace at init)."""
    return all(n % k == 0 for n, k in zip(shape, active_shards(logical)))


def constrain(x, logical: tuple):
    """nn.with_logical_constraint, except that a dimension is left unsharded on a mesh axis that does not
    divide it, as its parameters are (even_axes)."""
    if splits_evenly(logical, x.shape):
        return nn.with_logical_constraint(x, logical)
    return jax.lax.with_sharding_constraint(x, _partition_spec(active_axes(logical, x.shape)))


def length_shards() -> int:
    """How many devices split a sequence's positions (context parallelism)."""
    return active_shards(("length",))[0]


# ---------------------------------------------------------------------------------------------
# The mesh's shape for the actual devices, and what depends on it


def _fill(group: str, sizes: dict[str, int], total: int) -> dict[str, int]:
    known = math.prod(s for s in sizes.values() if s != -1)
    fill = [a for a, s in sizes.items() if s == -1]
    given = " x ".join(f"{a}={s}" for a, s in sizes.items())
    if fill:
        if total % known:
            raise ConfigError(f"{group}_{fill[0]}_parallelism",
                              f"cannot fill: {given} does not divide {total} {group} devices")
        sizes = {**sizes, fill[0]: total // known}
    elif known != total:
        unit = "devices per slice" if group == "ici" else "slices"
        raise ConfigError(f"{group}_*_parallelism",
                          f"{given} has product {known}, but there are {total} {unit}")
    return sizes


def with_devices(config: Config, num_devices: int, num_slices: int = 1, platform: str = "cpu") -> Config:
    """Resolve the mesh and the platform defaults for the actual devices, and check everything that
    depends on them."""
    from maxtrain import platform_defaults  # it reads the mesh this function resolves

    c = config.to_dict()
    if num_devices % num_slices:
        raise ConfigError("dcn_*_parallelism", f"{num_devices} devices do not split into {num_slices} slices")
    ici = _fill("ici", {a: c[f"ici_{a}_parallelism"] for a in MESH_AXES}, num_devices // num_slices)
    dcn = _fill("dcn", {a: c[f"dcn_{a}_parallelism"] for a in MESH_AXES}, num_slices)
    shape = {a: ici[a] * dcn[a] for a in MESH_AXES}

    tensor = shape["tensor"]
    for key in ("base_num_query_heads", "base_num_kv_heads"):
        if c[key] % tensor:  # attention runs per device's heads (splash, context parallelism): no uneven split
            raise ConfigError(key, f"{c[key]} is not divisible by {_axis_keys(['tensor'], ici, dcn)}: "
                              f"the attention heads are split over the tensor axis ({tensor})")
    if c["num_experts"] > 1:
        _check_expert_sharding(c, shape, ici, dcn)
    pieces = shape["context"] * (2 if c["context_parallel_load_balance"] else 1)
    if shape["context"] > 1 and c["max_target_length"] % pieces:
        why = " x 2 (context_parallel_load_balance)" if pieces > shape["context"] else ""
        raise ConfigError("max_target_length", f"{c['max_target_length']} does not split into {pieces} equal pieces: "
                          f"the context axis ({shape['context']}){why}")

    global_batch = c["per_device_batch_size"] * num_devices
    if global_batch != int(global_batch) or global_batch < 1:
        raise ConfigError("per_device_batch_size",
                          f"{c['per_device_batch_size']} x {num_devices} devices is not a whole batch")
    global_batch = int(global_batch)
    # the MoE router counts a step's assignments, global batch x length x top-k, as an int32
    tokens = global_batch * c["max_target_length"]
    top_k = c["num_experts_per_tok"] if c["num_experts"] > 1 else 1
    if tokens * top_k > INT_MAX:
        what = (f" x num_experts_per_tok {top_k} = {tokens * top_k} expert assignments" if top_k > 1
                else f" = {tokens} tokens")
        raise ConfigError("per_device_batch_size", f"{c['per_device_batch_size']} x {num_devices} devices x "
                          f"max_target_length {c['max_target_length']}{what} per step, out of range: at most {INT_MAX}")
    batch_shards = math.prod(shape[a] for a in mesh_axes_for(c["logical_axis_rules"], "batch"))
    accum = c["gradient_accumulation_steps"]
    if global_batch % (batch_shards * accum):
        raise ConfigError("per_device_batch_size",
                          f"global batch {global_batch} must divide into {accum} micro-batches "
                          f"each divisible by the {batch_shards} batch shards")

    c.update(num_devices=num_devices, num_slices=num_slices, mesh_ici=ici, mesh_dcn=dcn,
             mesh_shape=shape, global_batch_size=global_batch)
    share = c["max_target_length"] // shape["context"]
    for key in ("loss_chunk_size", "mlp_chunk_size"):
        if c[key] > 0 and share % c[key]:
            raise ConfigError(key, f"{c[key]} must divide each device's share of the sequence: max_target_length "
                              f"{c['max_target_length']} / context {shape['context']} = {share}")
    platform_defaults.resolve(c, platform)
    if c["attention"] == "splash" and share % 128:
        raise ConfigError("attention", f"splash needs each device's share of the sequence in blocks of 128: "
                          f"max_target_length {c['max_target_length']} / context {shape['context']} = {share}")
    return Config(c)


def _axis_keys(axes, ici: dict[str, int], dcn: dict[str, int]) -> str:
    """The parallelism keys that size mesh `axes` (those above 1), as a user sets them."""
    keys = [f"{group}_{a}_parallelism={sizes[a]}" for a in axes for group, sizes in (("ici", ici), ("dcn", dcn))
            if sizes[a] > 1]
    return " x ".join(keys) or "1 device"


def _check_expert_sharding(c: dict[str, Any], shape: dict[str, int], ici, dcn) -> None:
    """The experts run under shard_map, which splits evenly or not at all."""
    rules = c["logical_axis_rules"]
    experts, embed, mlp = spec_for(rules, ("experts", "embed", "moe_mlp"))
    for key, size, axes in (("num_experts", c["num_experts"], experts), ("base_emb_dim", c["base_emb_dim"], embed),
                            ("base_moe_mlp_dim", c["moe_mlp_dim"], mlp)):
        shards = math.prod(shape[a] for a in axes)
        if size % shards:
            raise ConfigError(key, f"{size} is not divisible by {_axis_keys(axes, ici, dcn)} ({shards} shards): "
                              f"the expert weights are split over {' x '.join(axes)}, evenly or not at all")
    if math.prod(shape[a] for a in experts) > 1 and not set(experts) <= set(mesh_axes_for(rules, "batch")):
        raise ConfigError("logical_axis_rules", "the mesh axes of `experts` must also split `batch` (tokens "
                          "travel to their experts' devices)")


# ---------------------------------------------------------------------------------------------
# The one resolver: logical names (and sizes) -> mesh axes. The parameters' shardings (param_shardings),
# the activations' constraints (constrain) and the planners (fit, platform_defaults, the checks above)
# all leave a dimension unsharded on a mesh axis that does not divide it, by even_axes.


def _as_list(target) -> list[str]:
    return [] if target is None else [target] if isinstance(target, str) else list(target)


def _partition_spec(axes) -> PartitionSpec:
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in axes))


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


def spec_for(rules: list, names: tuple[str, ...], shape=None, mesh_shape=None) -> list[list[str]]:
    """The mesh axes of each dimension of an array with logical `names`, as flax assigns them: rules in
    order, each used only where its mesh axes are all still free; with `shape` and `mesh_shape`, only the
    axes that split each dimension evenly (even_axes)."""
    result: list[list[str] | None] = [None] * len(names)
    for name, target in rules:
        axes = _as_list(target)
        if name in names and result[names.index(name)] is None and not any(
                a in used for used in result if used for a in axes):
            result[names.index(name)] = axes
    result = [r or [] for r in result]
    if shape is not None:
        result = [even_axes(axes, n, mesh_shape)[0] for axes, n in zip(result, shape)]
    return result


def mesh_axes_for(rules: list, logical: str, size: int | None = None, mesh_shape=None) -> list[str]:
    """Mesh axes that a logical axis maps to (the first matching rule wins); with `size` and `mesh_shape`,
    only those that split a dimension of that size evenly (even_axes)."""
    axes = next((_as_list(target) for name, target in rules if name == logical), [])
    return axes if size is None else even_axes(axes, size, mesh_shape)[0]


def param_shardings(logical_specs, shapes, mesh: Mesh, rules: tuple):
    """NamedShardings of the parameters from their logical specs (a tree of PartitionSpecs) and shapes
    (a matching tree of arrays or ShapeDtypeStructs), each dimension only on the axes that divide it."""
    def one(spec, x):
        axes = [_as_list(a) for a in nn.logical_to_mesh_axes(tuple(spec), rules)]
        return NamedSharding(mesh, _partition_spec(even_axes(a, n, mesh.shape)[0] for a, n in zip(axes, x.shape)))
    return jax.tree.map(one, logical_specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def uneven_notes(logical_specs, shapes, rules, mesh_shape) -> list[str]:
    """One line per (logical dimension, size, mesh axis) that param_shardings leaves unsharded, for the
    run's start."""
    notes = []
    specs = jax.tree.leaves(logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for spec, x in zip(specs, jax.tree.leaves(shapes)):
        for name, target, n in zip(tuple(spec), nn.logical_to_mesh_axes(tuple(spec), rules), x.shape):
            for a in even_axes(_as_list(target), n, mesh_shape)[1]:
                line = f"note: {name} ({n}) is not divisible by {a}={mesh_shape[a]}: left unsharded on that axis"
                if line not in notes:
                    notes.append(line)
    return notes

