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

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxtrain import mesh as mesh_lib


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


@jax.custom_vjp
def _attend(q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM):
    """Softmax attention of Q queries over M keys, scores and softmax in float32 (head-major layouts).

    Its gradient is flash attention's: the probabilities recomputed from q, k and the saved log-sum-exp,
    and the softmax's backward through rowsum(d_out * out) rather than a sum over the [Q, M] scores.
    Autodiff's form fused that sum with the [Q, M] matmul into one XLA:CPU fusion that took a quarter of
    a context-parallel step."""
    return _attend_fwd(q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM)[0]


def _scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM):
    scores_BxNxGxQxM = jnp.einsum("bngqk,bnmk->bngqm", q_BxNxGxQxK, k_BxNxMxK,
                                  preferred_element_type=jnp.float32) * q_BxNxGxQxK.shape[-1] ** -0.5
    return jnp.where(mask_Bx1xQxM[:, :, None], scores_BxNxGxQxM, -1e30)


def _attend_fwd(q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM):
    scores_BxNxGxQxM = _scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM)
    log_z_BxNxGxQ = jax.nn.logsumexp(scores_BxNxGxQxM, axis=-1)
    probs_BxNxGxQxM = jnp.exp(scores_BxNxGxQxM - log_z_BxNxGxQ[..., None]).astype(v_BxNxMxK.dtype)
    out_BxNxGxQxK = jnp.einsum("bngqm,bnmk->bngqk", probs_BxNxGxQxM, v_BxNxMxK)
    return out_BxNxGxQxK, (q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM, out_BxNxGxQxK, log_z_BxNxGxQ)


def _attend_bwd(residuals, d_out_BxNxGxQxK):
    q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM, out_BxNxGxQxK, log_z_BxNxGxQ = residuals
    probs_BxNxGxQxM = jnp.exp(_scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM) - log_z_BxNxGxQ[..., None])
    d_v_BxNxMxK = jnp.einsum("bngqm,bngqk->bnmk", probs_BxNxGxQxM.astype(v_BxNxMxK.dtype), d_out_BxNxGxQxK)
    d_probs_BxNxGxQxM = jnp.einsum("bngqk,bnmk->bngqm", d_out_BxNxGxQxK, v_BxNxMxK, preferred_element_type=jnp.float32)
    rowsum_BxNxGxQ = jnp.sum(d_out_BxNxGxQxK.astype(jnp.float32) * out_BxNxGxQxK.astype(jnp.float32), axis=-1)
    d_scores_BxNxGxQxM = (probs_BxNxGxQxM * (d_probs_BxNxGxQxM - rowsum_BxNxGxQ[..., None])
                          * q_BxNxGxQxK.shape[-1] ** -0.5).astype(q_BxNxGxQxK.dtype)
    d_q_BxNxGxQxK = jnp.einsum("bngqm,bnmk->bngqk", d_scores_BxNxGxQxM, k_BxNxMxK)
    d_k_BxNxMxK = jnp.einsum("bngqm,bngqk->bnmk", d_scores_BxNxGxQxM, q_BxNxGxQxK)
    return d_q_BxNxGxQxK, d_k_BxNxMxK, d_v_BxNxMxK, None


_attend.defvjp(_attend_fwd, _attend_bwd)


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


def _splash_kernel(places, residual_name, heads: int, q_shards: int = 1):
    """Splash for queries at `places` of the sequence (len(places) of them) against the whole sequence's
    keys in order, causal; q_shards > 1: the queries split into that many contiguous shards over devices,
    each against all the keys (context parallelism)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    length = len(places)
    per_shard = length // q_shards
    block = next((b for b in (512, 256, 128) if per_shard % b == 0), per_shard)  # tests: any small size
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                              block_kv_dq=block)
    mask = _placed_causal_mask_type()((length, length), places)
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=q_shards,
        residual_checkpoint_name=residual_name, interpret=_platform() != "tpu")


def _platform() -> str:
    """The platform the step is traced for: the mesh's devices (TPU ones under an ahead-of-time compile
    for a topology, from a CPU process), else this process's."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.devices()[0].platform if mesh.empty else mesh.abstract_device.platform


@functools.cache
def _placed_causal_mask_type():
    """Built on first use, as splash is imported: importing Pallas costs every start ~0.1 s."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    class PlacedCausalMask(masks.CausalMask):
        """Causal, for queries at the given places of the sequence (q_sequence: the kernel computes the
        mask from it on the chip). Blocks wholly above or below the diagonal are answered without
        comparing each pair: building the block map for 131,072 tokens took a minute that way."""

        def __init__(self, shape, places):
            super().__init__(shape)
            self.q_sequence = np.asarray(places, np.int32)

        def __getitem__(self, idx):
            rows, cols = idx
            places = self.q_sequence[rows]
            start, stop = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
            if places.min() >= stop - 1 or places.max() < start:
                return np.full((len(places), stop - start), places.min() >= stop - 1)
            return places[:, None] >= np.arange(start, stop)[None, :]

    return PlacedCausalMask


def splash(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, residual_name=None, balanced=False):
    """Under context parallelism each device runs the kernel for its queries against the whole
    sequence's keys and values, gathered and put back in sequence order (`balanced`: the batch is in
    zigzag_order, so each device's queries sit at those places)."""
    b, length, h, k = q_BxLxHxK.shape
    to_heads_major = lambda x: x.swapaxes(1, 2)  # noqa: E731  [B,L,H,K] <-> [B,H,L,K]
    args = (to_heads_major(q_BxLxHxK) * k ** -0.5, to_heads_major(k_BxLxNxK), to_heads_major(v_BxLxNxK),
            segment_ids_BxL)
    mesh = jax.sharding.get_abstract_mesh()
    specs = None
    if not mesh.empty and nn.get_logical_axis_rules():
        logical = (("batch", "heads", "length", "head_dim"), ("batch", "kv_heads", "length", "head_dim"),
                   ("batch", "kv_heads", "length", "head_dim"), ("batch", "length"))
        specs = [PartitionSpec(*nn.logical_to_mesh_axes(axes)) for axes in logical]
        if not all(mesh_lib.splits_evenly(axes, x.shape) for axes, x in zip(logical, args)):
            specs = None  # e.g. the batch-of-1 trace at init, whose attention output is never used
    shards = mesh_lib.length_shards() if specs else 1
    places = zigzag_order(length, shards) if balanced and shards > 1 else np.arange(length)
    kernel = _splash_kernel(places, residual_name, h, shards)
    if specs is None:
        return to_heads_major(_run_splash(kernel, *args))
    length_axes = specs[3][1]

    def local(kernel, q_BxHxQxK, k_BxNxCxK, v_BxNxCxK, segment_ids_BxQ):
        if shards == 1:
            return _run_splash(kernel, q_BxHxQxK, k_BxNxCxK, v_BxNxCxK, segment_ids_BxQ)
        gather = lambda x, axis: jax.lax.all_gather(x, length_axes, axis=axis, tiled=True)  # noqa: E731
        k_BxNxLxK, v_BxNxLxK, segment_ids_BxL = gather(k_BxNxCxK, 2), gather(v_BxNxCxK, 2), gather(segment_ids_BxQ, 1)
        if balanced:  # back to sequence order
            k_BxNxLxK, v_BxNxLxK = _unzigzag(k_BxNxLxK, 2, shards), _unzigzag(v_BxNxLxK, 2, shards)
            segment_ids_BxL = _unzigzag(segment_ids_BxL, 1, shards)
        return _run_splash(kernel, q_BxHxQxK, k_BxNxLxK, v_BxNxLxK, segment_ids_BxQ, segment_ids_BxL)

    # A Pallas kernel is not partitioned by XLA: run it on each shard (batch, heads and queries split);
    # the kernel's block map travels with it, each device taking its queries' rows.
    kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, PartitionSpec(None, length_axes)))
    out_BxHxLxK = jax.shard_map(local, in_specs=(kernel_spec, *specs), out_specs=specs[0],
                                check_vma=False)(kernel, *args)
    return to_heads_major(out_BxHxLxK)


def _run_splash(kernel, q_BxHxQxK, k_BxNxLxK, v_BxNxLxK, segment_ids_BxQ, segment_ids_BxL=None):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    segment_ids_BxL = segment_ids_BxQ if segment_ids_BxL is None else segment_ids_BxL
    return jax.vmap(kernel)(q_BxHxQxK, k_BxNxLxK, v_BxNxLxK,
                            segment_ids=splash.SegmentIds(q=segment_ids_BxQ, kv=segment_ids_BxL))


def _unzigzag(x, axis: int, shards: int):
    """An array laid out in zigzag_order along `axis`, in sequence order: its 2 x shards chunks reordered."""
    chunks = jnp.split(x, 2 * shards, axis=axis)
    return jnp.concatenate([chunks[i] for i in np.argsort(zigzag_order(2 * shards, shards))], axis=axis)


KERNELS = {"dot_product": dot_product, "blockwise": blockwise, "jax_nn": jax_nn, "splash": splash}


# ---------------------------------------------------------------------------------------------
# Context parallelism: the sequence's positions split over devices (the `length` logical axis)


def context_parallel(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL):
    """Each device keeps its queries and gathers the whole sequence's keys and values (the all-gather
    strategy of MaxText and torchtitan), under shard_map: the attention itself is a device's local
    computation, as without context parallelism. The causal mask compares positions, not places, so a
    reordered sequence (zigzag_order) attends exactly as the original. (Left to GSPMD, XLA:CPU ran the
    partitioned softmax's gradient several times slower.)"""
    kv_axes, token_axes = ("batch", "length", "kv_heads", "head_dim"), ("batch", "length")
    logical = (("batch", "length", "heads", "head_dim"), kv_axes, kv_axes, token_axes, token_axes)
    specs = tuple(PartitionSpec(*nn.logical_to_mesh_axes(axes)) for axes in logical)
    q_spec, tokens = specs[0], specs[3]
    args = (q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL)
    if not all(mesh_lib.splits_evenly(axes, x.shape) for axes, x in zip(logical, args)):
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
