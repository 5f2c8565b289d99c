"""Human-readable reports: the parameter table and the compiled step's memory (dry_run, compile)."""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec


GiB = 1024**3


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def shard_bytes(x: jax.ShapeDtypeStruct) -> int:
    """Bytes one device holds of an array with a NamedSharding."""
    shard_shape = x.sharding.shard_shape(x.shape)
    return math.prod(shard_shape) * x.dtype.itemsize


def param_table(trainer, active: int | None = None) -> str:
    """The parameters of a training.step.Trainer, a row each (shape, logical axes, spec, bytes per device)."""
    params = trainer.abstract_state.params
    specs = jax.tree_util.tree_leaves_with_path(
        trainer.param_logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    rows = [("parameter", "shape", "logical axes", "mesh PartitionSpec", "bytes/device")]
    total, total_bytes = 0, 0
    for (path, x), (_, logical) in zip(jax.tree_util.tree_leaves_with_path(params), specs):
        nbytes = shard_bytes(x)
        total += math.prod(x.shape)
        total_bytes += nbytes
        rows.append((_path_name(path), str(tuple(x.shape)), str(tuple(logical)),
                     str(tuple(x.sharding.spec)), f"{nbytes:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    a = trainer.model.args  # the vocabulary's padding (parts.VOCAB_MULTIPLE) is storage, not parameters
    padding = (a.vocab.padded - a.vocab.size) * a.embed * (1 if a.vocab.tied else 2)
    total -= padding
    padded = f", plus {padding:,} entries of vocabulary padding" if padding else ""
    lines.append(f"total parameters: {total:,}{padded} ({total_bytes / 2**20:,.1f} MiB of parameters per device)"
                 + (f"; active per token: {active:,}" if active and active != total else ""))
    return "\n".join(lines)


def memory_report(compiled) -> dict[str, float]:
    """Per-device GiB from XLA's memory analysis of a compiled executable."""
    m = compiled.memory_analysis()
    args = m.argument_size_in_bytes
    temps = m.temp_size_in_bytes
    outs = m.output_size_in_bytes
    aliased = m.alias_size_in_bytes  # donated inputs reused as outputs are not counted twice
    return {"arguments": args / GiB, "temporaries": temps / GiB, "outputs": outs / GiB,
            "aliased": aliased / GiB, "total": (args + temps + outs - aliased) / GiB}


def format_memory(report: dict[str, float]) -> str:
    return " | ".join(f"{k} {v:.3f} GiB" for k, v in report.items())


def state_bytes(trainer) -> dict[str, dict[str, int]]:
    """Bytes of the train state one device holds, by part (params, opt_state) and memory (device, pinned_host)."""
    out = {}
    for part in ("params", "opt_state"):
        for x in jax.tree.leaves(getattr(trainer.abstract_state, part)):
            memory = x.sharding.memory_kind or "device"
            out.setdefault(part, {}).setdefault(memory, 0)
            out[part][memory] += shard_bytes(x)
    return out


def state_placement(trainer, compiled_total_gib: float | None = None) -> str:
    """Where the train state lives and its bytes per parameter on the device: the floor of these settings
    (weights, their gradients and the optimizer's moments resident on the device) and, given the compiled
    step's total, how far the plan is above it."""
    held = state_bytes(trainer)
    params = sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(trainer.abstract_state.params))
    # The weights are on the device for the forward and backward passes wherever they live (offloaded, as a copy
    # that the update no longer needs), and a gradient per parameter in their dtype.
    weights = grads = sum(held["params"].values())
    optimizer = held["opt_state"].get("device", 0)
    floor = (weights + grads + optimizer) / params
    where = " | ".join(f"{name} {', '.join(f'{b / GiB:.3f} GiB in {m}' for m, b in held[part].items())}"
                       for part, name in (("params", "weights"), ("opt_state", "optimizer state")))
    line = (f"train state per device: {where} | device bytes per parameter: floor {floor:.1f} (weights "
            f"{weights / params:.1f} + gradients {grads / params:.1f} + optimizer {optimizer / params:.1f})")
    if compiled_total_gib is not None:
        plan = compiled_total_gib * GiB / params
        line += f", plan {plan:.1f} ({plan / floor:.2f}x the floor: activations, temporaries, buffers)"
    return line
