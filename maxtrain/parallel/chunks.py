"""Chunks of positions, for a map or scan to walk through a long sequence (the MLP, an MoE layer's
experts, the loss). Under context parallelism each chunk takes positions from every device's share."""

from __future__ import annotations

import jax.numpy as jnp

from maxtrain.parallel.rules import length_shards


def split_chunks(x_BxL, chunk: int, shards: int | None = None):
    """[B, L, ...] -> [N, B, C, ...]: chunks of positions for a scan or map to walk through, `chunk` of
    each device's positions in each (at most all of them). Under context parallelism (L split over S
    devices; default: as the active mesh splits `length`) a chunk takes `chunk` positions from every
    device's share (C = S x chunk), so each device works on its own positions at every step;
    contiguous chunks would each live on one device."""
    b, length = x_BxL.shape[:2]
    shards = length_shards() if shards is None else shards
    chunk = min(chunk, length // shards)
    x_BxSxNxC = x_BxL.reshape(b, shards, length // shards // chunk, chunk, *x_BxL.shape[2:])
    x_NxBxSxC = jnp.moveaxis(x_BxSxNxC, 2, 0)
    return x_NxBxSxC.reshape(x_NxBxSxC.shape[0], b, shards * chunk, *x_BxL.shape[2:])


def merge_chunks(x_NxBxC, shards: int | None = None):
    """The inverse of split_chunks."""
    n, b, c = x_NxBxC.shape[:3]
    shards = length_shards() if shards is None else shards
    x_NxBxSxC = x_NxBxC.reshape(n, b, shards, c // shards, *x_NxBxC.shape[3:])
    return jnp.moveaxis(x_NxBxSxC, 0, 2).reshape(b, n * c, *x_NxBxC.shape[3:])
