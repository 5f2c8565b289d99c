"""Attention kernels behind `attention=`: all take q [B,L,H,K], k/v [B,L,N,K] (GQA: N divides H) and
segment ids [B,L], apply causal + same-document masking, and return [B,L,H,K]. Without a window the
values' width may differ from the queries' and keys' (MLA: [B,L,N,J] values give [B,L,H,J]).

- dot_product: plain XLA einsums, softmax in float32; materializes the [B,H,L,L] scores.
- blockwise: the same einsums a block of BLOCK queries at a time, each block against only the keys up
  to its own end, so the masked-out upper triangle is never computed: with L = 2 blocks, 3/4 of the
  scores' work and memory; with 4, 10/16 (any L: the last block may be shorter). The default. With a
  sliding window (window_blocks) each block sees only the blocks its window reaches: the cost grows
  with the window, not the sequence.
- jax_nn: jax.nn.dot_product_attention (cuDNN flash attention on GPU where it applies, XLA elsewhere).
- splash: the Pallas splash-attention kernel (TPU): blockwise, never materializes the scores. On other
  backends it runs in Pallas interpret mode, which is for tests only.

Decoding (maxtrain.infer) prefills through these and then attends one position at a time against the
KV cache with `against_cache`, a plain dot product over every slot of the cache.

None of them knows the mesh: splash run per shard and context parallelism (every kernel but splash gives
way to it when the `length` axis is split) are in maxtrain.parallel.context; the plan chooses.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.ops import window_attention


# blockwise's queries per block. On CPU 256 and 128 run alike at L = 512 and 64 is slower; fewer blocks
# compile faster. At L <= 256 blockwise is dot_product exactly.
BLOCK = 256


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a family changes in softmax attention; every kernel honours each (or the plan refuses it)."""
    window: int = 0             # a query sees the keys at distance < window (itself included); 0 = all before it
    scale: float | None = None  # the scores' scale; None = head_dim ** -0.5
    softcap: float = 0.0        # scores -> softcap x tanh(scores / softcap) before the mask; 0 = none
    # The window is a chunk (Llama 4): a query at position p sees the keys in [window x floor(p / window), p],
    # a subset of its window. The kernels keep the window's key ranges and see the chunks as documents
    # (chunk_segments, applied by maxtrain.parallel.plan.Plan.attend); a KV cache masks by position.
    chunked: bool = False

    def scale_for(self, head_dim: int) -> float:
        return head_dim ** -0.5 if self.scale is None else self.scale


PLAIN = Variant()


def chunk_segments(segment_ids_BxL, positions_BxL, chunk: int):
    """Segment ids under which each document's chunks of `chunk` positions are documents of their own.
    Two chunks' parity tells them apart: a window of `chunk` never reaches further than the next one."""
    return segment_ids_BxL * 2 + (positions_BxL // chunk) % 2


def causal_document_mask(segment_ids_BxL, start: int = 0, stop: int | None = None, key_start: int = 0,
                         window: int = 0):
    """[B, 1, Q, M] boolean for queries start..stop-1 against keys key_start..stop-1 (default: all
    [B,1,L,L]): causal, within the window, and a token sees only its own document (segment)."""
    stop = segment_ids_BxL.shape[1] if stop is None else stop
    return document_mask(jnp.arange(start, stop)[None], jnp.arange(key_start, stop)[None],
                         segment_ids_BxL[:, start:stop], segment_ids_BxL[:, key_start:stop], window)


def document_mask(positions_BxQ, positions_BxM, segment_ids_BxQ, segment_ids_BxM, window: int = 0):
    """[B, 1, Q, M]: a query sees the keys at or before its position (and, with a window, at distance <
    window), in its own document."""
    distance_BxQxM = positions_BxQ[:, :, None] - positions_BxM[:, None, :]
    seen = (distance_BxQxM >= 0) & (segment_ids_BxQ[:, :, None] == segment_ids_BxM[:, None, :])
    if window:
        seen = seen & (distance_BxQxM < window)
    return seen[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM, sinks_NxG, scale: float, softcap: float):
    """Softmax attention of Q queries over M keys, scores and softmax in float32 (head-major layouts);
    `sinks_NxG` (or None): a logit per head that joins each softmax's denominator and no value.

    Its gradient is flash attention's: the probabilities recomputed from q, k and the saved log-sum-exp,
    and the softmax's backward through rowsum(d_out * out) rather than a sum over the [Q, M] scores.
    Autodiff's form fused that sum with the [Q, M] matmul into one XLA:CPU fusion that took a quarter of
    a context-parallel step."""
    return _attend_fwd(q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM, sinks_NxG, scale, softcap)[0]


def _scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM, scale, softcap):
    """(masked scores, tanh of the capped ones or None) in float32."""
    scores_BxNxGxQxM = jnp.einsum("bngqk,bnmk->bngqm", q_BxNxGxQxK, k_BxNxMxK,
                                  preferred_element_type=jnp.float32) * scale
    tanh = None
    if softcap:
        tanh = jnp.tanh(scores_BxNxGxQxM / softcap)
        scores_BxNxGxQxM = softcap * tanh
    return jnp.where(mask_Bx1xQxM[:, :, None], scores_BxNxGxQxM, -1e30), tanh


def masked_scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM, variant: Variant):
    """The variant's scores of Q queries against M keys, float32, -1e30 where the mask hides a key; and
    tanh of the capped scores (or None), for the soft cap's gradient."""
    return _scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM, variant.scale_for(q_BxNxGxQxK.shape[-1]), variant.softcap)


def _log_z(scores_BxNxGxQxM, sinks_NxG):
    log_z_BxNxGxQ = jax.nn.logsumexp(scores_BxNxGxQxM, axis=-1)
    if sinks_NxG is None:
        return log_z_BxNxGxQ
    return jnp.logaddexp(log_z_BxNxGxQ, sinks_NxG.astype(jnp.float32)[None, :, :, None])


def _attend_fwd(q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM, sinks_NxG, scale, softcap):
    scores_BxNxGxQxM, _ = _scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM, scale, softcap)
    log_z_BxNxGxQ = _log_z(scores_BxNxGxQxM, sinks_NxG)
    probs_BxNxGxQxM = jnp.exp(scores_BxNxGxQxM - log_z_BxNxGxQ[..., None]).astype(v_BxNxMxK.dtype)
    out_BxNxGxQxK = jnp.einsum("bngqm,bnmk->bngqk", probs_BxNxGxQxM, v_BxNxMxK)
    return out_BxNxGxQxK, (q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM, sinks_NxG, out_BxNxGxQxK,
                           log_z_BxNxGxQ)


def _attend_bwd(scale, softcap, residuals, d_out_BxNxGxQxK):
    q_BxNxGxQxK, k_BxNxMxK, v_BxNxMxK, mask_Bx1xQxM, sinks_NxG, out_BxNxGxQxK, log_z_BxNxGxQ = residuals
    scores_BxNxGxQxM, tanh = _scores(q_BxNxGxQxK, k_BxNxMxK, mask_Bx1xQxM, scale, softcap)
    probs_BxNxGxQxM = jnp.exp(scores_BxNxGxQxM - log_z_BxNxGxQ[..., None])
    d_v_BxNxMxK = jnp.einsum("bngqm,bngqk->bnmk", probs_BxNxGxQxM.astype(v_BxNxMxK.dtype), d_out_BxNxGxQxK)
    d_probs_BxNxGxQxM = jnp.einsum("bngqk,bnmk->bngqm", d_out_BxNxGxQxK, v_BxNxMxK, preferred_element_type=jnp.float32)
    rowsum_BxNxGxQ = jnp.sum(d_out_BxNxGxQxK.astype(jnp.float32) * out_BxNxGxQxK.astype(jnp.float32), axis=-1)
    d_scores_BxNxGxQxM = probs_BxNxGxQxM * (d_probs_BxNxGxQxM - rowsum_BxNxGxQ[..., None])
    if softcap:  # d(cap x tanh(s / cap)) / ds
        d_scores_BxNxGxQxM = d_scores_BxNxGxQxM * (1 - tanh * tanh)
    d_scores_BxNxGxQxM = (d_scores_BxNxGxQxM * scale).astype(q_BxNxGxQxK.dtype)
    d_q_BxNxGxQxK = jnp.einsum("bngqm,bnmk->bngqk", d_scores_BxNxGxQxM, k_BxNxMxK)
    d_k_BxNxMxK = jnp.einsum("bngqm,bngqk->bnmk", d_scores_BxNxGxQxM, q_BxNxGxQxK)
    d_sinks_NxG = None
    if sinks_NxG is not None:  # a sink is a key with no value: its logit's gradient is -p(sink) x rowsum
        p_sink_BxNxGxQ = jnp.exp(sinks_NxG.astype(jnp.float32)[None, :, :, None] - log_z_BxNxGxQ)
        d_sinks_NxG = -jnp.sum(p_sink_BxNxGxQ * rowsum_BxNxGxQ, axis=(0, 3)).astype(sinks_NxG.dtype)
    return d_q_BxNxGxQxK, d_k_BxNxMxK, d_v_BxNxMxK, None, d_sinks_NxG


_attend.defvjp(_attend_fwd, _attend_bwd)


def dot_product(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, variant: Variant = PLAIN, sinks_H=None):
    return _query_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, q_BxLxHxK.shape[1], variant, sinks_H)


def blockwise(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, variant: Variant = PLAIN, sinks_H=None):
    block, length = window_block(variant.window, q_BxLxHxK.dtype), q_BxLxHxK.shape[1]
    if variant.window and variant.window < length and block < length:
        # float32 on CPU: one wide matmul per block against its stacked keys is faster; bfloat16: the
        # banded form, which never copies the keys (benchmarks/window.py)
        windowed = window_blocks if q_BxLxHxK.dtype == jnp.float32 else window_attention.banded_blocks
        return windowed(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, block, variant, sinks_H)
    return _query_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, block, variant, sinks_H)


def window_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, block: int, variant: Variant, sinks_H=None):
    """Sliding-window attention `block` queries at a time, every block at once: block c's queries against
    the keys of blocks c - p .. c, p = ceil((window - 1) / block), each block's keys stacked beside its
    queries (the batch folds in the blocks). One batched computation, so the keys' gradient is p + 1
    shifted sums, not a sum over the sequence per block as slices of one array would give (which cost
    as much as the attention itself in bfloat16 on CPU)."""
    b, length, h, k = q_BxLxHxK.shape
    n, g, w = k_BxLxNxK.shape[2], h // k_BxLxNxK.shape[2], variant.window
    p = -(-(w - 1) // block)
    c = -(-length // block)
    tail = c * block - length  # the sequence padded to whole blocks; p blocks of keys before it
    pad = lambda x, before, value=0: jnp.pad(x, [(0, 0), (before, tail)] + [(0, 0)] * (x.ndim - 2),  # noqa: E731
                                             constant_values=value)
    stacked = lambda x: jnp.concatenate(  # noqa: E731  [B, C + p, block, ...] -> [B, C, (p + 1) x block, ...]
        [x[:, j:j + c] for j in range(p + 1)], axis=2)
    q_BxCxNxGxQxK = pad(q_BxLxHxK, 0).reshape(b, c, block, n, g, k).transpose(0, 1, 3, 4, 2, 5)
    kv = [stacked(pad(x, p * block).reshape(b, c + p, block, n, k)).transpose(0, 1, 3, 2, 4)
          for x in (k_BxLxNxK, v_BxLxNxK)]  # [B, C, N, M, K]
    segment_ids_BxCxM = stacked(pad(segment_ids_BxL, p * block, -1).reshape(b, c + p, block))
    positions_CxM = stacked(jnp.arange(-p * block, c * block).reshape(1, c + p, block))[0]
    every_row = lambda x: jnp.tile(x, (b, 1))  # noqa: E731  [C, ...] -> [B x C, ...]
    seen_BxCxQxM = document_mask(every_row(jnp.arange(c * block).reshape(c, block)), every_row(positions_CxM),
                                 pad(segment_ids_BxL, 0, -1).reshape(b * c, block),
                                 segment_ids_BxCxM.reshape(b * c, -1), w)[:, 0].reshape(b, c, block, -1)
    seen_BxCxQxM = seen_BxCxQxM & (positions_CxM >= 0)[None, :, None]
    fold = lambda x: x.reshape(b * c, *x.shape[2:])  # noqa: E731
    sinks_NxG = None if sinks_H is None else sinks_H.reshape(n, g)
    out = _attend(fold(q_BxCxNxGxQxK), fold(kv[0]), fold(kv[1]), fold(seen_BxCxQxM)[:, None], sinks_NxG,
                  variant.scale_for(k), variant.softcap)
    out_BxCxQxNxGxK = out.reshape(b, c, n, g, block, k).transpose(0, 1, 4, 2, 3, 5)
    return out_BxCxQxNxGxK.reshape(b, c * block, h, k)[:, :length]


def window_block(window: int, dtype=jnp.float32) -> int:
    """blockwise's queries per block: BLOCK, or with a window a quarter of it (at least 64; bfloat16's
    banded form: 128 from windows of 256). A block of Q queries sees about Q + window keys, so smaller
    blocks waste less on the window's edges, and larger ones run larger matmuls (benchmarks/window.py)."""
    if not window:
        return BLOCK
    if jnp.dtype(dtype) != jnp.float32:
        return 128 if window >= 256 else 64
    return min(BLOCK, max(64, window // 4))


def _query_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, block: int, variant: Variant, sinks_H):
    """`block` queries at a time, each block against the keys from its window's start (0 without one) up
    to its own end (block >= L: all at once)."""
    length, w = q_BxLxHxK.shape[1], variant.window
    blocks = []
    for start in range(0, length, block):  # unrolled: each block sees a different range of keys
        stop = min(start + block, length)
        key_start = max(0, start - w + 1) if w else 0
        blocks.append((start, stop, key_start, causal_document_mask(segment_ids_BxL, start, stop, key_start, w)))
    return attend_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, blocks, variant, sinks_H)


def attend_blocks(q_BxLxHxK, k_BxMxNxK, v_BxMxNxK, blocks, variant: Variant = PLAIN, sinks_H=None):
    """Each (start, stop, key_start, mask [B,1,Q,keys]) of `blocks`: queries start..stop-1 against keys
    key_start .. key_start + keys - 1.

    q, k and v go head-major once, up front, so each einsum is a plain batched matmul over contiguous
    [L, K] rows: on CPU a faster forward than einsums on [B,L,H,K], with the same bits."""
    b, length, h, k = q_BxLxHxK.shape
    n = k_BxMxNxK.shape[2]
    q_BxNxGxLxK = q_BxLxHxK.reshape(b, length, n, h // n, k).transpose(0, 2, 3, 1, 4)
    k_BxNxMxK, v_BxNxMxK = k_BxMxNxK.transpose(0, 2, 1, 3), v_BxMxNxK.transpose(0, 2, 1, 3)
    sinks_NxG = None if sinks_H is None else sinks_H.reshape(n, h // n)
    scale = variant.scale_for(k)
    ctx = [_attend(q_BxNxGxLxK[:, :, :, start:stop], k_BxNxMxK[:, :, key_start:key_start + mask.shape[-1]],
                   v_BxNxMxK[:, :, key_start:key_start + mask.shape[-1]], mask, sinks_NxG, scale, variant.softcap)
           for start, stop, key_start, mask in blocks]
    ctx_BxNxGxLxJ = jnp.concatenate(ctx, axis=3)
    return ctx_BxNxGxLxJ.transpose(0, 3, 1, 2, 4).reshape(b, length, h, v_BxMxNxK.shape[-1])


def against_cache(q_BxLxHxK, keys_RxSxK, values_RxSxK, mask_BxLxS, variant: Variant = PLAIN, sinks_H=None):
    """Queries [B,L,H,K] against a KV cache whose R = B x N rows are (sequence, kv head) pairs, each of
    S slots (maxtrain.infer.kv_cache); mask [B,L,S]: the slots each query sees. Every slot is scored, so
    one compiled program serves every position; scores and softmax in float32, as in training. Plain
    dot_generals, not einsums: Qwix quantizes a module's einsums, and attention's stay unquantized."""
    b, length, h, k = q_BxLxHxK.shape
    r, s, _ = keys_RxSxK.shape
    n = r // b
    q_RxQxK = q_BxLxHxK.reshape(b, length, n, h // n, k).transpose(0, 2, 3, 1, 4).reshape(r, -1, k)  # Q = G x L
    scores_RxQxS = jax.lax.dot_general(q_RxQxK, keys_RxSxK, (((2,), (2,)), ((0,), (0,))),  # rqk,rsk->rqs
                                       preferred_element_type=jnp.float32) * variant.scale_for(k)
    if variant.softcap:
        scores_RxQxS = variant.softcap * jnp.tanh(scores_RxQxS / variant.softcap)
    scores_BxNxGxLxS = scores_RxQxS.reshape(b, n, h // n, length, s)
    scores_BxNxGxLxS = jnp.where(mask_BxLxS[:, None, None], scores_BxNxGxLxS, -1e30)
    sinks_NxG = None if sinks_H is None else sinks_H.reshape(n, h // n).astype(jnp.float32)
    log_z_BxNxGxL = _log_z(scores_BxNxGxLxS, sinks_NxG)
    probs_BxNxGxLxS = jnp.exp(scores_BxNxGxLxS - log_z_BxNxGxL[..., None])
    probs_RxQxS = probs_BxNxGxLxS.astype(values_RxSxK.dtype).reshape(r, -1, s)
    out_RxQxK = jax.lax.dot_general(probs_RxQxS, values_RxSxK, (((2,), (1,)), ((0,), (0,))))  # rqs,rsk->rqk
    return out_RxQxK.reshape(b, n, h // n, length, k).transpose(0, 3, 1, 2, 4).reshape(b, length, h, k)


def against_latent_cache(q_latent_BxLxHxC, q_rope_BxLxHxR, latents_BxSxC, rope_keys_BxSxR, mask_BxLxS, scale: float):
    """Multi-head latent attention against its KV cache (maxtrain.models.mla): each head's score of slot
    s is its latent query against the slot's latent plus its rotary query against the slot's rotary key,
    and its output the probabilities' sum over the slots' latents [B,L,H,C]: one latent row per sequence
    serves every head. float32 scores and softmax, plain dot_generals, as against_cache."""
    b, length, h, c = q_latent_BxLxHxC.shape
    contract = (((2,), (2,)), ((0,), (0,)))  # bqc,bsc->bqs over Q = L x H
    rows = lambda x: x.reshape(b, length * h, x.shape[-1])  # noqa: E731
    scores_BxQxS = (jax.lax.dot_general(rows(q_latent_BxLxHxC), latents_BxSxC, contract,
                                        preferred_element_type=jnp.float32)
                    + jax.lax.dot_general(rows(q_rope_BxLxHxR), rope_keys_BxSxR, contract,
                                          preferred_element_type=jnp.float32)) * scale
    scores_BxLxHxS = jnp.where(mask_BxLxS[:, :, None], scores_BxQxS.reshape(b, length, h, -1), -1e30)
    probs_BxQxS = jax.nn.softmax(scores_BxLxHxS, axis=-1).astype(latents_BxSxC.dtype).reshape(b, length * h, -1)
    out_BxQxC = jax.lax.dot_general(probs_BxQxS, latents_BxSxC, (((2,), (1,)), ((0,), (0,))))  # bqs,bsc->bqc
    return out_BxQxC.reshape(b, length, h, c)


def jax_nn(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, variant: Variant = PLAIN, sinks_H=None):
    """jax.nn.dot_product_attention; soft caps and sinks, which it lacks, go the dot_product way."""
    if variant.softcap or sinks_H is not None:
        return dot_product(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, variant, sinks_H)
    k, j = q_BxLxHxK.shape[-1], v_BxLxNxK.shape[-1]
    if j < k:  # it takes values as wide as the keys: MLA's narrower ones padded with zeros, the padding cut
        v_BxLxNxK = jnp.pad(v_BxLxNxK, [(0, 0)] * 3 + [(0, k - j)])
    out = jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, scale=variant.scale_for(k),
                                       mask=causal_document_mask(segment_ids_BxL, window=variant.window))
    return out[..., :j]


def splash_kernel(places, residual_name, heads: int, q_shards: int = 1, interpret: bool = False,
                  variant: Variant = PLAIN, library: str = "jax"):
    """Splash for queries at `places` of the sequence (len(places) of them) against the whole sequence's
    keys in order, causal (and within variant.window); q_shards > 1: the queries split into that many
    contiguous shards over devices, each against all the keys (context parallelism). `interpret`: Pallas'
    interpreter, off TPU (tests). The caller scales q (splash does not). `library`: jax (JAX's Pallas
    ops, attention=splash) or tokamax (Tokamax's fork of them, attention=tokamax_splash: one mask for
    every head, its options in a SplashConfig)."""
    splash, masks = _splash_modules(library)
    length = len(places)
    per_shard = length // q_shards
    block = next((b for b in (512, 256, 128) if per_shard % b == 0), per_shard)  # tests: any small size
    sizes = dict(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
                 block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = _placed_causal_mask_type(library)((length, length), places, variant.window)
    if library == "tokamax":
        config = splash.SplashConfig(**sizes, residual_checkpoint_name=residual_name, interpret=interpret,
                                     attn_logits_soft_cap=variant.softcap or None)
        return splash.make_splash_mha(mask, config=config, q_seq_shards=q_shards)
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * heads), block_sizes=splash.BlockSizes(**sizes), head_shards=1,
        q_seq_shards=q_shards, residual_checkpoint_name=residual_name, interpret=interpret,
        attn_logits_soft_cap=variant.softcap or None)


def _splash_modules(library: str):
    """(the kernel module, the mask module) of a library's splash; imported on first use: importing
    Pallas would slow every start."""
    if library == "tokamax":
        from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
        from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as masks
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    return splash, masks


@functools.cache
def _placed_causal_mask_type(library: str = "jax"):
    """Built on first use, as splash is imported (_splash_modules)."""
    masks = _splash_modules(library)[1]

    class PlacedCausalMask(masks.CausalMask):
        """Causal (and with a window, distance < window), for queries at the given places of the sequence
        (q_sequence: the kernel computes the mask from it on the chip, by mask_function). Blocks wholly
        inside or outside the mask are answered without comparing each pair: building the block map for
        131,072 tokens took a minute that way."""

        def __init__(self, shape, places, window: int = 0):
            super().__init__(shape)
            self.q_sequence = np.asarray(places, np.int32)
            self.window = window
            if window:
                self.mask_function = lambda q, kv: (q >= kv) & (q - kv < window)

        def __getitem__(self, idx):
            rows, cols = idx
            places = self.q_sequence[rows]
            start, stop = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
            w = self.window or self.shape[1] + 1
            if places.max() < start or places.min() - (stop - 1) >= w:  # all after, or all beyond the window
                return np.zeros((len(places), stop - start), bool)
            if places.min() >= stop - 1 and places.max() - start < w:
                return np.ones((len(places), stop - start), bool)
            distance = places[:, None] - np.arange(start, stop)[None, :]
            return (distance >= 0) & (distance < w)

        def __eq__(self, other):
            return super().__eq__(other) and self.window == other.window

        def __hash__(self):
            return hash((super().__hash__(), self.window))

    return PlacedCausalMask


def run_splash(kernel, q_BxHxQxK, k_BxNxLxK, v_BxNxLxK, segment_ids_BxQ, segment_ids_BxL=None, sinks_H=None,
               library: str = "jax"):
    """The kernel over the batch; `sinks_H` (float32, one per query head, or None) join each softmax's
    denominator (the kernel's own support: the sink starts the running max and sum)."""
    splash = _splash_modules(library)[0]
    segment_ids_BxL = segment_ids_BxQ if segment_ids_BxL is None else segment_ids_BxL
    segment_ids = splash.SegmentIds(q=segment_ids_BxQ, kv=segment_ids_BxL)
    if sinks_H is None:
        return jax.vmap(kernel)(q_BxHxQxK, k_BxNxLxK, v_BxNxLxK, segment_ids=segment_ids)
    return jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(q_BxHxQxK, k_BxNxLxK, v_BxNxLxK, segment_ids,
                                                         sinks_H.astype(jnp.float32))


def unzigzag(x, axis: int, shards: int):
    """An array laid out in zigzag_order along `axis`, in sequence order: its 2 x shards chunks reordered."""
    chunks = jnp.split(x, 2 * shards, axis=axis)
    return jnp.concatenate([chunks[i] for i in np.argsort(zigzag_order(2 * shards, shards))], axis=axis)


# The splash kernels, by attention= value: the library each comes from (both run per shard).
SPLASH = {"splash": "jax", "tokamax_splash": "tokamax"}

# The kernels that run whole on each device (splash runs per shard: maxtrain.parallel.context).
KERNELS = {"dot_product": dot_product, "blockwise": blockwise, "jax_nn": jax_nn}


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """Places of the load-balanced layout: the sequence cut into 2 x shards chunks, shard i holding
    chunks i and 2 x shards - 1 - i, so every shard has the same number of causal query-key pairs."""
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])
