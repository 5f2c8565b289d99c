"""The experts' work under a mesh: each device sorts its tokens' assignments by expert and multiplies
them with a grouped matmul (maxtrain.ops.grouped_matmul), inside shard_map. Under expert parallelism each device holds
num_experts / expert-axis experts; assignments travel to their expert's device and back with
`all_to_all`, in buffers sized so that nothing is ever dropped that the capacity rule keeps. Mesh axes
are read from the logical axis rules (the expert weights' EXPERT_WEIGHT_AXES), never named here.

Shape suffixes as in maxtrain.models.moe.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from maxtrain.parallel import remat
from maxtrain.parallel.axes import ACTIVATION_AXES, EXPERT_WEIGHT_AXES
from maxtrain.ops.grouped_matmul import grouped_matmul, grouped_swiglu, permute_rows, sort_by_group
from maxtrain.parallel.chunks import merge_chunks, split_chunks
from maxtrain.parallel.rules import active_axes, splits_evenly, traced_platform


def silu_glu(gate, up):
    return nn.silu(gate) * up


def expert_mlp(x_BxLxD, experts_BxLxK, weights_BxLxK, weights, cap: int | None, matmul: str, chunk: int = 0,
               policy: str = "none", biases=None, activation=silu_glu, scale_input: bool = False):
    """sum_k weights[k] * SwiGLU_{experts[k]}(x), the experts' work split over the mesh by shard_map (with
    `scale_input`, sum_k SwiGLU_{experts[k]}(weights[k] * x): Llama 4's routing); with
    `chunk`, that many positions at a time, each chunk rematerialized under `policy`. `biases`: the
    experts' gate and up biases [E, F] (gpt-oss), added per row by its expert; `activation(gate, up)`
    the hidden activation. The down projection's bias is the caller's: outside the experts' matmuls it
    is the routing weights times the chosen experts' biases, the same on every mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    batch_axes, length_axes, _ = active_axes(ACTIVATION_AXES)
    if mesh.empty or mesh.size == 1 or not splits_evenly(ACTIVATION_AXES[:2], x_BxLxD.shape[:2]):
        # one device, or a batch the mesh cannot split (the init's shape probe, generating one sequence):
        # the same computation for GSPMD to place
        return _local_expert_mlp(x_BxLxD, experts_BxLxK, weights_BxLxK, *weights, biases, expert_axes=(),
                                 embed_axes=(), mlp_axes=(), cap=cap, matmul=matmul, chunk=chunk, policy=policy,
                                 activation=activation, scale_input=scale_input)
    expert_axes, embed_axes, mlp_axes = active_axes(EXPERT_WEIGHT_AXES)
    local = functools.partial(_local_expert_mlp, expert_axes=expert_axes, embed_axes=embed_axes,
                              mlp_axes=mlp_axes, cap=cap, matmul=matmul, chunk=chunk, policy=policy,
                              activation=activation, scale_input=scale_input)
    tokens = PartitionSpec(batch_axes or None, length_axes or None)  # context parallelism: each its positions
    weight_spec = PartitionSpec(expert_axes or None, embed_axes or None, mlp_axes or None)
    down_spec = PartitionSpec(expert_axes or None, mlp_axes or None, embed_axes or None)
    bias_spec = PartitionSpec(expert_axes or None, mlp_axes or None)  # (None: no leaves, any spec fits)
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(tokens, tokens, tokens, weight_spec, weight_spec, down_spec, bias_spec),
                         out_specs=tokens, check_vma=False)(x_BxLxD, experts_BxLxK, weights_BxLxK, *weights, biases)


def _local_expert_mlp(x_BxLxD, experts_BxLxK, weights_BxLxK, gate_GxDxF, up_GxDxF, down_GxFxD, biases, *,
                      expert_axes, embed_axes, mlp_axes, cap, matmul, chunk, policy, activation, scale_input):
    if embed_axes:  # fsdp: gather the experts' embed dimension (its transpose reduce-scatters the gradient)
        gate_GxDxF, up_GxDxF = (jax.lax.all_gather(w, embed_axes, axis=1, tiled=True) for w in (gate_GxDxF, up_GxDxF))
        down_GxFxD = jax.lax.all_gather(down_GxFxD, embed_axes, axis=2, tiled=True)
    weights = (gate_GxDxF, up_GxDxF, down_GxFxD)
    length = x_BxLxD.shape[1]
    run = functools.partial(_route_and_compute, weights=weights, biases=biases or (), expert_axes=expert_axes,
                            cap=cap, matmul=matmul, activation=activation, scale_input=scale_input)
    if chunk <= 0 or length % chunk or length == chunk:
        y_BxLxD = run(x_BxLxD, experts_BxLxK, weights_BxLxK)
    else:  # long sequences: the [assignments, expert width] intermediates exist one chunk at a time
        if policy != "none":
            run = jax.checkpoint(run, policy=remat.POLICIES[policy])
        chunks = [split_chunks(z, chunk, shards=1) for z in (x_BxLxD, experts_BxLxK, weights_BxLxK)]  # local
        y_BxLxD = merge_chunks(jax.lax.map(lambda c: run(*c), chunks), shards=1)
    if mlp_axes:  # tensor parallel: each device holds a slice of every expert's width
        y_BxLxD = jax.lax.psum(y_BxLxD, mlp_axes)
    return y_BxLxD


def _route_and_compute(x_BxLxD, experts_BxLxK, weights_BxLxK, *, weights, biases, expert_axes, cap, matmul,
                       activation, scale_input=False):
    """This device's tokens through their experts: sorted by expert, exchanged (expert parallelism),
    multiplied, and summed back per token with the routing weights."""
    gate_GxDxF, up_GxDxF, down_GxFxD = weights
    b, length, d = x_BxLxD.shape
    k = experts_BxLxK.shape[-1]
    x_TxD = x_BxLxD.reshape(-1, d)
    experts_A = experts_BxLxK.reshape(-1)
    local_experts = gate_GxDxF.shape[0]

    def swiglu(x, gmm):
        gate = checkpoint_name(gmm(x, 0), remat.MLP_IN)
        up = checkpoint_name(gmm(x, 1), remat.MLP_IN)
        return checkpoint_name(gmm(activation(gate, up), 2), remat.MLP_OUT)

    def mlp(xs_MxD, group_sizes_G):  # blocked, megablox and tokamax pad or select once for the three matmuls
        if matmul != "ragged_dot":
            run = grouped_swiglu(matmul, traced_platform())
            return run(xs_MxD, group_sizes_G, (gate_GxDxF, up_GxDxF, down_GxFxD), swiglu, biases)
        return swiglu(xs_MxD, lambda x, i: grouped_matmul(x, (gate_GxDxF, up_GxDxF, down_GxFxD)[i], group_sizes_G,
                                                         matmul, biases[i] if i < len(biases) else None))

    peers = _size(expert_axes)
    order_A, inverse_A, sizes_E = sort_by_group(experts_A, local_experts * peers)
    x_AxD = jnp.repeat(x_TxD, k, axis=0)
    if scale_input:  # each assignment's input times its weight; summed back unweighted (a dropped one: 0)
        x_AxD = x_AxD * weights_BxLxK.reshape(-1, 1).astype(x_AxD.dtype)
        weights_BxLxK = (experts_BxLxK < local_experts * peers).astype(weights_BxLxK.dtype)
    xs_AxD = permute_rows(x_AxD, order_A, inverse_A)
    if peers == 1:
        ys_AxD = mlp(xs_AxD, sizes_E)
    else:
        rows = b * buffer_rows(length, k, local_experts, cap)
        ys_AxD = _exchange(xs_AxD, experts_A[order_A], sizes_E, mlp, expert_axes, local_experts, rows)
    y_TxKxD = permute_rows(ys_AxD, inverse_A, order_A).reshape(-1, k, d)
    y_TxD = jnp.einsum("tkd,tk->td", y_TxKxD, weights_BxLxK.reshape(-1, k))
    return y_TxD.reshape(b, length, d)


def buffer_rows(length: int, k: int, local_experts: int, cap: int | None) -> int:
    """Rows a device sends each expert-parallel peer, per sequence it holds: the most that can go to the
    peer's experts (each token picks an expert once; the capacity rule bounds each expert further)."""
    rows = length * min(k, local_experts)
    return rows if cap is None else min(rows, cap * local_experts)


def _size(axes) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes) if axes else 1


def _exchange(xs_AxD, experts_A, sizes_E, mlp, expert_axes, local_experts, rows):
    """Expert parallelism: the sorted assignments go to the devices holding their experts (all_to_all),
    through `mlp` there, and back. Each peer gets a fixed `rows`-row slot, valid rows first."""
    peers = _size(expert_axes)
    a, d = xs_AxD.shape
    count_P = sizes_E.reshape(peers, local_experts).sum(axis=1)
    start_P = jnp.cumsum(count_P) - count_P
    slot_PxS = start_P[:, None] + jnp.arange(rows)
    valid_PxS = jnp.arange(rows) < count_P[:, None]
    slot_PxS = jnp.where(valid_PxS, slot_PxS, a)  # row a: a zero row
    send_PxSxD = jnp.concatenate([xs_AxD, jnp.zeros((1, d), xs_AxD.dtype)])[slot_PxS]
    local_id_PxS = jnp.where(valid_PxS, jnp.append(experts_A, 0)[slot_PxS] % local_experts, local_experts)
    recv_PxSxD = jax.lax.all_to_all(send_PxSxD, expert_axes, 0, 0, tiled=True)
    recv_id_PxS = jax.lax.all_to_all(local_id_PxS, expert_axes, 0, 0, tiled=True)

    order, inverse, sizes_G = sort_by_group(recv_id_PxS.reshape(-1), local_experts)
    out_PxSxD = mlp(recv_PxSxD.reshape(-1, d)[order], sizes_G)[inverse].reshape(peers, rows, d)
    back_PxSxD = jax.lax.all_to_all(out_PxSxD, expert_axes, 0, 0, tiled=True)
    # sorted assignment j came from slot (its peer, j - the peer's start)
    peer_A = jnp.minimum(experts_A // local_experts, peers - 1)
    within_A = jnp.arange(a) - start_P[peer_A]
    kept_A = (experts_A < local_experts * peers) & (within_A < rows)
    return jnp.where(kept_A[:, None], back_PxSxD[peer_A, jnp.clip(within_A, 0, rows - 1)], 0)
