"""Cross-entropy from the final hidden state, a chunk of positions at a time, with its gradient
written out; and the same from whole logits through autodiff, the reference tests compare it with.

Sums rather than means, so micro-batches add up exactly; the train step divides by the token count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtrain.models.decoder import mask_padding, output_logits
from maxtrain.parallel.chunks import merge_chunks, split_chunks
from maxtrain.parallel.rules import constrain


def cross_entropy_sums_from_logits(logits_BxLxV, targets_BxL, weights_BxL):
    """(summed cross-entropy, summed log(Z)^2) from float32 logits (autodiff through this: the reference)."""
    return _sums(logits_BxLxV, targets_BxL, weights_BxL)[1:]


def _sums(logits_BxLxV, targets_BxL, weights_BxL):
    """log Z, and the summed masked cross-entropy and log(Z)^2."""
    log_z_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_logit_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    ce = jnp.sum((log_z_BxL - target_logit_BxL) * weights_BxL)
    return log_z_BxL, ce, jnp.sum(jnp.square(log_z_BxL) * weights_BxL)


def cross_entropy_loss(x_BxLxD, out_DxV, targets_BxL, weights_BxL, chunk: int, dot_in_fp32: bool,
                       z_loss_multiplier: float = 0.0, vocab: int | None = None, softcap: float = 0.0):
    """(ce_sum + z_loss_multiplier * z_sum, ce_sum), forming logits for `chunk` positions at a time
    (chunk = L: all at once) from the final hidden state x and the output matrix (in its stored dtype,
    e.g. float32; the matmuls run in x's dtype). Only the first is differentiable. The output matrix's
    columns past `vocab` (default: none) are padding, masked out of the loss (model.mask_padding).

    Under differentiation the forward pass also forms the gradients (the cotangent that arrives in the
    backward pass is a scalar that only scales them): per chunk it turns the logits into their
    gradient (softmax minus one-hot) in one pass and multiplies it into x's gradient and the output
    matrix's. So the logits are never recomputed and no scatter picks the target logits (faster than
    autodiff), and with chunk < L neither the [B,L,V] float32 logits nor a whole [D,V] float32
    gradient ever exists: each chunk's output-matrix gradient joins an accumulator held in the
    matrix's own sharding and dtype, so under fsdp it is reduce-scattered as it is made. `softcap`: the
    logits are softcap x tanh(logits / softcap) (Gemma 2; decoder.output_logits).
    """
    vocab = out_DxV.shape[1] if vocab is None else vocab
    total, ce_sum = _fused((chunk, dot_in_fp32, z_loss_multiplier, vocab, softcap), x_BxLxD, out_DxV, targets_BxL,
                           weights_BxL)
    return total, jax.lax.stop_gradient(ce_sum)  # the backward ignores ce_sum's cotangent


def _chunk_sums(x_BxCxD, w_DxV, targets_BxC, weights_BxC, dot_in_fp32, vocab, softcap):
    """One chunk's float32 logits, log Z, and summed cross-entropy and log(Z)^2."""
    logits_BxCxV = mask_padding(output_logits(x_BxCxD, w_DxV, dot_in_fp32, softcap), vocab)
    logits_BxCxV = constrain(logits_BxCxV, ("batch", "length", "vocab"))
    return (logits_BxCxV, *_sums(logits_BxCxV, targets_BxC, weights_BxC))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(settings, x_BxLxD, out_DxV, targets_BxL, weights_BxL):
    """Loss only (evaluation, or a forward not differentiated). settings: (chunk, dot_in_fp32,
    z_loss_multiplier, vocab, softcap)."""
    chunk, dot_in_fp32, z_loss_multiplier, vocab, softcap = settings
    w_DxV = out_DxV.astype(x_BxLxD.dtype)

    def body(sums, xs):
        _, _, ce, z = _chunk_sums(xs[0], w_DxV, xs[1], xs[2], dot_in_fp32, vocab, softcap)
        return (sums[0] + ce, sums[1] + z), None

    chunks = [split_chunks(a, chunk) for a in (x_BxLxD, targets_BxL, weights_BxL)]
    (ce, z), _ = jax.lax.scan(body, (jnp.zeros(()), jnp.zeros(())), chunks)
    return ce + z_loss_multiplier * z, ce


def _fused_fwd(settings, x_BxLxD, out_DxV, targets_BxL, weights_BxL):
    chunk, dot_in_fp32, z_loss_multiplier, vocab, softcap = settings
    w_DxV = out_DxV.astype(x_BxLxD.dtype)

    def body(carry, xs):
        ce_sum, z_sum, d_out_DxV = carry
        x_BxCxD, targets_BxC, weights_BxC = xs
        logits_BxCxV, log_z_BxC, ce, z = _chunk_sums(x_BxCxD, w_DxV, targets_BxC, weights_BxC, dot_in_fp32, vocab,
                                                     softcap)
        # d/dlogits of weights * (log_z - logit[target] + z_loss_multiplier * log_z^2)
        probs_BxCxV = jnp.exp(logits_BxCxV - log_z_BxC[..., None])
        d_log_z_BxC = weights_BxC * (1.0 + 2.0 * z_loss_multiplier * log_z_BxC)
        is_target_BxCxV = jnp.arange(out_DxV.shape[1]) == targets_BxC[..., None]
        d_logits_BxCxV = probs_BxCxV * d_log_z_BxC[..., None] - jnp.where(is_target_BxCxV, weights_BxC[..., None], 0.0)
        if softcap:  # through the cap: d(cap x tanh(l / cap)) / dl = 1 - (capped / cap)^2 (padding: 0 x -inf)
            d_logits_BxCxV = jnp.where(jnp.isfinite(logits_BxCxV),
                                       d_logits_BxCxV * (1 - jnp.square(logits_BxCxV / softcap)), 0.0)
        d_logits_BxCxV = d_logits_BxCxV.astype(x_BxLxD.dtype)
        d_x_BxCxD = jnp.einsum("bcv,dv->bcd", d_logits_BxCxV, w_DxV)
        d_w_DxV = jnp.einsum("bcd,bcv->dv", x_BxCxD, d_logits_BxCxV)
        d_w_DxV = constrain(d_w_DxV, ("embed", "vocab"))  # reduce-scatter now
        return (ce_sum + ce, z_sum + z, d_out_DxV + d_w_DxV.astype(out_DxV.dtype)), d_x_BxCxD

    zeros_DxV = constrain(jnp.zeros_like(out_DxV), ("embed", "vocab"))
    chunks = [split_chunks(a, chunk) for a in (x_BxLxD, targets_BxL, weights_BxL)]
    (ce, z, d_out_DxV), d_x_NxBxCxD = jax.lax.scan(body, (jnp.zeros(()), jnp.zeros(()), zeros_DxV), chunks)
    return (ce + z_loss_multiplier * z, ce), (merge_chunks(d_x_NxBxCxD), d_out_DxV)


def _fused_bwd(settings, residuals, cotangents):
    d_x_BxLxD, d_out_DxV = residuals
    d_total = cotangents[0]  # ce_sum's is always zero: cross_entropy_loss stops its gradient
    # each gradient in its primal's dtype (a float32 scalar times bfloat16 would make float32)
    return (d_total * d_x_BxLxD).astype(d_x_BxLxD.dtype), (d_total * d_out_DxV).astype(d_out_DxV.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)
