"""Cross-entropy from the final hidden state, a chunk of positions at a time, with its backward pass
written out; and the same from whole logits through autodiff, the reference tests compare it with.

Both return (summed masked cross-entropy, summed log(Z)^2), sums rather than means so micro-batches
add up exactly; the train step divides by the token count.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxtrain.model import output_logits


def cross_entropy_sums_from_logits(logits_BxLxV, targets_BxL, weights_BxL):
    """The sums from float32 logits (autodiff differentiates this: the reference)."""
    log_z_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_logit_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return jnp.sum((log_z_BxL - target_logit_BxL) * weights_BxL), jnp.sum(jnp.square(log_z_BxL) * weights_BxL)


def cross_entropy_sums(x_BxLxD, out_DxV, targets_BxL, weights_BxL, chunk: int, dot_in_fp32: bool):
    """The sums, forming logits for `chunk` positions at a time (chunk = L: all at once) from the final
    hidden state x and the output matrix (in its stored dtype, e.g. float32; the matmuls run in x's
    dtype).

    The backward pass is written out: per chunk it recomputes the logits, forms their gradient
    (softmax - one-hot) in one pass, and adds that chunk's output-matrix gradient to an accumulator
    kept in the matrix's own sharding and dtype. So with chunk < L neither the [B,L,V] logits nor a
    whole [D,V] float32 gradient ever exists, and with fsdp each chunk's gradient is reduce-scattered
    as it is made. Even with one chunk it beats autodiff's backward (no scatter for the target logits,
    fewer passes over the logits): faster steps on CPU, see benchmarks/compare.py.
    """
    return _chunked(chunk, dot_in_fp32, x_BxLxD, out_DxV, targets_BxL, weights_BxL)


def _split(x_BxL, chunk):
    """[B, L, ...] -> [L/chunk, B, chunk, ...], the chunks a scan walks through."""
    b, length = x_BxL.shape[:2]
    return x_BxL.reshape(b, length // chunk, chunk, *x_BxL.shape[2:]).swapaxes(0, 1)


def _merge(x_NxBxC):
    n, b, chunk = x_NxBxC.shape[:3]
    return x_NxBxC.swapaxes(0, 1).reshape(b, n * chunk, *x_NxBxC.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked(chunk, dot_in_fp32, x_BxLxD, out_DxV, targets_BxL, weights_BxL):
    return _chunked_fwd(chunk, dot_in_fp32, x_BxLxD, out_DxV, targets_BxL, weights_BxL)[0]


def _chunked_fwd(chunk, dot_in_fp32, x_BxLxD, out_DxV, targets_BxL, weights_BxL):
    w_DxV = out_DxV.astype(x_BxLxD.dtype)

    def body(sums, xs):
        x_BxCxD, targets_BxC, weights_BxC = xs
        logits_BxCxV = output_logits(x_BxCxD, w_DxV, dot_in_fp32)
        logits_BxCxV = nn.with_logical_constraint(logits_BxCxV, ("batch", "length", "vocab"))
        log_z_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
        target_logit_BxC = jnp.take_along_axis(logits_BxCxV, targets_BxC[..., None], axis=-1)[..., 0]
        ce = jnp.sum((log_z_BxC - target_logit_BxC) * weights_BxC)
        z = jnp.sum(jnp.square(log_z_BxC) * weights_BxC)
        return (sums[0] + ce, sums[1] + z), log_z_BxC

    chunks = (_split(x_BxLxD, chunk), _split(targets_BxL, chunk), _split(weights_BxL, chunk))
    sums, log_z_NxBxC = jax.lax.scan(body, (jnp.zeros(()), jnp.zeros(())), chunks)
    return sums, (x_BxLxD, out_DxV, targets_BxL, weights_BxL, log_z_NxBxC)


def _chunked_bwd(chunk, dot_in_fp32, residuals, cotangents):
    x_BxLxD, out_DxV, targets_BxL, weights_BxL, log_z_NxBxC = residuals
    d_ce, d_z = cotangents
    w_DxV = out_DxV.astype(x_BxLxD.dtype)
    vocab = out_DxV.shape[1]

    def body(d_out_DxV, xs):
        x_BxCxD, targets_BxC, weights_BxC, log_z_BxC = xs
        logits_BxCxV = output_logits(x_BxCxD, w_DxV, dot_in_fp32)
        probs_BxCxV = jnp.exp(logits_BxCxV - log_z_BxC[..., None])
        # d/dlogits of weights * (d_ce * (log_z - logit[target]) + d_z * log_z^2)
        d_log_z_BxC = weights_BxC * (d_ce + 2.0 * d_z * log_z_BxC)
        is_target_BxCxV = jnp.arange(vocab) == targets_BxC[..., None]
        d_logits_BxCxV = (probs_BxCxV * d_log_z_BxC[..., None]
                          - jnp.where(is_target_BxCxV, (weights_BxC * d_ce)[..., None], 0.0))
        d_logits_BxCxV = d_logits_BxCxV.astype(x_BxLxD.dtype)
        d_x_BxCxD = jnp.einsum("bcv,dv->bcd", d_logits_BxCxV, w_DxV)
        d_w_DxV = jnp.einsum("bcd,bcv->dv", x_BxCxD, d_logits_BxCxV)
        d_w_DxV = nn.with_logical_constraint(d_w_DxV, ("embed", "vocab"))  # reduce-scatter now
        return d_out_DxV + d_w_DxV.astype(out_DxV.dtype), d_x_BxCxD

    chunks = (_split(x_BxLxD, chunk), _split(targets_BxL, chunk), _split(weights_BxL, chunk), log_z_NxBxC)
    zeros_DxV = nn.with_logical_constraint(jnp.zeros_like(out_DxV), ("embed", "vocab"))
    d_out_DxV, d_x_NxBxCxD = jax.lax.scan(body, zeros_DxV, chunks)
    return _merge(d_x_NxBxCxD), d_out_DxV, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
