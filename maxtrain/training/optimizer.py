"""optax chain: clip by global norm -> AdamW (decay masked as the model's family says: off norms and biases),
warmup + decay schedule; parameters the family does not train get no update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from maxtrain.config.keys import ConfigError
from maxtrain.config.load import Config
from maxtrain.models import registry


def warmup_steps(c) -> int:
    """warmup_steps, or warmup_steps_fraction of the schedule when it is -1 (then an extended schedule warms up
    longer: a run that may be extended sets warmup_steps so its past stays the run it would have been)."""
    if c["warmup_steps"] >= 0:
        return min(c["warmup_steps"], c["learning_rate_schedule_steps"])
    return int(c["warmup_steps_fraction"] * c["learning_rate_schedule_steps"])


def wsd_decay_steps(c) -> int:
    """A wsd schedule's decay: the last wsd_decay_steps_fraction of learning_rate_schedule_steps; its warmup
    and decay must not overlap (a warmup into the decay never reaches the peak, and the decay ends late)."""
    total = c["learning_rate_schedule_steps"]
    decay = int(round(c["wsd_decay_steps_fraction"] * total))
    warmup = warmup_steps(c)
    if warmup + decay > total:
        key = "warmup_steps" if c["warmup_steps"] >= 0 else "warmup_steps_fraction"
        raise ConfigError(key, f"a warmup of {warmup} steps runs into wsd's decay over the last {decay} "
                          f"(wsd_decay_steps_fraction={c['wsd_decay_steps_fraction']:g} of "
                          f"learning_rate_schedule_steps={total}): warmup + decay must be at most {total}")
    return decay


def learning_rate_schedule(c: Config) -> optax.Schedule:
    """Linear warmup, then: cosine or linear decay to the final fraction at learning_rate_schedule_steps, a
    constant, or warmup-stable-decay (wsd: the peak until the last wsd_decay_steps_fraction of the schedule,
    then down to the final fraction, so a run extended in its stable phase goes on at the same rate)."""
    total = c.learning_rate_schedule_steps
    warmup = warmup_steps(c)
    peak, final = c.learning_rate, c.learning_rate * c.cosine_learning_rate_final_fraction
    alpha = final / peak if peak else 0.0
    decay_steps = max(total - warmup, 1)
    parts, bounds = [], []
    if warmup:
        parts, bounds = [optax.linear_schedule(0.0, peak, warmup)], [warmup]
    if c.lr_schedule_type == "cosine":
        parts.append(optax.cosine_decay_schedule(peak, decay_steps, alpha=alpha))
    elif c.lr_schedule_type == "linear":
        parts.append(optax.linear_schedule(peak, final, decay_steps))
    elif c.lr_schedule_type == "constant":
        parts.append(optax.constant_schedule(peak))
    else:  # wsd
        decay = wsd_decay_steps(c)
        stable = total - warmup - decay
        end = (optax.cosine_decay_schedule(peak, max(decay, 1), alpha=alpha) if c.wsd_decay_style == "cosine"
               else optax.linear_schedule(peak, final, max(decay, 1)))
        parts += [optax.constant_schedule(peak), end]
        bounds.append(warmup + stable)
    return parts[0] if len(parts) == 1 else optax.join_schedules(parts, bounds)


def stable_end(c) -> int | None:
    """A wsd schedule's last step at the peak (a checkpoint is saved there); None for the other schedules."""
    if c["lr_schedule_type"] != "wsd":
        return None
    return c["learning_rate_schedule_steps"] - wsd_decay_steps(c)


def extend_from(c: Config, previous: dict | None) -> int | None:
    """The step a wsd run extended with a longer schedule goes back to: the old schedule's last step at the
    peak, when the new one is still at the peak there (the steps after it decayed towards the old end)."""
    if not previous or previous.get("lr_schedule_type") != "wsd" or stable_end(c) is None:
        return None
    try:
        old = stable_end(previous)
    except (KeyError, TypeError, ConfigError):  # a last start's config of an older maxtrain
        return None
    return old if old < stable_end(c) and previous["learning_rate_schedule_steps"] < c.learning_rate_schedule_steps \
        else None


def describe_schedule(c: Config) -> str:
    """The schedule in a few words, for the run's first line."""
    total = c.learning_rate_schedule_steps
    warmup = warmup_steps(c)
    head = f"lr {c.lr_schedule_type} {c.learning_rate:g}" + (f" (warmup {warmup}" if warmup else " (")
    sep = ", " if warmup else ""
    final = f"{c.cosine_learning_rate_final_fraction:g}x"
    if c.lr_schedule_type == "wsd":
        decay = wsd_decay_steps(c)
        return head + f"{sep}stable to step {total - decay}, {c.wsd_decay_style} decay to {final} at {total})"
    if c.lr_schedule_type == "constant":
        return head + ")" if warmup else head[:-2]
    return head + f"{sep}decay to {final} at {total})"


def extension_note(c: Config, previous: dict | None, step: int) -> str | None:
    """A resumed run whose schedule length changed: what it does to the learning rate at `step` (`previous`: the
    last start's resolved config). A decay stretched or shrunk mid-way jumps; wsd's stable phase does not."""
    if not previous or step == 0 or previous.get("learning_rate_schedule_steps") == c.learning_rate_schedule_steps:
        return None
    try:
        before = c.replace(**{k: previous[k] for k in ("learning_rate_schedule_steps", "lr_schedule_type",
                                                        "warmup_steps_fraction", "warmup_steps") if k in previous})
        was, now = float(learning_rate_schedule(before)(step)), float(learning_rate_schedule(c)(step))
    except (TypeError, ValueError):  # a record from before these keys
        return None
    change = (f"learning_rate_schedule_steps is {c.learning_rate_schedule_steps} where the last start's was "
              f"{previous['learning_rate_schedule_steps']}")
    if abs(now - was) <= 1e-6 * max(abs(was), 1e-12):
        return f"note: {change}: the learning rate goes on at {now:.3e} from step {step}"
    advice = " (lr_schedule_type=wsd extends a run in its stable phase at the same rate)" \
        if c.lr_schedule_type != "wsd" else ""
    return (f"note: {change}: the {c.lr_schedule_type} schedule is re-stretched, the learning rate at step {step} "
            f"goes from {was:.3e} to {now:.3e}{advice}")


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
                        eps_root=c.adam_eps_root, weight_decay=c.adam_weight_decay, mu_dtype=jnp.dtype(c.mu_dtype),
                        mask=spec.decayed)
    if c.gradient_clipping_threshold > 0:
        adamw = optax.chain(optax.clip_by_global_norm(c.gradient_clipping_threshold), adamw)
    return only_trained(adamw, spec.trained)
