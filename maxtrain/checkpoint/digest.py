"""Digests of a train state: every array's path, shape, dtype and two checksums of its bits, computed on
device. A checkpoint records one from the state it saves; a restore recomputes it from what it read."""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain.parallel import rules


class Corrupt(Exception):
    """What was read does not match its digest (or cannot be read); the restore falls back past it."""


def _leaf_sums(x: jax.Array) -> jax.Array:
    """Two uint32 checksums of an array's bits: their sum, and their sum weighted by 2 x index + 1.

    Integer sums wrap exactly, so the result is the same on any mesh. Any single flipped bit changes
    both (an odd weight is invertible mod 2^32); a permutation changes the second.
    """
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for dim in reversed(range(x.ndim)):  # the flat index, without reshaping a sharded array
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * jnp.uint32(stride % 2**32)
        stride *= x.shape[dim]
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)])


def _sums_and_finite(tree):
    leaves = jax.tree.leaves(tree)
    finite = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.stack([_leaf_sums(x) for x in leaves]), jnp.all(jnp.stack(finite)) if finite else True


def leaf_signature(tree, prefix: str = "") -> list[list]:
    """[path, shape, dtype] of every array: what a checkpoint holds, compared before restoring into it."""
    return [[prefix + jax.tree_util.keystr(path), list(x.shape), str(x.dtype)]
            for path, x in jax.tree_util.tree_leaves_with_path(tree)]


def digest(tree, prefix: str = "") -> tuple[list[list], bool]:
    """([path, shape, dtype, sum, weighted sum] per array, all floats finite), from device arrays."""
    mesh = jax.tree.leaves(tree)[0].sharding.mesh
    on_device = rules.in_device_memory(jax.tree.map(lambda x: x.sharding, tree))  # a host-offloaded state
    fn = jax.jit(lambda t: _sums_and_finite(jax.device_put(t, on_device)),
                 out_shardings=NamedSharding(mesh, PartitionSpec()))
    sums, finite = jax.device_get(fn(tree))
    return [sig + [int(a), int(b)] for sig, (a, b) in zip(leaf_signature(tree, prefix), sums)], bool(finite)


def json_sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def verify(tree, saved: dict, prefix: str = "", partial: bool = False) -> None:
    """Raises Corrupt unless `tree` (just restored) matches the digest it was saved with. `partial`: check
    only the arrays the digest records with the same shape and dtype (parameters loaded and cast)."""
    entries, finite = digest(tree, prefix)
    recorded = {e[0]: e for e in saved["leaves"]}
    if partial:
        entries = [e for e in entries if e[0] in recorded and recorded[e[0]][1:3] == e[1:3]]
    bad = [e[0] for e in entries if recorded.get(e[0]) != e]
    if bad:
        raise Corrupt(f"{len(bad)} arrays differ from their checksums (first: {bad[0]})")
    if not finite:
        raise Corrupt("it holds non-finite values")
