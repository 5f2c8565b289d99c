"""Input pipelines. Each yields global batches: dicts of [global_batch, max_target_length] arrays
(inputs, targets, positions, segment_ids, weights) laid out with the config's batch sharding.

Iterators expose `get_state()` / `set_state()` so checkpoints can hold the data position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtrain.config import Config


SYNTHETIC_MAX_STEP = 4  # the best achievable loss on synthetic data is ln(4) = 1.386


def synthetic_batch(step, *, seed: int, batch: int, length: int, vocab: int) -> dict:
    """A learnable random walk: each token is the previous one plus a uniform step in 1..4, mod vocab.

    A model that learns the successor structure reaches loss ln(4) from ln(vocab), so the curve
    means something. Depends on (seed, step) alone: the same on any mesh, resumable from the step.
    """
    key = jax.random.fold_in(jax.random.key(seed), step)
    start_key, steps_key = jax.random.split(key)
    start_Bx1 = jax.random.randint(start_key, (batch, 1), 0, vocab)
    steps_BxL = jax.random.randint(steps_key, (batch, length), 1, SYNTHETIC_MAX_STEP + 1)
    seq_BxL1 = jnp.concatenate([start_Bx1, start_Bx1 + jnp.cumsum(steps_BxL, axis=1)], axis=1) % vocab
    return {
        "inputs": seq_BxL1[:, :-1].astype(jnp.int32),
        "targets": seq_BxL1[:, 1:].astype(jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)),
        "segment_ids": jnp.ones((batch, length), jnp.int32),
        "weights": jnp.ones((batch, length), jnp.float32),
    }


class SyntheticIterator:
    """Generates each batch on device, already sharded; its whole state is the step."""

    def __init__(self, c: Config, batch_sharding):
        self._make = jax.jit(
            functools.partial(synthetic_batch, seed=c.data_shuffle_seed, batch=c.global_batch_size,
                              length=c.max_target_length, vocab=c.vocab_size),
            out_shardings=batch_sharding)
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = self._make(jnp.int32(self.step))
        self.step += 1
        return batch

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])


def make_iterator(c: Config, batch_sharding):
    if c.dataset_type == "synthetic":
        return SyntheticIterator(c, batch_sharding)
    raise ValueError(f"unsupported dataset_type {c.dataset_type!r}")  # config validation prevents this
