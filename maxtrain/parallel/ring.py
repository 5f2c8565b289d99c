"""Ring attention, context parallelism's second strategy (context_parallel_strategy=ring): each device
keeps its queries and its own block of keys and values; the blocks travel round the ring of the devices
that split the sequence, one ppermute a step, and each device folds every block that reaches it into its
queries' outputs by the online softmax (a running log-sum-exp). A device holds two blocks of keys and
values at a time (its own, the one in flight), where the all-gather strategy holds the whole sequence's.

The backward pass is a second trip round the ring: the blocks travel again with their keys' and values'
gradients beside them, each device adding its queries' share, and a last step takes the gradients home
(flash attention's backward per block, as in Liu et al.'s Ring Attention).

Within a step a block is taken CHUNK queries against CHUNK keys at a time (loops), so no score tensor is
larger than [B, H, CHUNK, CHUNK], and a chunk the mask hides wholly (above the causal diagonal, beyond a
window, in documents of other ids) is skipped. Masks compare positions, which travel with their block, so the
load-balanced layout (zigzag) needs nothing of its own and gives every device the same work to skip.

Called inside the shard_map of maxtrain.parallel.context, which knows the mesh; this module knows only
the ring's axis names and size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from maxtrain.ops.attention import Variant, document_mask, masked_scores

CHUNK = 512  # queries (and keys) per chunk of a step: [B, H, 512, 512] float32 scores at most


def ring_attention(q_BxQxHxK, k_BxCxNxK, v_BxCxNxJ, segment_ids_BxQ, positions_BxQ, sinks_H, axes, shards: int,
                   variant: Variant):
    """One device's part: its queries [B,Q,H,K] against every device's keys and values, this device's
    block being k [B,C,N,K] / v [B,C,N,J] with the same segment ids and positions as its queries (C = Q).
    Returns [B,Q,H,J]."""
    b, length, h, k = q_BxQxHxK.shape
    n = k_BxCxNxK.shape[2]
    q_BxNxGxQxK = q_BxQxHxK.reshape(b, length, n, h // n, k).transpose(0, 2, 3, 1, 4)
    k_BxNxCxK, v_BxNxCxJ = k_BxCxNxK.transpose(0, 2, 1, 3), v_BxCxNxJ.transpose(0, 2, 1, 3)
    sinks_NxG = None if sinks_H is None else sinks_H.reshape(n, h // n)
    out_BxNxGxQxJ = _ring(q_BxNxGxQxK, k_BxNxCxK, v_BxNxCxJ, segment_ids_BxQ, positions_BxQ, sinks_NxG,
                          Ring(axes, shards, variant))
    return out_BxNxGxQxJ.transpose(0, 3, 1, 2, 4).reshape(b, length, h, v_BxCxNxJ.shape[-1])


@dataclasses.dataclass(frozen=True)
class Ring:
    """What a ring knows besides its arrays (custom_vjp's static argument): the mesh axes its devices
    span, how many devices, and the attention's variant."""
    axes: str | tuple[str, ...]
    shards: int
    variant: Variant

    def pass_on(self, tree):
        """Every array of `tree` to the next device of the ring."""
        return jax.lax.ppermute(tree, self.axes, [(j, (j + 1) % self.shards) for j in range(self.shards)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring(q_BxNxGxQxK, k_BxNxCxK, v_BxNxCxJ, segment_ids_BxQ, positions_BxQ, sinks_NxG, ring: Ring):
    return _ring_fwd(q_BxNxGxQxK, k_BxNxCxK, v_BxNxCxJ, segment_ids_BxQ, positions_BxQ, sinks_NxG, ring)[0]


def _ring_fwd(q_BxNxGxQxK, k_BxNxCxK, v_BxNxCxJ, segment_ids_BxQ, positions_BxQ, sinks_NxG, ring: Ring):
    queries = _chunked((q_BxNxGxQxK, segment_ids_BxQ, positions_BxQ), (3, 1, 1))
    out = jnp.zeros((*queries[0].shape[:-1], v_BxNxCxJ.shape[-1]), jnp.float32)  # [chunks, B, N, G, chunk, J]
    log_z = jnp.full(out.shape[:-1], -jnp.inf, jnp.float32)
    block = (k_BxNxCxK, v_BxNxCxJ, segment_ids_BxQ, positions_BxQ)
    for step in range(ring.shards):  # unrolled: XLA overlaps each ppermute with the step before it
        if step:
            block = ring.pass_on(block)
        out, log_z = _fold(queries, out, log_z, block, ring.variant)
    if sinks_NxG is not None:  # a sink joins each softmax's denominator and adds no value
        with_sink = jnp.logaddexp(log_z, sinks_NxG.astype(jnp.float32)[None, None, :, :, None])
        out, log_z = out * jnp.exp(log_z - with_sink)[..., None], with_sink
    out_BxNxGxQxJ = _unchunked(out, 3).astype(v_BxNxCxJ.dtype)
    return out_BxNxGxQxJ, (q_BxNxGxQxK, k_BxNxCxK, v_BxNxCxJ, segment_ids_BxQ, positions_BxQ, sinks_NxG,
                           out_BxNxGxQxJ, _unchunked(log_z, 3))


def _ring_bwd(ring: Ring, residuals, d_out_BxNxGxQxJ):
    (q_BxNxGxQxK, k_BxNxCxK, v_BxNxCxJ, segment_ids_BxQ, positions_BxQ, sinks_NxG, out_BxNxGxQxJ,
     log_z_BxNxGxQ) = residuals
    rowsum_BxNxGxQ = jnp.sum(d_out_BxNxGxQxJ.astype(jnp.float32) * out_BxNxGxQxJ.astype(jnp.float32), axis=-1)
    queries = _chunked((q_BxNxGxQxK, segment_ids_BxQ, positions_BxQ, d_out_BxNxGxQxJ, log_z_BxNxGxQ,
                        rowsum_BxNxGxQ), (3, 1, 1, 3, 3, 3))
    d_q = jnp.zeros(queries[0].shape, jnp.float32)
    block = (k_BxNxCxK, v_BxNxCxJ, segment_ids_BxQ, positions_BxQ)
    d_block = (jnp.zeros(k_BxNxCxK.shape, jnp.float32), jnp.zeros(v_BxNxCxJ.shape, jnp.float32))
    for step in range(ring.shards):
        if step:
            block, d_block = ring.pass_on((block, d_block))
        d_q, d_block = _unfold(queries, d_q, block, d_block, ring.variant)
    d_k, d_v = ring.pass_on(d_block)  # each block's gradients, one device short of home: the last step
    d_sinks = None
    if sinks_NxG is not None:  # a sink is a key with no value: its logit's gradient is -p(sink) x rowsum
        p_sink_BxNxGxQ = jnp.exp(sinks_NxG.astype(jnp.float32)[None, :, :, None] - log_z_BxNxGxQ)
        d_sinks = -jnp.sum(p_sink_BxNxGxQ * rowsum_BxNxGxQ, axis=(0, 3)).astype(sinks_NxG.dtype)
    return (_unchunked(d_q, 3).astype(q_BxNxGxQxK.dtype), d_k.astype(k_BxNxCxK.dtype), d_v.astype(v_BxNxCxJ.dtype),
            None, None, d_sinks)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _fold(queries, out, log_z, block, variant: Variant):
    """Every query chunk's running (output, log-sum-exp) with the block's keys and values folded in."""
    keys = _chunked(block, (2, 2, 1, 1))

    def per_query_chunk(args):
        q_BxNxGxQxK, segment_ids_BxQ, positions_BxQ, out_BxNxGxQxJ, log_z_BxNxGxQ = args

        def fold(key_chunk, carry):
            k_BxNxMxK, v_BxNxMxJ, segment_ids_BxM, positions_BxM = key_chunk
            out_BxNxGxQxJ, log_z_BxNxGxQ = carry
            mask_Bx1xQxM = document_mask(positions_BxQ, positions_BxM, segment_ids_BxQ, segment_ids_BxM,
                                         variant.window)
            scores_BxNxGxQxM, _ = masked_scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM, variant)
            new_log_z = jnp.logaddexp(log_z_BxNxGxQ, jax.nn.logsumexp(scores_BxNxGxQxM, axis=-1))
            probs_BxNxGxQxM = jnp.exp(scores_BxNxGxQxM - new_log_z[..., None]).astype(v_BxNxMxJ.dtype)
            added = jnp.einsum("bngqm,bnmj->bngqj", probs_BxNxGxQxM, v_BxNxMxJ, preferred_element_type=jnp.float32)
            return out_BxNxGxQxJ * jnp.exp(log_z_BxNxGxQ - new_log_z)[..., None] + added, new_log_z
        return _over_seen_chunks(keys, (segment_ids_BxQ, positions_BxQ), variant, fold, (out_BxNxGxQxJ, log_z_BxNxGxQ))
    return jax.lax.map(per_query_chunk, (*queries, out, log_z))


def _unfold(queries, d_q, block, d_block, variant: Variant):
    """The block's share of every query chunk's gradient (added to d_q) and of the block's keys' and
    values' gradients (added to d_block), from the forward's final log-sum-exp: flash attention's backward."""
    keys = _chunked(block, (2, 2, 1, 1))
    scale = variant.scale_for(queries[0].shape[-1])

    def per_query_chunk(d_keys, args):
        (q_BxNxGxQxK, segment_ids_BxQ, positions_BxQ, d_out_BxNxGxQxJ, log_z_BxNxGxQ, rowsum_BxNxGxQ,
         d_q_BxNxGxQxK) = args

        def unfold(key_chunk, carry, index):
            k_BxNxMxK, v_BxNxMxJ, segment_ids_BxM, positions_BxM = key_chunk
            d_q_BxNxGxQxK, d_keys = carry
            mask_Bx1xQxM = document_mask(positions_BxQ, positions_BxM, segment_ids_BxQ, segment_ids_BxM,
                                         variant.window)
            scores_BxNxGxQxM, tanh = masked_scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM, variant)
            probs_BxNxGxQxM = jnp.exp(scores_BxNxGxQxM - log_z_BxNxGxQ[..., None])
            d_v_BxNxMxJ = jnp.einsum("bngqm,bngqj->bnmj", probs_BxNxGxQxM.astype(v_BxNxMxJ.dtype), d_out_BxNxGxQxJ,
                                     preferred_element_type=jnp.float32)
            d_probs = jnp.einsum("bngqj,bnmj->bngqm", d_out_BxNxGxQxJ, v_BxNxMxJ, preferred_element_type=jnp.float32)
            d_scores_BxNxGxQxM = probs_BxNxGxQxM * (d_probs - rowsum_BxNxGxQ[..., None])
            if variant.softcap:  # d(cap x tanh(s / cap)) / ds
                d_scores_BxNxGxQxM = d_scores_BxNxGxQxM * (1 - tanh * tanh)
            d_scores_BxNxGxQxM = (d_scores_BxNxGxQxM * scale).astype(q_BxNxGxQxK.dtype)
            d_q_BxNxGxQxK = d_q_BxNxGxQxK + jnp.einsum("bngqm,bnmk->bngqk", d_scores_BxNxGxQxM, k_BxNxMxK,
                                                       preferred_element_type=jnp.float32)
            d_k_BxNxMxK = jnp.einsum("bngqm,bngqk->bnmk", d_scores_BxNxGxQxM, q_BxNxGxQxK,
                                     preferred_element_type=jnp.float32)
            d_keys = tuple(d.at[index].add(added) for d, added in zip(d_keys, (d_k_BxNxMxK, d_v_BxNxMxJ)))
            return d_q_BxNxGxQxK, d_keys
        d_q_BxNxGxQxK, d_keys = _over_seen_chunks(keys, (segment_ids_BxQ, positions_BxQ), variant, unfold,
                                                  (d_q_BxNxGxQxK, d_keys), with_index=True)
        return d_keys, d_q_BxNxGxQxK
    d_keys, d_q = jax.lax.scan(per_query_chunk, _chunked(d_block, (2, 2)), (*queries, d_q))
    return d_q, tuple(_unchunked(x, 2) for x in d_keys)


def _over_seen_chunks(keys, query_tokens, variant: Variant, fn, carry, with_index: bool = False):
    """carry through fn(key chunk, carry[, its index]) for the key chunks some query of the chunk may see,
    in order, skipping the rest (a loop whose length is the count of those: no work for a hidden chunk).
    Whether a chunk may be seen is judged from ranges (positions, segment ids) over the batch, which
    never skips a chunk with a visible pair; the mask inside fn decides each pair.

    A loop of a traced length, not a cond per chunk: under a scan over layers, JAX kept each cond's
    operands as if for differentiation (the [chunks, chunks, B, H, CHUNK, CHUNK] scores, 8 GiB a step
    for llama3-8b at 32,768 tokens), though the ring's gradient is its own."""
    segment_ids_BxQ, positions_BxQ = query_tokens
    segment_ids_KxBxM, positions_KxBxM = keys[2], keys[3]
    lowest = lambda x: x.min(axis=(1, 2))  # noqa: E731  per key chunk, over the batch
    highest = lambda x: x.max(axis=(1, 2))  # noqa: E731
    seen_K = ((lowest(positions_KxBxM) <= positions_BxQ.max()) & (lowest(segment_ids_KxBxM) <= segment_ids_BxQ.max())
              & (highest(segment_ids_KxBxM) >= segment_ids_BxQ.min()))
    if variant.window:
        seen_K &= highest(positions_KxBxM) > positions_BxQ.min() - variant.window
    order_K = jnp.argsort(~seen_K, stable=True)  # the seen chunks first, in order

    def body(i, carry):
        index = order_K[i]
        chunk = tuple(x[index] for x in keys)
        return fn(chunk, carry, index) if with_index else fn(chunk, carry)
    return jax.lax.fori_loop(0, seen_K.sum(), body, carry)


def _chunked(arrays, axes):
    """Each array with its `axes` entry (a sequence axis) cut into chunks of at most CHUNK, the chunks
    first: [..., L, ...] -> [L / chunk, ..., chunk, ...]."""
    def cut(x, axis):
        length = x.shape[axis]
        size = max(d for d in range(1, min(CHUNK, length) + 1) if length % d == 0)
        x = x.reshape(*x.shape[:axis], length // size, size, *x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)
    return tuple(cut(x, axis) for x, axis in zip(arrays, axes))


def _unchunked(x, axis: int):
    """_chunked's inverse for one array: [chunks, ..., chunk, ...] -> [..., L, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])
