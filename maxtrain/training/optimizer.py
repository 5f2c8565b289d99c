"""optax chain: clip by global norm -> AdamW or Muon (decay masked as the model's family says: off norms and
biases), warmup + decay schedule; parameters the family does not train get no update."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from optax.contrib import MuonDimensionNumbers, scale_by_muon
from optax.transforms import MaskedNode

from maxtrain.config.keys import ConfigError
from maxtrain.config.load import Config
from maxtrain.models import registry
from maxtrain.parallel import pipeline


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


# Axes of a weight that hold separate matrices: each layer's (scanned, or a pipeline's stack) and each expert's
# is orthogonalized alone.
MATRIX_BATCH_AXES = ("layers", pipeline.LAYERS_AXIS, "experts")


def muon_dimensions(logical_names: tuple) -> MuonDimensionNumbers | None:
    """Which axes of a weight (by its logical axis names) are the matrix Muon orthogonalizes: the input (reduction)
    axes and the output axes, the rest separate matrices; None for AdamW's: the embedding and the output head (a
    vocab axis), norms, biases and anything with fewer than two axes of its own. A projection into the model's
    width ends in embed (attention's out: heads x head_dim -> embed); any other takes its first axis in (q:
    embed -> heads x head_dim, MLA's wkv_b: kv_lora -> heads x head_dim, the router: embed -> experts)."""
    own = [i for i, name in enumerate(logical_names) if name not in MATRIX_BATCH_AXES]
    if len(own) < 2 or "vocab" in logical_names or "norm" in logical_names:
        return None
    if logical_names[own[-1]] == "embed":
        return MuonDimensionNumbers(reduction_axis=tuple(own[:-1]), output_axis=(own[-1],))
    return MuonDimensionNumbers(reduction_axis=(own[0],), output_axis=tuple(own[1:]))


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _muon(c: Config, logical_specs, schedule, decayed) -> optax.GradientTransformation:
    """Muon (Newton-Schulz orthogonalized Nesterov momentum) for the hidden matrices and AdamW for the rest, as
    optax.contrib.muon partitions them, with the family's decay mask on both sides (optax's own leaves AdamW's
    side unmasked, decaying norms) and AdamW's side the plain AdamW of opt_type=adamw. Under a sharded mesh each
    matrix is orthogonalized whole: the step is one SPMD program over the global arrays, so XLA gathers or
    reduces across the shards what X @ X.T needs."""
    if logical_specs is None:
        raise ValueError("opt_type=muon needs the parameters' logical axis names")
    dims = jax.tree.map(lambda spec: muon_dimensions(tuple(spec)), logical_specs, is_leaf=_is_spec)
    is_dims = lambda x: x is None or isinstance(x, (MuonDimensionNumbers, MaskedNode))  # noqa: E731
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims, is_leaf=is_dims)

    def muon_dims(updates):  # the Muon side sees the AdamW side's leaves as MaskedNodes: so must its numbers
        return jax.tree.map(lambda d, label: d if label == "muon" else MaskedNode(), dims, labels, is_leaf=is_dims)

    matrices = optax.chain(
        scale_by_muon(beta=c.muon_beta, eps=c.adam_eps, mu_dtype=jnp.dtype(c.mu_dtype),
                      weight_dimension_numbers=muon_dims),
        _scale_by_shape(muon_dims, c.muon_consistent_rms),
        optax.add_decayed_weights(c.muon_weight_decay, decayed),
        optax.scale_by_learning_rate(schedule))
    return optax.partition({"muon": matrices, "adam": _adamw(c, schedule, decayed)}, labels)


def _scale_by_shape(muon_dims, consistent_rms: float) -> optax.GradientTransformation:
    """An orthogonalized update times sqrt(max(fan_in, fan_out)) x consistent_rms (its RMS is then about that:
    Moonlight's, arXiv:2502.16982), or at 0 sqrt(max(1, fan_out / fan_in)) (Keller Jordan's width scaling), as
    optax.contrib.muon does (its transform is not exported)."""
    def scale(update, dims):
        fan_in = math.prod(update.shape[a] for a in dims.reduction_axis)
        fan_out = math.prod(update.shape[a] for a in dims.output_axis)
        factor = (math.sqrt(max(fan_in, fan_out)) * consistent_rms if consistent_rms
                  else math.sqrt(max(1, fan_out / fan_in)))
        return update * jnp.asarray(factor, update.dtype)

    def update(updates, state, params=None):
        del params
        is_dims = lambda x: isinstance(x, MuonDimensionNumbers)  # noqa: E731
        return jax.tree.map(scale, updates, muon_dims(updates), is_leaf=is_dims), state
    return optax.GradientTransformation(optax.init_empty_state, update)


def _adamw(c: Config, schedule, decayed) -> optax.GradientTransformation:
    adamw = optax.adamw(schedule, b1=c.adam_b1, b2=c.adam_b2, eps=c.adam_eps, eps_root=c.adam_eps_root,
                        weight_decay=c.adam_weight_decay, mu_dtype=jnp.dtype(c.mu_dtype), mask=decayed)
    # optax keeps the second moment in the parameters' dtype
    return adamw if c.nu_dtype == c.weight_dtype else second_moment_in(jnp.dtype(c.nu_dtype), adamw)


def second_moment_in(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` with Adam's second moment stored in `dtype` (optax has mu_dtype, no nu_dtype): read back in
    float32 for the update, written narrowed after it."""
    is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731

    def cast(state, to):
        return jax.tree.map(lambda s: s._replace(nu=optax.tree.cast(s.nu, to)) if is_adam(s) else s, state,
                            is_leaf=is_adam)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)
    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def make_optimizer(c: Config, logical_specs=None) -> optax.GradientTransformation:
    """`logical_specs`: the parameters' logical axis names (PartitionSpecs), which Muon reads its matrices from."""
    spec = registry.spec_for(c)  # the model's family says which parameters train and which decay
    schedule = learning_rate_schedule(c)
    inner = (_muon(c, logical_specs, schedule, spec.decayed) if c.opt_type == "muon"
             else _adamw(c, schedule, spec.decayed))
    if c.gradient_clipping_threshold > 0:
        inner = optax.chain(optax.clip_by_global_norm(c.gradient_clipping_threshold), inner)
    return only_trained(inner, spec.trained)
