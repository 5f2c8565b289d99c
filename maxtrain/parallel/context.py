"""Attention under a mesh: splash run per shard, and context parallelism (a sequence's positions split
over devices, the `length` logical axis), both under shard_map. The kernels themselves, with no mesh,
are in maxtrain.ops.attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain.ops.attention import (PLAIN, Variant, attend_blocks, document_mask, run_splash, splash_kernel, unzigzag,
                                   zigzag_order)
from maxtrain.parallel import ring
from maxtrain.parallel.rules import active_mesh, active_spec, length_shards, splits_evenly, traced_platform


def splash(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, residual_name=None, balanced=False,
           variant: Variant = PLAIN, sinks_H=None, library: str = "jax"):
    """The splash kernel on each shard (batch, heads and queries split). Under context parallelism each
    device runs it for its queries against the whole sequence's keys and values, gathered and put back
    in sequence order (`balanced`: the batch is in zigzag_order, so each device's queries sit at those
    places)."""
    b, length, h, k = q_BxLxHxK.shape
    to_heads_major = lambda x: x.swapaxes(1, 2)  # noqa: E731  [B,L,H,K] <-> [B,H,L,K]
    args = (to_heads_major(q_BxLxHxK) * variant.scale_for(k), to_heads_major(k_BxLxNxK), to_heads_major(v_BxLxNxK),
            segment_ids_BxL)
    mesh = active_mesh()
    specs = None
    if mesh is not None:
        logical = (("batch", "heads", "length", "head_dim"), ("batch", "kv_heads", "length", "head_dim"),
                   ("batch", "kv_heads", "length", "head_dim"), ("batch", "length"))
        specs = [active_spec(axes) for axes in logical]
        if not all(splits_evenly(axes, x.shape) for axes, x in zip(logical, args)):
            specs = None  # e.g. the batch-of-1 trace at init, whose attention output is never used
    shards = length_shards() if specs else 1
    places = zigzag_order(length, shards) if balanced and shards > 1 else np.arange(length)
    kernel = splash_kernel(places, residual_name, h, shards, interpret=traced_platform() != "tpu", variant=variant,
                           library=library)
    if specs is None:
        return to_heads_major(run_splash(kernel, *args, sinks_H=sinks_H, library=library))
    length_axes = specs[3][1]

    def local(kernel, q_BxHxQxK, k_BxNxCxK, v_BxNxCxK, segment_ids_BxQ, sinks_H):
        if shards == 1:
            return run_splash(kernel, q_BxHxQxK, k_BxNxCxK, v_BxNxCxK, segment_ids_BxQ, sinks_H=sinks_H,
                              library=library)
        gather = lambda x, axis: jax.lax.all_gather(x, length_axes, axis=axis, tiled=True)  # noqa: E731
        k_BxNxLxK, v_BxNxLxK, segment_ids_BxL = gather(k_BxNxCxK, 2), gather(v_BxNxCxK, 2), gather(segment_ids_BxQ, 1)
        if balanced:  # back to sequence order
            k_BxNxLxK, v_BxNxLxK = unzigzag(k_BxNxLxK, 2, shards), unzigzag(v_BxNxLxK, 2, shards)
            segment_ids_BxL = unzigzag(segment_ids_BxL, 1, shards)
        return run_splash(kernel, q_BxHxQxK, k_BxNxLxK, v_BxNxLxK, segment_ids_BxQ, segment_ids_BxL, sinks_H, library)

    # A Pallas kernel is not partitioned by XLA: run it on each shard; the kernel's block map travels
    # with it, each device taking its queries' rows.
    # jax's block map is per head [H, Q blocks, K blocks]; Tokamax's, one mask for every head, has no heads
    by_rows = PartitionSpec(length_axes) if library == "tokamax" else PartitionSpec(None, length_axes)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, by_rows))
    sinks_spec = PartitionSpec(specs[0][1])  # each device's query heads' sinks
    out_BxHxLxK = jax.shard_map(local, in_specs=(kernel_spec, *specs, sinks_spec), out_specs=specs[0],
                                check_vma=False)(kernel, *args, sinks_H)
    return to_heads_major(out_BxHxLxK)


def context_parallel(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL, variant: Variant = PLAIN,
                     sinks_H=None, balanced: bool = False, strategy: str = "all_gather"):
    """Each device keeps its queries and, by `strategy`, either gathers the whole sequence's keys and
    values (all_gather, as MaxText's and torchtitan's default) or takes them a device's block at a time
    round a ring (ring: maxtrain.parallel.ring), under shard_map: the attention itself is a device's local
    computation, as without context parallelism. The causal mask compares positions, not places, so a
    reordered sequence (zigzag_order; `balanced`) attends exactly as the original. (Left to GSPMD, XLA:CPU
    ran the partitioned softmax's gradient several times slower.)

    With a window no longer than each contiguous run of a device's positions plus one, either strategy
    needs only the window - 1 keys before each run: those come from the neighbouring device (a ppermute,
    see `_halo`: a ring of one step), so each device's traffic and scores are bounded by the window."""
    kv_axes, token_axes = ("batch", "length", "kv_heads", "head_dim"), ("batch", "length")
    logical = (("batch", "length", "heads", "head_dim"), kv_axes, kv_axes, token_axes, token_axes)
    specs = tuple(active_spec(axes) for axes in logical)
    q_spec, tokens = specs[0], specs[3]
    args = (q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL)
    w = variant.window
    if not all(splits_evenly(axes, x.shape) for axes, x in zip(logical, args)):
        # the batch-of-1 trace at init, whose attention output is never used
        return attend_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, [(0, q_BxLxHxK.shape[1], 0, document_mask(
            positions_BxL, positions_BxL, segment_ids_BxL, segment_ids_BxL, w))], variant, sinks_H)
    shards = length_shards()
    runs = 2 if balanced else 1  # contiguous runs of places per device
    run = q_BxLxHxK.shape[1] // shards // runs

    def local(q_BxQxHxK, k_BxCxNxK, v_BxCxNxK, segment_ids_BxQ, positions_BxQ, sinks_H):
        if w and w - 1 <= run:
            return _halo(q_BxQxHxK, (k_BxCxNxK, v_BxCxNxK, segment_ids_BxQ, positions_BxQ), tokens[1], shards,
                         runs, variant, sinks_H)
        if strategy == "ring":
            return ring.ring_attention(q_BxQxHxK, k_BxCxNxK, v_BxCxNxK, segment_ids_BxQ, positions_BxQ, sinks_H,
                                       tokens[1], shards, variant)
        gather = lambda x: jax.lax.all_gather(x, tokens[1], axis=1, tiled=True)  # noqa: E731
        mask_Bx1xQxM = document_mask(positions_BxQ, gather(positions_BxQ), segment_ids_BxQ, gather(segment_ids_BxQ),
                                     w)
        return attend_blocks(q_BxQxHxK, gather(k_BxCxNxK), gather(v_BxCxNxK),
                             [(0, q_BxQxHxK.shape[1], 0, mask_Bx1xQxM)], variant, sinks_H)
    sinks_spec = PartitionSpec(specs[0][2])  # each device's query heads' sinks
    return jax.shard_map(local, in_specs=(*specs, sinks_spec), out_specs=q_spec, check_vma=False)(*args, sinks_H)


def _halo(q_BxQxHxK, kv, axes, shards: int, runs: int, variant: Variant, sinks_H):
    """A device's windowed attention from its own keys and the window - 1 before each of its `runs`
    contiguous runs of places: in sequence order (runs = 1) the previous device's last ones; in
    zigzag_order (runs = 2: chunks i and 2 x shards - 1 - i) the first run's from device i - 1's first
    run, the second's from device i + 1's second run, or on the last device from its own first run.
    kv: (keys, values, segment ids, positions), each [B, C, ...]; device 0's first run has nothing before
    it (what the ppermute leaves there is masked out)."""
    halo = variant.window - 1
    index = jax.lax.axis_index(axes)
    length = q_BxQxHxK.shape[1]
    run = length // runs

    def before(x, r):
        """The `halo` positions of x before run r."""
        tail = lambda i: x[:, (i + 1) * run - halo:(i + 1) * run]  # noqa: E731
        if not halo:  # a window of 1: each token sees itself only
            return tail(r)
        if r == 0:
            return jax.lax.ppermute(tail(0), axes, [(j, j + 1) for j in range(shards - 1)])
        from_next = jax.lax.ppermute(tail(1), axes, [(j + 1, j) for j in range(shards - 1)])
        return jnp.where(index == shards - 1, tail(0), from_next)

    parts = [[jnp.concatenate([before(x, r), x[:, r * run:(r + 1) * run]], axis=1) for x in kv] for r in range(runs)]
    blocks = []
    for r, (_, _, segment_ids_BxM, positions_BxM) in enumerate(parts):
        queries = slice(r * run, (r + 1) * run)
        mask_Bx1xQxM = document_mask(positions_BxM[:, halo:], positions_BxM, segment_ids_BxM[:, halo:],
                                     segment_ids_BxM, variant.window)
        if r == 0:
            mask_Bx1xQxM = mask_Bx1xQxM & ((jnp.arange(halo + run) >= halo) | (index > 0))
        blocks.append((queries.start, queries.stop, r * (halo + run), mask_Bx1xQxM))
    k_BxMxNxK, v_BxMxNxK = (jnp.concatenate([p[i] for p in parts], axis=1) for i in (0, 1))
    return attend_blocks(q_BxQxHxK, k_BxMxNxK, v_BxMxNxK, blocks, variant, sinks_H)
