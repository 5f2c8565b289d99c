"""The optimizer's update with its state or the weights in host memory (optimizer_memory_host_offload,
parameter_memory_host_offload), streamed through the device one parameter at a time.

Bringing the whole state in before the update (jax.device_put of the tree, as MaxText does) plans the same device
memory as no offload: XLA's temporaries take what the arguments gave up. Here each parameter's part of the state
comes in, is updated and goes back out before the next part comes in (each transfer waits, through an
optimization barrier, for the previous part to be back on the host), so the device holds the moments of one
parameter at a time: for a scanned stack, one stacked weight's. Host-offloaded weights come in the same way, with
their part of the state: the forward and backward passes' copy of them is dead by then.

Any optax transformation whose update is per parameter (AdamW, Muon, masks) streams this way: each part is one
update of the whole tree in which every other parameter is an empty array of its rank (no work, no memory). The
gradients of each part are clipped by the step's global norm (tx's own clip then changes nothing), and the state's
counters come from the first part (every part counts the same step). A step whose loss or gradients are not
finite keeps each part as it was (a select per part, not a cond around the whole update).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax.transforms import MaskedNode

NOT_A_PARAMETER = -1  # a state leaf that belongs to no parameter (a step counter): in every part


def _empty(x):
    return jnp.zeros((0,) * x.ndim, x.dtype)


def _alone(treedef, leaves, i: int, x):
    """The tree with `x` at leaf i and every other leaf empty."""
    return jax.tree.unflatten(treedef, [x if n == i else _empty(y) for n, y in enumerate(leaves)])


def streamed_update(tx, grads, grad_norm, opt_state, params, finite, clip: float, on_device, home):
    """(params, opt_state) after one update of `tx`. `home` holds the shardings (a TrainState's params and
    opt_state) where each lives between steps, pinned_host memory where offloaded; `on_device` their device twins.
    `grads` are on the device; `grad_norm` is their global norm."""
    param_leaves, param_def = jax.tree.flatten(params)
    grad_leaves = jax.tree.leaves(grads)
    is_masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731
    indices = jax.tree.unflatten(param_def, range(len(param_leaves)))  # each state leaf's parameter
    owners = jax.tree.leaves(optax.tree_map_params(
        tx, lambda leaf, i: leaf if is_masked(leaf) else i, opt_state, indices,
        transform_non_params=lambda _: NOT_A_PARAMETER, is_leaf=is_masked))
    state_leaves, state_def = jax.tree.flatten(opt_state)
    device_leaves, home_leaves = jax.tree.leaves(on_device.opt_state), jax.tree.leaves(home.opt_state)
    param_device, param_home = jax.tree.leaves(on_device.params), jax.tree.leaves(home.params)
    counters = [j for j, owner in enumerate(owners) if owner == NOT_A_PARAMETER]  # on the device throughout
    on_device_now = dict(zip(counters, jax.device_put([state_leaves[j] for j in counters],
                                                      [device_leaves[j] for j in counters])))
    new_params, new_state = list(param_leaves), [None] * len(state_leaves)
    previous = None
    for i in range(len(param_leaves)):
        mine = [j for j, owner in enumerate(owners) if owner == i]
        incoming = (param_leaves[i], [state_leaves[j] for j in mine])
        if previous is not None:  # not before the previous part is back home
            incoming, _ = jax.lax.optimization_barrier((incoming, previous))
        param, incoming = jax.device_put(incoming, (param_device[i], [device_leaves[j] for j in mine]))
        grad = grad_leaves[i]
        if clip > 0:  # by the global norm, as optax.clip_by_global_norm (a part's own clip in tx then does nothing)
            grad = jax.lax.select(grad_norm < clip, grad, (grad / grad_norm.astype(grad.dtype)) * clip)
        incoming = dict(zip(mine, incoming))
        part_state = [incoming.get(j, on_device_now.get(j)) if j in incoming or j in on_device_now else _empty(x)
                      for j, x in enumerate(state_leaves)]
        updates, out_state = tx.update(_alone(param_def, grad_leaves, i, grad),
                                       jax.tree.unflatten(state_def, part_state),
                                       _alone(param_def, param_leaves, i, param))
        updated = jnp.where(finite, optax.apply_updates(param, jax.tree.leaves(updates)[i]), param)
        out_leaves = jax.tree.leaves(out_state)
        keep = mine + (counters if i == 0 else [])  # every part counts the same step: the first one's counters
        outgoing = [jnp.where(finite, out_leaves[j], part_state[j]) for j in keep]
        new_params[i], outgoing = jax.device_put((updated, outgoing), (param_home[i], [home_leaves[j] for j in keep]))
        for j, x in zip(keep, outgoing):
            new_state[j] = x
        previous = (new_params[i], outgoing)
    return jax.tree.unflatten(param_def, new_params), jax.tree.unflatten(state_def, new_state)
