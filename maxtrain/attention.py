"""Attention kernels behind `attention=`: all take q [B,L,H,K], k/v [B,L,N,K] (GQA: N divides H) and
segment ids [B,L], apply causal + same-document masking, and return [B,L,H,K].

- dot_product: plain XLA einsums, softmax in float32; materializes the [B,H,L,L] scores.
- blockwise: the same einsums a block of BLOCK queries at a time, each block against only the keys up
  to its own end, so the masked-out upper triangle is never computed: with L = 2 blocks, 3/4 of the
  scores' work and memory; with 4, 10/16 (any L: the last block may be shorter). The default.
- jax_nn: jax.nn.dot_product_attention (cuDNN flash attention on GPU where it applies, XLA elsewhere).
- splash: the Pallas splash-attention kernel (TPU): blockwise, never materializes the scores. On other
  backends it runs in Pallas interpret mode, which is for tests only.

Under context parallelism (the `context` mesh axis splits `length`) every kernel but splash gives way to
`context_parallel`: all-gathered keys and values, a mask from positions.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec


# blockwise's queries per block. On CPU 256 and 128 run alike at L = 512 and 64 is slower; fewer blocks
# compile faster. At L <= 256 blockwise is dot_product exactly.
BLOCK = 256


def causal_document_mask(segment_ids_BxL, start: int = 0, stop: int | None = None):
    """[B, 1, Q, M] boolean for queries start..stop-1 against keys 0..stop-1 (default: all [B,1,L,L]):
    causal, and a token sees only its own document (segment)."""
    stop = segment_ids_BxL.shape[1] if stop is None else stop
    return document_mask(jnp.arange(start, stop)[None], jnp.arange(stop)[None], segment_ids_BxL[:, start:stop],
                         segment_ids_BxL[:, :stop])


def document_mask(positions_BxQ, positions_BxM, segment_ids_BxQ, segment_ids_BxM):
    """[B, 1, Q, M]: a query sees the keys at or before its position, in its own document."""
    return ((positions_BxQ[:, :, None] >= positions_BxM[:, None, :])
            & (segment_ids_BxQ[:, :, None] == segment_ids_BxM[:, None, :]))[:, None]


def _attend(q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM):
    """Softmax attention of Q queries over M keys, scores and softmax in float32 (head-major layouts)."""
    scores_BxNxGxQxM = jnp.einsum("bngqk,bnmk->bngqm", q_BxNxGxQxK, k_BxNxMxK,
                                  preferred_element_type=jnp.float32) * q_BxNxGxQxK.shape[-1] ** -0.5
    scores_BxNxGxQxM = jnp.where(mask_Bx1xQxM[:, :, None], scores_BxNxGxQxM, -1e30)
    probs_BxNxGxQxM = jax.nn.softmax(scores_BxNxGxQxM, axis=-1).astype(v_BxNxMxK.dtype)
    return jnp.einsum("bngqm,bnmk->bngqk", probs_BxNxGxQxM, v_BxNxMxK)


def dot_product(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL):
    return _query_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, q_BxLxHxK.shape[1])


def blockwise(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL):
    return _query_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, BLOCK)


def _query_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, block: int):
    """`block` queries at a time, each block against the keys up to its own end (block >= L: all at once)."""
    length = q_BxLxHxK.shape[1]
    return _attend_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, [  # unrolled: each block sees a different number of keys
        (start, min(start + block, length), causal_document_mask(segment_ids_BxL, start, min(start + block, length)))
        for start in range(0, length, block)])


def _attend_blocks(q_BxLxHxK, k_BxMxNxK, v_BxMxNxK, blocks):
    """Each (start, stop, mask [B,1,Q,keys]) of `blocks`: queries start..stop-1 against the first `keys` keys.

    q, k and v go head-major once, up front, so each einsum is a plain batched matmul over contiguous
    [L, K] rows. On CPU that made the attention's forward ~1.3x faster than einsums on [B,L,H,K], with
    the same bits."""
    b, length, h, k = q_BxLxHxK.shape
    n = k_BxMxNxK.shape[2]
    q_BxNxGxLxK = q_BxLxHxK.reshape(b, length, n, h // n, k).transpose(0, 2, 3, 1, 4)
    k_BxNxMxK, v_BxNxMxK = k_BxMxNxK.transpose(0, 2, 1, 3), v_BxMxNxK.transpose(0, 2, 1, 3)
    ctx = [_attend(q_BxNxGxLxK[:, :, :, start:stop], k_BxNxMxK[:, :, :mask.shape[-1]], v_BxNxMxK[:, :, :mask.shape[-1]],
                   mask) for start, stop, mask in blocks]
    ctx_BxNxGxLxK = jnp.concatenate(ctx, axis=3)
    return ctx_BxNxGxLxK.transpose(0, 3, 1, 2, 4).reshape(b, length, h, k)


def jax_nn(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL):
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK,
                                        mask=causal_document_mask(segment_ids_BxL))


def _splash_local(q_BxHxLxK, k_BxNxLxK, v_BxNxLxK, segment_ids_BxL, residual_name):
    """Splash on the arrays one device holds (heads and batch already split by shard_map)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    _, h, length, k = q_BxHxLxK.shape
    block = min(512, length)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                              block_kv_dq=block)
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(h)]), block_sizes=sizes,
        head_shards=1, q_seq_shards=1, residual_checkpoint_name=residual_name,
        interpret=jax.devices()[0].platform != "tpu")
    segments = splash.SegmentIds(q=segment_ids_BxL, kv=segment_ids_BxL)
    return jax.vmap(kernel)(q_BxHxLxK * k ** -0.5, k_BxNxLxK, v_BxNxLxK, segment_ids=segments)


def splash(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, residual_name=None):
    to_heads_major = lambda x: x.swapaxes(1, 2)  # noqa: E731  [B,L,H,K] -> [B,H,L,K]
    args = (to_heads_major(q_BxLxHxK), to_heads_major(k_BxLxNxK), to_heads_major(v_BxLxNxK), segment_ids_BxL)
    local = lambda q, k, v, s: _splash_local(q, k, v, s, residual_name)  # noqa: E731
    mesh = jax.sharding.get_abstract_mesh()
    specs = None
    if not mesh.empty and nn.get_logical_axis_rules():
        specs = [PartitionSpec(*nn.logical_to_mesh_axes(axes)) for axes in (
            ("batch", "heads", "length", "head_dim"), ("batch", "kv_heads", "length", "head_dim"),
            ("batch", "kv_heads", "length", "head_dim"), ("batch", "length"))]
        if not all(_divides(spec, x.shape, mesh) for spec, x in zip(specs, args)):
            specs = None  # e.g. the batch-of-1 trace at init, whose attention output is never used
    if specs is None:
        return to_heads_major(local(*args))
    # A Pallas kernel is not partitioned by XLA: run it on each shard (batch and heads split).
    out_BxHxLxK = jax.shard_map(local, in_specs=tuple(specs), out_specs=specs[0], check_vma=False)(*args)
    return to_heads_major(out_BxHxLxK)


def _divides(spec: PartitionSpec, shape, mesh) -> bool:
    for dim, axes in zip(shape, spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        size = 1
        for a in axes:
            size *= mesh.shape[a]
        if dim % size:
            return False
    return True


KERNELS = {"dot_product": dot_product, "blockwise": blockwise, "jax_nn": jax_nn, "splash": splash}


# ---------------------------------------------------------------------------------------------
# Context parallelism: the sequence's positions split over devices (the `length` logical axis)


def length_shards() -> int:
    """How many devices split an activation's `length` under the active mesh and rules."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not nn.get_logical_axis_rules():
        return 1
    axes = nn.logical_to_mesh_axes(("length",))[0]
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))


def context_parallel(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL):
    """Each device keeps its queries and gathers the whole sequence's keys and values (the all-gather
    strategy of MaxText and torchtitan), under shard_map: the attention itself is a device's local
    computation, as without context parallelism. The causal mask compares positions, not places, so a
    reordered sequence (zigzag_order) attends exactly as the original. (Left to GSPMD, XLA:CPU ran the
    partitioned softmax's gradient several times slower.)"""
    q_spec, kv_spec, tokens = (PartitionSpec(*nn.logical_to_mesh_axes(axes)) for axes in (
        ("batch", "length", "heads", "head_dim"), ("batch", "length", "kv_heads", "head_dim"), ("batch", "length")))
    specs = (q_spec, kv_spec, kv_spec, tokens, tokens)
    args = (q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL)
    if not all(_divides(s, x.shape, jax.sharding.get_abstract_mesh()) for s, x in zip(specs, args)):
        # the batch-of-1 trace at init, whose attention output is never used
        return _attend_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, [(0, q_BxLxHxK.shape[1], document_mask(
            positions_BxL, positions_BxL, segment_ids_BxL, segment_ids_BxL))])

    def local(q_BxQxHxK, k_BxCxNxK, v_BxCxNxK, segment_ids_BxQ, positions_BxQ):
        gather = lambda x: jax.lax.all_gather(x, tokens[1], axis=1, tiled=True)  # noqa: E731
        mask_Bx1xQxM = document_mask(positions_BxQ, gather(positions_BxQ), segment_ids_BxQ, gather(segment_ids_BxQ))
        return _attend_blocks(q_BxQxHxK, gather(k_BxCxNxK), gather(v_BxCxNxK),
                              [(0, q_BxQxHxK.shape[1], mask_Bx1xQxM)])
    return jax.shard_map(local, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """Places of the load-balanced layout: the sequence cut into 2 x shards chunks, shard i holding
    chunks i and 2 x shards - 1 - i, so every shard has the same number of causal query-key pairs."""
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])
