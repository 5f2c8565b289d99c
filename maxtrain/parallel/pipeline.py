"""Pipeline parallelism over the `stage` mesh axis: GPipe (repeats 1) and the circular schedule.

A pipelined stack's layers are split over the stages: stage s holds `repeats` chunks of
`layers_per_stage` layers, chunk r being the model's layers (r x stages + s) x layers_per_stage onwards,
so a micro-batch goes round the stages `repeats` times (GPipe: once, each stage holding a contiguous
range). The batch is cut into micro-batches (row i into micro-batch i % M, so every device keeps a
slice of each); at iteration t, stage s runs micro-batch (t - s) mod M at repeat (t - s) // M, and
every stage's output moves to the next stage (one collective permute of activations over `stage`).
Stage 0 reads its input from a stream of the M micro-batches, where the last stage's output comes back
round. (stages - 1) of the repeats x M + stages - 1 iterations are idle for each stage: the bubble.

All of it is SPMD: a scan over the iterations of a vmap over the stages, whose dimension is sharded
over `stage` (`spmd_axis_name`): XLA keeps each stage's work on its devices and turns the shift into a
collective permute. Inside a stage the other axes (data, fsdp, tensor, expert, context) work as
without a pipeline: the rules in scope there are the run's rules without `stage`.

Weights stay where they are: a pipelined stack's parameters have their layers dimension (logical
`stage_layers`) sharded over `stage`, in the order `storage_order` gives (stage-major), so each
stage's chunks are on its devices; checkpoints hold the model's own order (to_model_order).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from maxtrain.parallel import rules as rules_lib

STAGE = "stage"  # the mesh axis
LAYERS_AXIS = "stage_layers"  # the logical name of a pipelined stack's layers dimension
_WEIGHTS = "pipeline_weights"  # the chunk of weights an iteration selects: recomputed, never saved
_LAYER_INPUT = "pipeline_layer_input"  # each layer's input in each iteration: saved for the backward pass


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: int = 1
    repeats: int = 1
    microbatches: int = 1

    @property
    def active(self) -> bool:
        return self.stages > 1

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of each stage's iterations spent idle."""
        return (self.stages - 1) / self.iterations

    def describe(self) -> str:
        kind = "GPipe" if self.repeats == 1 else f"circular, {self.repeats} repeats"
        return (f"pipeline {self.stages} stages ({kind}) x {self.microbatches} micro-batches, "
                f"bubble {self.bubble:.1%}")


def placement(stacks: list[tuple[str, int, bool]], schedule: Schedule) -> str:
    """Where the layers of a model with `stacks` ((name, layers, is MoE), in order) run: one line."""
    name, count, _ = stacks[-1]
    per_chunk = count // (schedule.stages * schedule.repeats)
    first = sum(n for _, n, _ in stacks[:-1])  # the model's index of the pipeline's first layer

    def chunks(stage: int) -> str:
        starts = [first + (r * schedule.stages + stage) * per_chunk for r in range(schedule.repeats)]
        return ", ".join(f"{s}" if per_chunk == 1 else f"{s}-{s + per_chunk - 1}" for s in starts)
    shown = [f"stage {s}: layers {chunks(s)}" for s in range(min(schedule.stages, 4))]
    more = f"; ... stage {schedule.stages - 1}: layers {chunks(schedule.stages - 1)}" if schedule.stages > 4 else ""
    before = f"the {first} leading layers ({', '.join(n for n, _, _ in stacks[:-1])}), " if first else ""
    return (f"pipeline placement: {'; '.join(shown)}{more} ({name}); {before}the embedding, the final norm and "
            "the output layer run outside the pipeline on every stage, the batch split over all devices")


def storage_order(layers: int, stages: int, repeats: int) -> np.ndarray:
    """order[i] = the model's layer held at place i of a pipelined stack: stage-major, so the contiguous
    block of places a stage holds is its `repeats` chunks."""
    per_chunk = layers // (stages * repeats)
    i = np.arange(layers)
    stage, repeat, j = i // (repeats * per_chunk), (i // per_chunk) % repeats, i % per_chunk
    return repeat * stages * per_chunk + stage * per_chunk + j


def _permute(tree, names: set[str], order: np.ndarray):
    """Each leaf under a top-level key in `names` reordered along its first (layers) axis."""
    if (order == np.arange(order.size)).all():
        return tree

    def visit(path, x):
        keys = [getattr(p, "key", None) for p in path]
        if names & set(k for k in keys if isinstance(k, str)) and x.ndim and x.shape[0] == order.size:
            return jnp.take(x, order, axis=0)
        return x
    return jax.tree_util.tree_map_with_path(visit, tree)


def to_storage_order(tree, names: set[str], layers: int, schedule: Schedule):
    """Parameters (or anything shaped like them: optimizer moments) from the model's layer order to the
    pipeline's."""
    return _permute(tree, names, storage_order(layers, schedule.stages, schedule.repeats))


def to_model_order(tree, names: set[str], layers: int, schedule: Schedule):
    return _permute(tree, names, np.argsort(storage_order(layers, schedule.stages, schedule.repeats)))


def _inner_rules() -> tuple:
    """The rules in scope without the stage axis: inside a stage, the pipeline owns it."""
    return tuple((name, tuple(a for a in rules_lib.as_list(target) if a != STAGE) or None)
                 for name, target in nn.get_logical_axis_rules())


def _as_outside_the_vmap(policy):
    """`policy` judging a layer as it runs without the pipeline: under the vmap over stages every
    matmul gains a batch dimension (the stage, first), so `minimal`'s "dots with no batch dimensions"
    would keep none of the projections."""
    if policy is not jax.checkpoint_policies.dots_with_no_batch_dims_saveable:
        return policy

    def projections(prim, *_, **params):
        if prim is jax.lax.dot_general_p:
            (_, _), (lhs_batch, rhs_batch) = params["dimension_numbers"]
            return tuple(lhs_batch) == (0,) and tuple(rhs_batch) == (0,)
        return False
    return projections


def iteration_policy(layer_policy):
    """What the scan over iterations keeps for the backward pass: each layer's input (as a stack without
    the pipeline keeps it) and what the layer's own policy keeps inside a layer; under no remat, every
    named intermediate (a policy saving all would keep each iteration's weights, cast or sliced, too).
    Never the weights an iteration selects, a slice of arguments the scan holds anyway. Keeping less
    (only the iteration's input) would run each stage's forward a third time."""
    def policy(prim, *args, **params):
        if prim.name == "name":  # checkpoint_name's primitive
            if params["name"] == _WEIGHTS:
                return False
            if params["name"] == _LAYER_INPUT or layer_policy is None:
                return True
        return False if layer_policy is None else layer_policy(prim, *args, **params)
    return policy


def run(layer_fn: Callable, params, x_BxLxD, positions_BxL, segment_ids_BxL, schedule: Schedule,
        remat_policy=None):
    """The stack's output [B,L,D] and each layer's records (stacked [layers, ...] in storage order, the
    mean over micro-batches), running `layer_fn(layer_params, x, positions, segment_ids) -> (x, records)`
    over `params` (leaves [layers, ...] in storage order) as `schedule` says."""
    S, R, M = schedule.stages, schedule.repeats, schedule.microbatches
    # a micro-batch must be back from the last stage before stage 0 takes it again (config checks this)
    assert R == 1 or M >= S, schedule
    layers = jax.tree.leaves(params)[0].shape[0]
    per_chunk = layers // (S * R)
    inner = _inner_rules()
    b = x_BxLxD.shape[0] // M

    def micro(x):  # row i -> micro-batch i % M
        return x.reshape(b, M, *x.shape[1:]).swapaxes(0, 1)

    # [S, R, per_chunk, ...]: a reshape of the storage order, stage-major, so sharded as stored
    weights = jax.tree.map(lambda w: w.reshape(S, R, per_chunk, *w.shape[1:]), params)

    remat_policy = _as_outside_the_vmap(remat_policy)
    if remat_policy is not None:
        layer_fn = jax.checkpoint(layer_fn, policy=remat_policy, prevent_cse=False)

    def stage_fn(w_C, x_bxLxD, pos_bxL, seg_bxL):
        """One stage's chunk of layers on one micro-batch."""
        def body(x, w):
            return layer_fn(w, checkpoint_name(x, _LAYER_INPUT), pos_bxL, seg_bxL)
        return jax.lax.scan(body, x_bxLxD, w_C)

    with nn.logical_axis_rules(inner):
        act = rules_lib.active_axes(("batch", "length", "embed"), (b, *x_BxLxD.shape[1:]))
    act_spec = jax.sharding.PartitionSpec(STAGE, *(a or None for a in act))
    stream_spec = jax.sharding.PartitionSpec(STAGE, None, *(a or None for a in act))
    micro_spec = jax.sharding.PartitionSpec(None, *(a or None for a in act))  # on every stage

    def constrain(x, spec):
        return jax.lax.with_sharding_constraint(x, spec) if rules_lib.active_mesh() is not None else x

    xs_MxbxLxD = constrain(micro(x_BxLxD), micro_spec)
    pos_MxbxL = constrain(micro(positions_BxL), jax.sharding.PartitionSpec(*micro_spec[:3]))
    seg_MxbxL = constrain(micro(segment_ids_BxL), jax.sharding.PartitionSpec(*micro_spec[:3]))

    stage_ids = jnp.arange(S)
    # The stream: stage 0's inputs and the last stage's outputs (every stage writes its own slot, locally;
    # only stage 0's is read)
    stream = constrain(jnp.broadcast_to(xs_MxbxLxD, (S, *xs_MxbxLxD.shape)), stream_spec)
    state = constrain(jnp.zeros((S, *xs_MxbxLxD.shape[1:]), x_BxLxD.dtype), act_spec)
    records_shape = jax.eval_shape(lambda: stage_fn(jax.tree.map(lambda w: w[0, 0], weights), xs_MxbxLxD[0],
                                                    pos_MxbxL[0], seg_MxbxL[0])[1])
    records = jax.tree.map(lambda r: jnp.zeros((S, R, *r.shape), jnp.float32), records_shape)

    def iteration(carry, t):
        state, stream, records = carry
        k_S = t - stage_ids  # each stage's position in its work
        valid_S = (k_S >= 0) & (k_S < R * M)
        m_S, r_S = k_S % M, jnp.clip(k_S // M, 0, R - 1)
        w_S = jax.tree.map(lambda w: checkpoint_name(jax.vmap(lambda ws, r: ws[r])(w, r_S), _WEIGHTS), weights)
        first = jax.vmap(lambda st: st[t % M])(stream)
        x_S = jnp.where((stage_ids == 0)[:, None, None, None], first, state)
        x_S = constrain(x_S, act_spec)
        with nn.logical_axis_rules(inner):
            y_S, rec_S = jax.vmap(stage_fn, spmd_axis_name=STAGE)(w_S, x_S, pos_MxbxL[m_S], seg_MxbxL[m_S])
        y_S = constrain(y_S, act_spec)
        shifted = constrain(jnp.roll(y_S, 1, axis=0), act_spec)  # stage s-1 -> s, and the last -> 0
        done = (t - (S - 1)) % M  # the micro-batch the last stage finished, now at stage 0
        last_valid = valid_S[S - 1]
        stream = jax.vmap(lambda st, y: st.at[done].set(jnp.where(last_valid, y, st[done])))(stream, shifted)
        stream = constrain(stream, stream_spec)

        def add(acc, rec):
            rec = jnp.where(valid_S.reshape(S, *([1] * (rec.ndim - 1))), rec.astype(jnp.float32), 0.0)
            return jax.vmap(lambda a, v, r: a.at[r].add(v))(acc, rec, r_S)
        records = jax.tree.map(add, records, rec_S)
        return (shifted, stream, records), None

    body = jax.checkpoint(iteration, policy=iteration_policy(remat_policy), prevent_cse=False)
    (_, stream, records), _ = jax.lax.scan(body, (state, stream, records), jnp.arange(schedule.iterations))
    out_MxbxLxD = stream[0]
    # laid out as the batch outside the pipeline (split over stage too): left to propagation, the loss
    # after it ran on every stage's devices with the batch split over stage alone
    out_BxLxD = rules_lib.constrain(out_MxbxLxD.swapaxes(0, 1).reshape(x_BxLxD.shape), ("batch", "length", "embed"))
    records = jax.tree.map(lambda r: (r / M).reshape(layers, *r.shape[3:]), records)
    return out_BxLxD, records

