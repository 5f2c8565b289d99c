"""Sliding-window attention in blocks, bfloat16's: blockwise's kernel where a window is shorter than the
sequence and q is not float32 (maxtrain.ops.attention.blockwise; benchmarks/window.py has the figures).

The sequence is cut into C blocks of Q queries; block c's queries see the keys of blocks c - p .. c
(p = ceil((window - 1) / Q)), and nothing else is computed, so the cost grows with the window, not the
sequence. The keys are never copied per block: they are padded with p empty blocks in front, and shift j
(0..p) takes the blocks j .. j + C - 1 of that array, one batched matmul per shift over every block at
once; the softmax runs across the shifts' scores. The gradient is flash attention's, as the other
kernels' (maxtrain.ops.attention._attend): probabilities recomputed from the saved log-sum-exp.

Layouts are head-major with the blocks beside the batch: q [B, N, C, G, Q, K], keys and values
[B, N, C + p, Q, K], masks [B, C, Q, Q] per shift. Shape suffixes as in maxtrain.ops.attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def banded_blocks(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, block: int, variant, sinks_H=None):
    """Causal attention within variant.window (and the documents), `block` queries per block."""
    b, length, h, k = q_BxLxHxK.shape
    n, w = k_BxLxNxK.shape[2], variant.window
    g, p, c = h // n, -(-(w - 1) // block), -(-length // block)
    tail = c * block - length  # the sequence padded to whole blocks

    def pad(x, before, value=0):
        return jnp.pad(x, [(0, 0), (before, tail)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

    q6 = pad(q_BxLxHxK, 0).reshape(b, c, block, n, g, k).transpose(0, 3, 1, 4, 2, 5)  # [B, N, C, G, Q, K]
    k5, v5 = (pad(x, p * block).reshape(b, c + p, block, n, k).transpose(0, 3, 1, 2, 4) for x in (k_BxLxNxK, v_BxLxNxK))
    segment_q_BxCxQ = pad(segment_ids_BxL, 0, -1).reshape(b, c, block)
    segment_k_BxCxQ = pad(segment_ids_BxL, p * block, -2).reshape(b, c + p, block)  # -2: the front padding
    masks = tuple(_shift_mask(segment_q_BxCxQ, segment_k_BxCxQ[:, j:j + c], (p - j) * block, w) for j in range(p + 1))
    sinks_NxG = None if sinks_H is None else sinks_H.reshape(n, g)
    out6 = _banded(q6, k5, v5, masks, sinks_NxG, variant.scale_for(k), variant.softcap)
    return out6.transpose(0, 2, 4, 1, 3, 5).reshape(b, c * block, h, k)[:, :length]


def _shift_mask(segment_q_BxCxQ, segment_k_BxCxQ, offset: int, window: int):
    """[B, C, Q, Q]: query q of a block sees key m of the block `offset` positions before it."""
    q = segment_q_BxCxQ.shape[-1]
    distance_QxQ = offset + np.arange(q)[:, None] - np.arange(q)[None, :]
    in_window_QxQ = jnp.asarray((distance_QxQ >= 0) & (distance_QxQ < window))
    return in_window_QxQ & (segment_q_BxCxQ[..., :, None] == segment_k_BxCxQ[..., None, :])


def _shifted(x5, j: int, c: int):
    return x5[:, :, j:j + c]  # [B, N, C, Q, K]: block c + j - p of the sequence beside query block c


def _scores(q6, k5, masks, scale, softcap):
    """Each shift's masked float32 scores [B, N, C, G, Q, Q], and the tanh of the capped ones (or None)."""
    c = q6.shape[2]
    scores, tanhs = [], []
    for j, mask in enumerate(masks):
        s = jnp.einsum("bncgqk,bncmk->bncgqm", q6, _shifted(k5, j, c), preferred_element_type=jnp.float32) * scale
        t = None
        if softcap:
            t = jnp.tanh(s / softcap)
            s = softcap * t
        scores.append(jnp.where(mask[:, None, :, None], s, -1e30))
        tanhs.append(t)
    return scores, tanhs


def _log_z(scores, sinks_NxG):
    top = functools.reduce(jnp.maximum, [s.max(axis=-1) for s in scores])
    sink = None if sinks_NxG is None else sinks_NxG.astype(jnp.float32)[None, :, None, :, None]
    if sink is not None:
        top = jnp.maximum(top, sink)
    total = sum(jnp.exp(s - top[..., None]).sum(axis=-1) for s in scores)
    if sink is not None:
        total = total + jnp.exp(sink - top)
    return top + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _banded(q6, k5, v5, masks, sinks_NxG, scale: float, softcap: float):
    return _banded_fwd(q6, k5, v5, masks, sinks_NxG, scale, softcap)[0]


def _banded_fwd(q6, k5, v5, masks, sinks_NxG, scale, softcap):
    c = q6.shape[2]
    scores, _ = _scores(q6, k5, masks, scale, softcap)
    log_z = _log_z(scores, sinks_NxG)
    out6 = sum(jnp.einsum("bncgqm,bncmk->bncgqk", jnp.exp(s - log_z[..., None]).astype(v5.dtype),
                          _shifted(v5, j, c)) for j, s in enumerate(scores))
    out6 = out6.astype(q6.dtype)
    return out6, (q6, k5, v5, masks, sinks_NxG, out6, log_z)


def _banded_bwd(scale, softcap, residuals, d_out6):
    q6, k5, v5, masks, sinks_NxG, out6, log_z = residuals
    c, p = q6.shape[2], len(masks) - 1
    scores, tanhs = _scores(q6, k5, masks, scale, softcap)
    rowsum = jnp.sum(d_out6.astype(jnp.float32) * out6.astype(jnp.float32), axis=-1)
    d_q6 = jnp.zeros(q6.shape, jnp.float32)
    d_k5, d_v5 = jnp.zeros(k5.shape, jnp.float32), jnp.zeros(v5.shape, jnp.float32)
    for j, (s, t) in enumerate(zip(scores, tanhs)):
        probs = jnp.exp(s - log_z[..., None])
        v_j, k_j = _shifted(v5, j, c), _shifted(k5, j, c)
        d_v_j = jnp.einsum("bncgqm,bncgqk->bncmk", probs.astype(v5.dtype), d_out6, preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("bncgqk,bncmk->bncgqm", d_out6, v_j, preferred_element_type=jnp.float32)
        d_s = probs * (d_probs - rowsum[..., None])
        if softcap:
            d_s = d_s * (1 - t * t)
        d_s = (d_s * scale).astype(q6.dtype)
        d_q6 = d_q6 + jnp.einsum("bncgqm,bncmk->bncgqk", d_s, k_j, preferred_element_type=jnp.float32)
        d_k_j = jnp.einsum("bncgqm,bncgqk->bncmk", d_s, q6, preferred_element_type=jnp.float32)
        place = [(0, 0), (0, 0), (j, p - j), (0, 0), (0, 0)]  # back to blocks j .. j + C - 1
        d_k5, d_v5 = d_k5 + jnp.pad(d_k_j, place), d_v5 + jnp.pad(d_v_j, place)
    d_sinks = None
    if sinks_NxG is not None:  # a sink is a key with no value: its logit's gradient is -p(sink) x rowsum
        p_sink = jnp.exp(sinks_NxG.astype(jnp.float32)[None, :, None, :, None] - log_z)
        d_sinks = -jnp.sum(p_sink * rowsum, axis=(0, 2, 4)).astype(sinks_NxG.dtype)
    return (d_q6.astype(q6.dtype), d_k5.astype(k5.dtype), d_v5.astype(v5.dtype), tuple(None for _ in masks),
            d_sinks)


_banded.defvjp(_banded_fwd, _banded_bwd)

