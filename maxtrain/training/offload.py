"""The optimizer's update with its state in host memory (optimizer_memory_host_offload), streamed through the device
one parameter at a time.

Bringing the whole state in before the update (jax.device_put of the tree, as MaxText does) plans the same device
memory as no offload: XLA's temporaries take what the arguments gave up. Here each parameter's part of the state
comes in, is updated and goes back out before the next part comes in (each transfer waits, through an
optimization barrier, for the previous part to be back on the host), so the device holds the moments of one
parameter at a time: for a scanned stack, one stacked weight's.

Any optax transformation whose update is per parameter (AdamW, Muon, masks) streams this way: each part is one
update of the whole tree in which every other parameter is an empty array of its rank (no work, no memory). The
gradients are clipped by their global norm before (each part's clip then changes nothing), and the state's
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


def streamed_update(tx, grads, opt_state, params, finite, clip: float, device_shardings, host_shardings):
    """(params, opt_state) after one update of `tx`: `opt_state` lives in pinned_host memory (`host_shardings`,
    its device twin `device_shardings`); `params` and `grads` are on the device."""
    if clip > 0:  # the global norm, once: a part's own clip inside tx then sees a norm below the threshold
        grads, _ = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())
    param_leaves, param_def = jax.tree.flatten(params)
    grad_leaves = jax.tree.leaves(grads)
    is_masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731
    indices = jax.tree.unflatten(param_def, range(len(param_leaves)))  # each state leaf's parameter
    owners = jax.tree.leaves(optax.tree_map_params(
        tx, lambda leaf, i: leaf if is_masked(leaf) else i, opt_state, indices,
        transform_non_params=lambda _: NOT_A_PARAMETER, is_leaf=is_masked))
    state_leaves, state_def = jax.tree.flatten(opt_state)
    device_leaves, host_leaves = jax.tree.leaves(device_shardings), jax.tree.leaves(host_shardings)
    counters = [j for j, owner in enumerate(owners) if owner == NOT_A_PARAMETER]  # on the device throughout
    on_device = dict(zip(counters, jax.device_put([state_leaves[j] for j in counters],
                                                  [device_leaves[j] for j in counters])))
    new_params, new_state = list(param_leaves), [None] * len(state_leaves)
    previous = None
    for i in range(len(param_leaves)):
        mine = [j for j, owner in enumerate(owners) if owner == i]
        incoming = [state_leaves[j] for j in mine]
        if previous is not None:  # not before the previous part is back on the host
            incoming, _ = jax.lax.optimization_barrier((incoming, previous))
        incoming = dict(zip(mine, jax.device_put(incoming, [device_leaves[j] for j in mine])))
        part_state = [incoming.get(j, on_device.get(j)) if j in incoming or j in on_device else _empty(x)
                      for j, x in enumerate(state_leaves)]
        part = lambda leaves, k=i: [x if n == k else _empty(x) for n, x in enumerate(leaves)]  # noqa: E731
        updates, out_state = tx.update(jax.tree.unflatten(param_def, part(grad_leaves)),
                                       jax.tree.unflatten(state_def, part_state),
                                       jax.tree.unflatten(param_def, part(param_leaves)))
        updated = optax.apply_updates(param_leaves[i], jax.tree.leaves(updates)[i])
        new_params[i] = jnp.where(finite, updated, param_leaves[i])
        out_leaves = jax.tree.leaves(out_state)
        keep = mine + (counters if i == 0 else [])  # every part counts the same step: the first one's counters
        outgoing = [jnp.where(finite, out_leaves[j], part_state[j]) for j in keep]
        outgoing = jax.device_put(outgoing, [host_leaves[j] for j in keep])
        for j, x in zip(keep, outgoing):
            new_state[j] = x
        previous = outgoing
    return jax.tree.unflatten(param_def, new_params), jax.tree.unflatten(state_def, new_state)
