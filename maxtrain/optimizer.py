"""optax chain: clip by global norm -> AdamW (decay masked off norms and biases), warmup + decay schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from maxtrain.config import Config


def learning_rate_schedule(c: Config) -> optax.Schedule:
    total = c.learning_rate_schedule_steps
    warmup = int(c.warmup_steps_fraction * total)
    peak, final = c.learning_rate, c.learning_rate * c.cosine_learning_rate_final_fraction
    decay_steps = max(total - warmup, 1)
    if c.learning_rate_schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=final / peak if peak else 0.0)
    elif c.learning_rate_schedule == "linear":
        decay = optax.linear_schedule(peak, final, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


NO_DECAY = ("scale", "bq", "bk", "bv")  # norm scales and attention biases


def decay_mask(params):
    """Weight decay on matrices only: norm scales and biases are exempt."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in NO_DECAY, params)


def make_optimizer(c: Config) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate_schedule(c), b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                        weight_decay=c.adam_weight_decay, mu_dtype=jnp.dtype(c.mu_dtype),
                        mask=decay_mask)
    if c.gradient_clipping_threshold > 0:
        return optax.chain(optax.clip_by_global_norm(c.gradient_clipping_threshold), adamw)
    return adamw
