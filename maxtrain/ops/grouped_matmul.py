"""Grouped matmul: rows sorted by group, row i times its group's matrix; rows past the groups give 0. And
the sort and permutation that put rows in group order (their gradients are gathers: XLA:CPU's scatters
are slow). Mesh-free: maxtrain.parallel.experts runs them on each device's share.

Shape suffixes: M rows, D in, F out, G groups, A assignments.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import jax
import jax.numpy as jnp


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


MEGABLOX_INTERPRET = False  # tests run the TPU kernel in Pallas' interpreter on CPU


def row_bias(bias_GxF, group_sizes_G, rows: int, dtype):
    """[rows, F]: each row's group's bias, for rows sorted by group; zero for rows past the groups (so a
    grouped matmul plus its bias still gives 0 there). A one-hot matmul: its gradient is a matmul too."""
    g = group_sizes_G.shape[0]
    group_M = jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(rows), side="right")  # g: past the groups
    return jax.nn.one_hot(group_M, g, dtype=dtype) @ bias_GxF.astype(dtype)


def plus_row_bias(y_MxF, bias_GxF, group_sizes_G):
    """y plus each row's group's bias (rows sorted by group); y itself where there is no bias."""
    return y_MxF if bias_GxF is None else y_MxF + row_bias(bias_GxF, group_sizes_G, y_MxF.shape[0], y_MxF.dtype)


def grouped_matmul(x_MxD, w_GxDxF, group_sizes_G, method: str, bias_GxF=None, platform: str = "cpu"):
    """x times its group's w (plus its group's bias, if any). `tokamax`: Tokamax's ragged_dot (its Pallas
    kernels on the devices of `platform`, tokamax_swiglu). `megablox`: JAX's Pallas grouped-matmul
    kernels for TPU (gmm, and tgmm for the weight gradient).
    `ragged_dot`: XLA's grouped matmul (GPU); XLA:TPU forms its weight gradient through a [groups, rows,
    width] mask (gigabytes a layer at Mixtral's size) and XLA:CPU expands it into a dense matmul per group
    (G times the work), so on CPU `blocked` walks blocks of rows, one group each."""
    if method == "ragged_dot":
        y_MxF = jax.lax.ragged_dot(x_MxD, w_GxDxF, group_sizes_G)
        return plus_row_bias(y_MxF, bias_GxF, group_sizes_G)
    return grouped_swiglu(method, platform)(x_MxD, group_sizes_G, (w_GxDxF,), lambda x, matmul: matmul(x, 0),
                                            (bias_GxF,))


def grouped_swiglu(method: str, platform: str):
    """The function that runs `body(x, matmul)` on rows sorted by group, `matmul(x, i)` multiplying by
    weights[i] (tokamax_swiglu, megablox_swiglu or blocked_swiglu's signature)."""
    if method == "tokamax":
        return functools.partial(tokamax_swiglu, platform=platform)
    return megablox_swiglu if method == "megablox" else blocked_swiglu


# Tokamax's ragged_dot for the platform the step is traced for: its Pallas kernels on TPU and GPU, XLA's
# ragged_dot elsewhere (which it equals exactly on CPU). Not its TPU grouped matmul v2: for Mixtral 8x7B's
# down projection (k 14,336) on v5p, Tokamax 0.0.17 tiles the whole k (tk 14336) and Mosaic refuses the
# kernel (60 MiB of scoped VMEM over a 57.6 MiB limit).
TOKAMAX_IMPLEMENTATION = {"tpu": "mosaic_tpu", "gpu": "mosaic_gpu"}


def tokamax_swiglu(xs_MxD, group_sizes_G, weights, body, biases=(), *, platform: str):
    """`body(x, matmul)` with Tokamax's ragged_dot for the devices of `platform`: rows past the groups
    selected away at the two ends of `body` only, as megablox_swiglu (its TPU kernels leave them unwritten,
    and a select after each matmul kept a second copy of each output alive at the peak: gpt-oss-120b on
    v5p-128, fsdp 64, 1.26 GiB a chip)."""
    tokamax = _tokamax()
    # Tokamax takes the first implementation that does not refuse the shapes: its TPU kernel wants widths
    # of at least 128, and a narrower (test-sized) model gets XLA's
    kernel = TOKAMAX_IMPLEMENTATION.get(platform)
    implementation = (kernel, "xla") if kernel else "xla"
    in_group_Mx1 = (jnp.arange(xs_MxD.shape[0]) < jnp.sum(group_sizes_G))[:, None]

    def matmul(x_MxK, i):
        y_MxN = tokamax.ragged_dot(x_MxK, weights[i], group_sizes_G, implementation=implementation)
        return plus_row_bias(y_MxN, biases[i] if i < len(biases) else None, group_sizes_G)
    return jnp.where(in_group_Mx1, body(jnp.where(in_group_Mx1, xs_MxD, 0), matmul), 0)


def cross_compiling(method: str):
    """A context for tracing a step for another platform's devices (an ahead-of-time compile for TPU from
    a CPU process): Tokamax then does not check this machine's devices, here and in the gradient's
    kernels, which are traced later, outside tokamax_swiglu."""
    if method != "tokamax":
        return contextlib.nullcontext()
    return _tokamax().config.cross_compile(True)


class _NoCacheMiss(logging.Filter):
    """Tokamax warns, for each ragged_dot it traces, that it has no autotuned config for the shapes (~1 kB
    each, 18 for an MoE step) and takes its heuristic one: expected without an autotuning cache, and they
    buried an AOT compile's fits line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Autotuning cache miss")


def _tokamax():
    """tokamax, imported on first use (it imports Pallas, which slows every start), its cache misses quiet."""
    import tokamax
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _NoCacheMiss) for f in absl.filters):
        absl.addFilter(_NoCacheMiss())
    return tokamax


def megablox_swiglu(xs_MxD, group_sizes_G, weights, body, biases=()):
    """`body(x, matmul)` on the rows padded to whole tiles, `matmul(x, i)` JAX's Pallas gmm with weights[i]
    (tgmm for its gradient), plus each row's group's biases[i] where there is one. The kernels leave rows
    past the groups unwritten, in the output and in x's gradient, and tgmm reads only rows inside groups;
    rows never mix between the matmuls. So selecting those rows away at the two ends of `body` keeps them
    out of every result and gradient (a select, not a product: whatever they hold never reaches a
    gradient). A select after each matmul kept a second copy of each [rows, expert width] output alive at
    the step's peak."""
    from jax.experimental.pallas.ops.tpu.megablox import ops  # TPU only (or interpreted)

    m = xs_MxD.shape[0]
    tm = min(512, -(-m // 8) * 8)  # rows per tile: the kernel needs whole tiles of rows
    padded = -(-m // tm) * tm
    in_group_Px1 = (jnp.arange(padded) < jnp.sum(group_sizes_G))[:, None]
    x_PxD = jnp.where(in_group_Px1, jnp.pad(xs_MxD, ((0, padded - m), (0, 0))), 0)

    def matmul(x_PxK, i):
        k, n = weights[i].shape[1:]
        y_PxN = ops.gmm(x_PxK, weights[i], group_sizes_G, x_PxK.dtype, (tm, min(1024, k), min(1024, n)), None,
                        None, False, MEGABLOX_INTERPRET)
        return plus_row_bias(y_PxN, biases[i] if i < len(biases) else None, group_sizes_G)
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


def blocked_swiglu(xs_MxD, group_sizes_G, weights, body, biases=()):
    """`body(x, matmul)` on rows padded into blocks, one group each: `matmul(x, i)` multiplies
    every block by its group's copy of weights[i] in one batched matmul (adding its copy of biases[i],
    where there is one). The rows are padded once and
    unpadded once around the whole body (permutations as gathers in both directions), and each block's
    matrix is picked by a one-hot matmul, whose gradient is a matmul too: no scatters, which are slow on
    XLA:CPU. Fine for the small models a CPU trains."""
    m, d = xs_MxD.shape
    g = weights[0].shape[0]
    # Rows per block: about a group's average rows (up to 512), a power of two. Fewer, larger matmuls beat
    # the padding they cost (a group wastes up to block - 1 rows).
    block = max(64, min(512, 2 ** int(math.log2(max(m // g, 1)))))
    source_R, block_group_N, padded_M, in_group_M = _block_layout(group_sizes_G, m, block)
    padded_M = jnp.where(in_group_M, padded_M, source_R.shape[0])  # rows past the groups: none
    pick_NxG = jax.nn.one_hot(block_group_N, g, dtype=weights[0].dtype)

    def matmul(x_NxBxD, i):
        w_NxDxF = jnp.einsum("ng,gdf->ndf", pick_NxG, weights[i])
        y_NxBxF = jnp.einsum("nbd,ndf->nbf", x_NxBxD, w_NxDxF)
        b = biases[i] if i < len(biases) else None
        return y_NxBxF if b is None else y_NxBxF + (pick_NxG @ b.astype(pick_NxG.dtype))[:, None, :]
    yp_NxBxF = body(permute_rows(xs_MxD, source_R, padded_M).reshape(-1, block, d), matmul)
    return permute_rows(yp_NxBxF.reshape(source_R.shape[0], -1), padded_M, source_R)
