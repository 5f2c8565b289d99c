"""A loaded config resolved for the devices: `resolve(config, devices)` -> Resolved, a frozen config with
every auto value chosen (each key's platform default: its `Key.choose`) and the values that follow from the
devices (DERIVED), after every check that depends on them. Its `plan` is the execution plan the model receives.

The loaded Config (config.load) knows no devices; everything that runs a step takes a Resolved.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax

from maxtrain.config import run_name as run_name_lib
from maxtrain.config.groups import layout
from maxtrain.config.load import Config, defaults
from maxtrain.config.keys import INT_MAX, ConfigError, parallelism_key
from maxtrain.config.schema import declared
from maxtrain.parallel import rules as rules_lib
from maxtrain.parallel.mesh import MESH_AXES
from maxtrain.parallel.plan import Plan

# The values resolve adds to a loaded config, each declared once here.
DERIVED = {
    "num_devices": "devices the run's mesh holds",
    "num_slices": "TPU slices (or, without slices, processes) that the dcn_* axes split",
    "mesh_ici": "{mesh axis: devices} within a slice (ici_*_parallelism, -1 filled)",
    "mesh_dcn": "{mesh axis: slices} (dcn_*_parallelism, -1 filled)",
    "mesh_shape": "{mesh axis: devices}: ici x dcn",
    "global_batch_size": "sequences per step over all devices: per_device_batch_size x num_devices",
    "moe_chunk_size": "positions per chunk of an MoE layer's experts (the MLP's chunk key, or its auto rule for "
                      "MoE); 0 = none",
}


def chosen_keys() -> dict[str, object]:
    """The keys whose auto value resolve replaces by its platform default, and that value."""
    return {name: key.auto for name, key in declared().items() if key.choose}


class Resolved(Config):
    """A config resolved for the devices: frozen; attribute and mapping access as Config; the keys are
    the loaded config's and DERIVED's, none left auto."""

    def __init__(self, values):
        missing = set(DERIVED) - set(values)
        if missing:
            raise ValueError(f"a resolved config needs {', '.join(sorted(missing))}")
        left = [k for k, auto in chosen_keys().items() if values[k] == auto]
        if left:
            raise ValueError(f"a resolved config has no auto values: {', '.join(left)}")
        super().__init__(values)

    def replace(self, **changes) -> "Resolved":
        unknown = set(changes) - set(self)
        if unknown:
            raise KeyError(f"not keys of the config: {', '.join(sorted(unknown))}")
        return Resolved({**self, **changes})

    @functools.cached_property
    def plan(self) -> Plan:
        return Plan.from_resolved(self)


def num_slices(devices) -> int:
    """The units the dcn_* axes split: TPU slices, or, where devices carry no slice index (GPU and
    CPU clusters), processes, i.e. hosts, as in mesh_utils' `process_is_granule`."""
    if devices[0].platform == "tpu":
        return 1 + max(getattr(d, "slice_index", 0) for d in devices)
    return len({d.process_index for d in devices})


def resolve(config: Config, devices=None, slices: int | None = None, platform: str | None = None) -> Resolved:
    """`config` for `devices` (jax devices; default all: their count, slices and platform), or for a
    number of devices (`slices` default 1, `platform` default cpu). Every check that depends on the
    devices raises a ConfigError naming the key."""
    if devices is None or not isinstance(devices, int):
        devices = devices or jax.devices()
        slices, platform, devices = num_slices(devices), devices[0].platform, len(devices)
    return _resolve(config.to_dict(), devices, slices or 1, platform or "cpu")


def _resolve(c: dict[str, Any], num_devices: int, num_slices: int, platform: str) -> Resolved:
    if num_devices % num_slices:
        raise ConfigError("dcn_*_parallelism", f"{num_devices} devices do not split into {num_slices} slices")
    ici = _fill("ici", {a: c[parallelism_key("ici", a)] for a in MESH_AXES}, num_devices // num_slices)
    dcn = _fill("dcn", {a: c[parallelism_key("dcn", a)] for a in MESH_AXES}, num_slices)
    shape = {a: ici[a] * dcn[a] for a in MESH_AXES}

    tensor = shape["tensor"]
    for key in ("base_num_query_heads", "base_num_kv_heads"):
        if c[key] % tensor:  # attention runs per device's heads (splash, context parallelism): no uneven split
            raise ConfigError(key, f"{c[key]} is not divisible by {_axis_keys(['tensor'], ici, dcn)}: "
                              f"the attention heads are split over the tensor axis ({tensor})")
    if c["num_experts"] > 1:
        _check_expert_sharding(c, shape, ici, dcn)
    conflict = rules_lib.sequence_layout_conflict(c["logical_axis_rules"])
    if conflict:
        raise ConfigError("logical_axis_rules", conflict)
    seq_shards = rules_lib.sequence_shards(c["logical_axis_rules"], shape)  # the one answer: every caller asks it
    seq_axes = " x ".join(f"{a} ({shape[a]})" for a in rules_lib.sequence_axes(c["logical_axis_rules"]) if shape[a] > 1)
    pieces = seq_shards * (2 if c["context_parallel_load_balance"] else 1)
    if seq_shards > 1 and c["max_target_length"] % pieces:
        why = " x 2 (context_parallel_load_balance)" if pieces > seq_shards else ""
        raise ConfigError("max_target_length", f"{c['max_target_length']} does not split into {pieces} equal pieces: "
                          f"the mesh axes of `length`, {seq_axes}{why}")

    global_batch = c["per_device_batch_size"] * num_devices
    if global_batch != int(global_batch) or global_batch < 1:
        raise ConfigError("per_device_batch_size",
                          f"{c['per_device_batch_size']} x {num_devices} devices is not a whole batch")
    global_batch = int(global_batch)
    if c["run_name_derived"]:  # the global batch is part of what a run is
        c["run_name"] = run_name_lib.with_global_batch(c, defaults(), global_batch)
    # the MoE router counts a step's assignments, global batch x length x top-k, as an int32
    tokens = global_batch * c["max_target_length"]
    top_k = c["num_experts_per_tok"] if c["num_experts"] > 1 else 1
    if tokens * top_k > INT_MAX:
        what = (f" x num_experts_per_tok {top_k} = {tokens * top_k} expert assignments" if top_k > 1
                else f" = {tokens} tokens")
        raise ConfigError("per_device_batch_size", f"{c['per_device_batch_size']} x {num_devices} devices x "
                          f"max_target_length {c['max_target_length']}{what} per step, out of range: at most {INT_MAX}")
    batch_shards = rules_lib.shards(c["logical_axis_rules"], "batch", shape)
    accum = c["gradient_accumulation_steps"]
    if global_batch % (batch_shards * accum):
        raise ConfigError("per_device_batch_size",
                          f"global batch {global_batch} must divide into {accum} micro-batches "
                          f"each divisible by the {batch_shards} batch shards")

    c.update(num_devices=num_devices, num_slices=num_slices, mesh_ici=ici, mesh_dcn=dcn,
             mesh_shape=shape, global_batch_size=global_batch)
    given, keys = dict(c), [declared()[name] for name in defaults()]
    for key in keys:  # in base.yml's order: a rule may read a value chosen before it (the chunks, dtype)
        if key.choose and c[key.name] == key.auto:
            c[key.name] = key.choose(c, platform)
    c["moe_chunk_size"] = layout.moe_chunk_size(c, given)
    for key in keys:
        if key.check_resolved:
            key.check_resolved(c, platform)
    return Resolved(c)


def _fill(group: str, sizes: dict[str, int], total: int) -> dict[str, int]:
    known = math.prod(s for s in sizes.values() if s != -1)
    fill = [a for a, s in sizes.items() if s == -1]
    given = " x ".join(f"{a}={s}" for a, s in sizes.items())
    unit = "devices per slice" if group == "ici" else "slices (TPU slices; elsewhere processes)"
    if fill:
        if total % known:
            raise ConfigError(parallelism_key(group, fill[0]), f"cannot fill: {given} does not divide the {total} {unit}")
        sizes = {**sizes, fill[0]: total // known}
    elif known != total:
        raise ConfigError(f"{group}_*_parallelism",
                          f"{given} has product {known}, but there are {total} {unit}")
    return sizes


def _axis_keys(axes, ici: dict[str, int], dcn: dict[str, int]) -> str:
    """The parallelism keys that size mesh `axes` (those above 1), as a user sets them."""
    keys = [f"{parallelism_key(group, a)}={sizes[a]}" for a in axes for group, sizes in (("ici", ici), ("dcn", dcn))
            if sizes[a] > 1]
    return " x ".join(keys) or "1 device"


def _check_expert_sharding(c: dict[str, Any], shape: dict[str, int], ici, dcn) -> None:
    """The experts run under shard_map, which splits evenly or not at all."""
    rules = c["logical_axis_rules"]
    experts, embed, mlp = rules_lib.mesh_axes(rules, ("experts", "embed", "moe_mlp"))
    for key, size, axes in (("num_experts", c["num_experts"], experts), ("base_emb_dim", c["base_emb_dim"], embed),
                            ("base_moe_mlp_dim", c["moe_mlp_dim"], mlp)):
        shards = math.prod(shape[a] for a in axes)
        if size % shards:
            raise ConfigError(key, f"{size} is not divisible by {_axis_keys(axes, ici, dcn)} ({shards} shards): "
                              f"the expert weights are split over {' x '.join(axes)}, evenly or not at all")
    batch = rules_lib.mesh_axes(rules, ("batch",))[0]
    if math.prod(shape[a] for a in experts) > 1 and not set(experts) <= set(batch):
        raise ConfigError("logical_axis_rules", "the mesh axes of `experts` must also split `batch` (tokens "
                          "travel to their experts' devices)")
