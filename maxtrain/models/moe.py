"""Mixture-of-experts MLP: a drop-in for model.MLP. A router picks `num_experts_per_tok` experts per
token; each expert is a SwiGLU; the token's output is the weighted sum of its experts' outputs.

Routing (softmax or sigmoid scores, top-k, optional renormalisation and DeepSeek-V3's selection bias),
the auxiliary losses and the capacity rule are plain array code over the whole batch, so GSPMD sees
global statistics. The experts' work is the plan's (maxtrain.parallel.experts: per device, assignments
sorted by expert, exchanged under expert parallelism); this module holds its mesh-free pieces: the
sort and permutation of assignments, the exchange buffers' size and the grouped matmuls, so only the
chosen experts' FLOPs are spent.

Shape suffixes as in model.py, and: E experts, K experts per token, T tokens on a device, A = T*K
assignments, G experts on a device, F expert width, S rows a device sends to each peer.
"""

from __future__ import annotations

import math

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models import stacks as stacks_lib

# Logical names of the expert weights' dimensions and of the activations the block reads.
EXPERT_WEIGHT_AXES = ("experts", "embed", "moe_mlp")
ACTIVATION_AXES = ("batch", "length", "embed")


class MoEBlock(nn.Module):
    args: object  # model.ModelArgs (not imported: model imports this module)

    @nn.compact
    def __call__(self, x_BxLxD):
        from maxtrain.models.decoder import MLP, dense_weight  # noqa: circular at import time only

        a = self.args
        e, f = a.num_experts, a.moe_mlp
        router_DxE = self.param("router", nn.with_logical_partitioning(
            nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"), ("embed", None)),
            (a.embed, e), a.weight_dtype)
        bias_E = None
        if a.routed_bias:  # DeepSeek-V3's balancing bias: not trained, moved by the train step (step.py)
            bias_E = self.param("router_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                                (e,), jnp.float32)
        weights_BxLxK, experts_BxLxK = self.route(x_BxLxD, router_DxE, bias_E)

        gate_ExDxF = dense_weight(self, "wi_gate", (e, a.embed, f), EXPERT_WEIGHT_AXES, fan_in=(1,))
        up_ExDxF = dense_weight(self, "wi_up", (e, a.embed, f), EXPERT_WEIGHT_AXES, fan_in=(1,))
        down_ExFxD = dense_weight(self, "wo", (e, f, a.embed), ("experts", "moe_mlp", "embed"), fan_in=(1,))
        cap = capacity(a, x_BxLxD.shape[1]) if a.capacity_factor > 0 else None
        y_BxLxD = a.plan.expert_mlp(x_BxLxD, experts_BxLxK, weights_BxLxK.astype(a.dtype),
                                    (gate_ExDxF, up_ExDxF, down_ExFxD), cap)
        if a.shared_experts:  # always-on experts (DeepSeek, Qwen2-MoE), one SwiGLU of their joint width
            y_BxLxD = y_BxLxD + MLP(a, width=a.shared_experts * f, name="shared")(x_BxLxD)
        return y_BxLxD

    def route(self, x_BxLxD, router_DxE, bias_E):
        """(weights [B,L,K] float32, experts [B,L,K]; num_experts marks a dropped assignment). Records
        each layer's auxiliary losses and expert load as intermediates."""
        a = self.args
        e, k = a.num_experts, a.experts_per_token
        logits_BxLxE = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32), router_DxE.astype(jnp.float32))
        if a.routed_score_func == "softmax":
            scores_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1)
            probs_BxLxE = scores_BxLxE
        else:
            scores_BxLxE = jax.nn.sigmoid(logits_BxLxE)
            probs_BxLxE = scores_BxLxE / jnp.sum(scores_BxLxE, axis=-1, keepdims=True)
        choose_BxLxE = scores_BxLxE if bias_E is None else scores_BxLxE + jax.lax.stop_gradient(bias_E)
        _, experts_BxLxK = jax.lax.top_k(choose_BxLxE, k)
        weights_BxLxK = jnp.take_along_axis(scores_BxLxE, experts_BxLxK, axis=-1)
        if a.norm_topk_prob:
            weights_BxLxK = weights_BxLxK / (jnp.sum(weights_BxLxK, axis=-1, keepdims=True) + 1e-20)
        weights_BxLxK = weights_BxLxK * a.routed_scaling_factor

        # Load and the Switch/Mixtral balancing loss over the whole batch: E * sum_e (tokens to e / tokens)
        # * (mean probability of e), k at perfect balance (as HF's and MaxText's). Counting is not differentiable.
        tokens = math.prod(x_BxLxD.shape[:2])
        counts_E = jnp.sum(jax.nn.one_hot(experts_BxLxK, e, dtype=jnp.float32), axis=(0, 1, 2))
        self.sow("intermediates", "expert_load", counts_E / (tokens * k))
        self.sow("intermediates", "lb_loss", e * jnp.sum(counts_E / tokens * jnp.mean(probs_BxLxE, axis=(0, 1))))
        self.sow("intermediates", "z_loss", jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxE, axis=-1))))
        if a.capacity_factor > 0:
            length, places = x_BxLxD.shape[1], a.plan.positions_order(x_BxLxD.shape[1])
            if places is not None:  # "first" by position: the batch is in zigzag order
                keep_BxLxK = within_capacity(experts_BxLxK[:, np.argsort(places)], e, capacity(a, length))[:, places]
            else:
                keep_BxLxK = within_capacity(experts_BxLxK, e, capacity(a, length))
            self.sow("intermediates", "dropped", 1.0 - jnp.mean(keep_BxLxK.astype(jnp.float32)))
            experts_BxLxK = jnp.where(keep_BxLxK, experts_BxLxK, e)
        return weights_BxLxK, experts_BxLxK


def capacity(a, length: int) -> int:
    """Assignments each expert takes from one sequence: capacity_factor x its fair share, rounded up."""
    return math.ceil(a.capacity_factor * length * a.experts_per_token / a.num_experts)


def within_capacity(experts_BxLxK, num_experts: int, cap: int):
    """True where an assignment is kept: per sequence and expert, the first `cap` assignments, in order of
    choice rank first (every token's first choice before any second choice, as GShard), then position."""
    b, length, k = experts_BxLxK.shape
    onehot_BxAxE = jax.nn.one_hot(experts_BxLxK.swapaxes(1, 2).reshape(b, k * length), num_experts, dtype=jnp.int32)
    rank_BxA = jnp.sum(jnp.cumsum(onehot_BxAxE, axis=1) * onehot_BxAxE, axis=-1)  # 1-based place in its expert
    return (rank_BxA <= cap).reshape(b, k, length).swapaxes(1, 2)


def buffer_rows(length: int, k: int, local_experts: int, cap: int | None) -> int:
    """Rows a device sends each expert-parallel peer, per sequence it holds: the most that can go to the
    peer's experts (each token picks an expert once; the capacity rule bounds each expert further)."""
    rows = length * min(k, local_experts)
    return rows if cap is None else min(rows, cap * local_experts)


@jax.custom_vjp
def permute_rows(x_NxD, index_M, inverse_N):
    """y[i] = x[index[i]], or zeros where index[i] == N. `inverse` is the map the other way (each row of x:
    its row in y, or M for none), so the gradient is a gather too: XLA:CPU's scatters are slow."""
    return _take(x_NxD, index_M)


def _take(x_NxD, index_M):
    return jnp.concatenate([x_NxD, jnp.zeros((1, x_NxD.shape[1]), x_NxD.dtype)])[index_M]


permute_rows.defvjp(lambda x, index, inverse: (_take(x, index), (index, inverse)),
                    lambda res, dy: (_take(dy, res[1]), None, None))


def sort_by_group(groups_A, num_groups: int):
    """(order, its inverse, group sizes): groups_A[order] ascending, stable; ids >= num_groups sort last
    and are not counted."""
    order_A = jnp.argsort(groups_A, stable=True)
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(order_A.shape[0], dtype=order_A.dtype))
    return order_A, inverse_A, jnp.bincount(groups_A, length=num_groups).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Grouped matmul: rows sorted by group, row i times its group's matrix; rows past the groups give 0


MEGABLOX_INTERPRET = False  # tests run the TPU kernel in Pallas' interpreter on CPU


def grouped_matmul(x_MxD, w_GxDxF, group_sizes_G, method: str):
    """`megablox`: JAX's Pallas grouped-matmul kernels for TPU (gmm, and tgmm for the weight gradient).
    `ragged_dot`: XLA's grouped matmul (GPU); XLA:TPU forms its weight gradient through a [groups, rows,
    width] mask (7 GiB a layer for Mixtral 8x7B) and XLA:CPU expands it into a dense matmul per group
    (G times the work), so on CPU `blocked` walks blocks of rows, one group each."""
    if method == "ragged_dot":
        return jax.lax.ragged_dot(x_MxD, w_GxDxF, group_sizes_G)
    if method == "megablox":
        return _megablox(x_MxD, w_GxDxF, group_sizes_G)
    return _blocked(x_MxD, w_GxDxF, group_sizes_G)


def _megablox(x_MxD, w_GxDxF, group_sizes_G):
    return megablox_swiglu(x_MxD, group_sizes_G, (w_GxDxF,), lambda x, matmul: matmul(x, 0))


def megablox_swiglu(xs_MxD, group_sizes_G, weights, body):
    """`body(x, matmul)` on the rows padded to whole tiles, `matmul(x, i)` JAX's Pallas gmm with weights[i]
    (tgmm for its gradient). The kernels leave rows past the groups unwritten, in the output and in x's
    gradient, and tgmm reads only rows inside groups; rows never mix between the matmuls. So selecting
    those rows away at the two ends of `body` keeps them out of every result and gradient (a select, not
    a product: whatever they hold never reaches a gradient). A select after each matmul kept a second
    copy of each [rows, expert width] output alive at the step's peak (Mixtral 8x7B: 3 x 0.9 GiB)."""
    from jax.experimental.pallas.ops.tpu.megablox import ops  # TPU only (or interpreted)

    m = xs_MxD.shape[0]
    tm = min(512, -(-m // 8) * 8)  # rows per tile: the kernel needs whole tiles of rows
    padded = -(-m // tm) * tm
    in_group_Px1 = (jnp.arange(padded) < jnp.sum(group_sizes_G))[:, None]
    x_PxD = jnp.where(in_group_Px1, jnp.pad(xs_MxD, ((0, padded - m), (0, 0))), 0)

    def matmul(x_PxK, i):
        k, n = weights[i].shape[1:]
        return ops.gmm(x_PxK, weights[i], group_sizes_G, x_PxK.dtype, (tm, min(1024, k), min(1024, n)), None,
                       None, False, MEGABLOX_INTERPRET)
    return jnp.where(in_group_Px1, body(x_PxD, matmul), 0)[:m]


def _block_layout(group_sizes_G, rows: int, block: int):
    """Each group's rows padded to whole blocks: for every padded row its source row (`rows` = none), and
    each block's group; for every source row its padded row and whether it is in a group."""
    g = group_sizes_G.shape[0]
    blocks = -(-rows // block) + g  # enough for any split of `rows` rows into g padded groups
    padded_G = -(-group_sizes_G // block) * block
    start_G = jnp.cumsum(group_sizes_G) - group_sizes_G
    pstart_G = jnp.cumsum(padded_G) - padded_G
    r_R = jnp.arange(blocks * block)
    group_R = jnp.clip(jnp.searchsorted(pstart_G + padded_G, r_R, side="right"), 0, g - 1)
    offset_R = r_R - pstart_G[group_R]
    source_R = jnp.where(offset_R < group_sizes_G[group_R], start_G[group_R] + offset_R, rows)
    block_group_N = group_R[::block]
    i_M = jnp.arange(rows)
    group_M = jnp.clip(jnp.searchsorted(start_G + group_sizes_G, i_M, side="right"), 0, g - 1)
    in_group_M = i_M < jnp.sum(group_sizes_G)
    padded_M = pstart_G[group_M] + i_M - start_G[group_M]
    return source_R, block_group_N, padded_M, in_group_M


def _blocked(x_MxD, w_GxDxF, group_sizes_G):
    return blocked_swiglu(x_MxD, group_sizes_G, (w_GxDxF,), lambda x, matmul: matmul(x, 0))


def blocked_swiglu(xs_MxD, group_sizes_G, weights, body):
    """`body(x, matmul)` on rows padded into blocks, one group each: `matmul(x, i)` multiplies
    every block by its group's copy of weights[i] in one batched matmul. The rows are padded once and
    unpadded once around the whole body (permutations as gathers in both directions), and each block's
    matrix is picked by a one-hot matmul, whose gradient is a matmul too: no scatters, which are slow on
    XLA:CPU. Fine for the small models a CPU trains."""
    m, d = xs_MxD.shape
    g = weights[0].shape[0]
    # Rows per block: about a group's average rows (up to 512), a power of two. Fewer, larger matmuls beat
    # the padding they cost (a group wastes up to block - 1 rows): 0.29 s/step for mixtral-tiny at 8 x 256
    # tokens against 0.37 with blocks of 128 and 0.51 with 64.
    block = max(64, min(512, 2 ** int(math.log2(max(m // g, 1)))))
    source_R, block_group_N, padded_M, in_group_M = _block_layout(group_sizes_G, m, block)
    padded_M = jnp.where(in_group_M, padded_M, source_R.shape[0])  # rows past the groups: none
    pick_NxG = jax.nn.one_hot(block_group_N, g, dtype=weights[0].dtype)

    def matmul(x_NxBxD, i):
        w_NxDxF = jnp.einsum("ng,gdf->ndf", pick_NxG, weights[i])
        return jnp.einsum("nbd,ndf->nbf", x_NxBxD, w_NxDxF)
    yp_NxBxF = body(permute_rows(xs_MxD, source_R, padded_M).reshape(-1, block, d), matmul)
    return permute_rows(yp_NxBxF.reshape(source_R.shape[0], -1), padded_M, source_R)


# ---------------------------------------------------------------------------------------------
# What the MoE layers record, for the loss, the metrics and the balancing bias


def collect(intermediates, name: str):
    """The recorded `name` of every MoE layer, in layer order, stacked: [moe layers, ...]; None if none."""
    found = []
    for path, value in traverse_util.flatten_dict(intermediates).items():
        if path[-1] == name:  # scanned stacks carry a leading layers axis; unrolled layers are one each
            index = stacks_lib.unrolled_index(path[0])
            found.append((-1, value[0]) if index is None else (index, value[0][None]))
    return jnp.concatenate([v for _, v in sorted(found, key=lambda item: item[0])]) if found else None


def update_router_bias(params, intermediates, rate: float):
    """DeepSeek-V3: each layer's bias moves by `rate` up for experts below the mean load, down above it."""
    flat = traverse_util.flatten_dict(params)
    for path, value in traverse_util.flatten_dict(intermediates).items():
        if path[-1] == "expert_load":
            load = value[0]
            bias = path[:-1] + ("router_bias",)
            flat[bias] = flat[bias] + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return traverse_util.unflatten_dict(flat)
