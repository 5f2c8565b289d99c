"""optax chain: clip by global norm -> AdamW (decay masked as the model's family says: off norms and biases),
warmup + decay schedule; parameters the family does not train get no update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from maxtrain.config.load import Config
from maxtrain.models import registry


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


def only_trained(inner: optax.GradientTransformation, trained) -> optax.GradientTransformation:
    """`inner` with zero updates for the parameters that are not trained (`trained(params)`: a tree of
    bools), whatever their gradients or weight decay; its state is inner's, so checkpoints keep their layout."""
    def update(updates, state, params=None):
        updates, state = inner.update(updates, state, params)
        return jax.tree.map(lambda u, t: u if t else jnp.zeros_like(u), updates, trained(updates)), state
    return optax.GradientTransformation(inner.init, update)


def make_optimizer(c: Config) -> optax.GradientTransformation:
    spec = registry.spec_for(c)  # the model's family says which parameters train and which decay
    adamw = optax.adamw(learning_rate_schedule(c), b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps,
                        weight_decay=c.adam_weight_decay, mu_dtype=jnp.dtype(c.mu_dtype),
                        mask=spec.decayed)
    if c.gradient_clipping_threshold > 0:
        adamw = optax.chain(optax.clip_by_global_norm(c.gradient_clipping_threshold), adamw)
    return only_trained(adamw, spec.trained)
