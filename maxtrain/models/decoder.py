"""Llama-family decoder in Flax linen: RMSNorm, RoPE, GQA attention, SwiGLU, scanned layers.

The model says nothing about devices: parameters and activations carry logical axis names
(batch, length, embed, heads, kv_heads, head_dim, mlp, vocab, layers, norm) and the mesh rules in the
config decide where each lives. Shape suffixes: B batch, L length, D embed, H query heads,
N kv heads, G query heads per kv head, K head dim, F mlp, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import moe, quantization, remat
from maxtrain.config.load import padded_vocab
from maxtrain.parallel.plan import Plan
from maxtrain.parallel.rules import constrain
from maxtrain.config.resolve import Resolved
from maxtrain.models import stacks as stacks_lib

@dataclasses.dataclass(frozen=True)
class ModelArgs:
    vocab: int  # the true vocabulary; the parameters hold padded_vocab(vocab) entries
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    layers: int
    rope_theta: float
    rope_scaling: tuple  # (factor, low_freq_factor, high_freq_factor, original length); factor 1 = none
    norm_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    dtype: Any
    weight_dtype: Any
    scan_layers: bool
    logits_dot_in_fp32: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    quantized_mlp: bool  # maxtrain.models.quantization quantizes MLPs: their matmuls as jnp.einsum, which Qwix intercepts
    # Mixture of experts (maxtrain.models.moe); num_experts 1 = a dense model
    num_experts: int
    experts_per_token: int
    moe_mlp: int
    shared_experts: int
    first_dense_layers: int
    capacity_factor: float
    routed_score_func: str
    norm_topk_prob: bool
    routed_bias: bool
    routed_scaling_factor: float
    plan: Plan  # how the layers run: kernels, chunks, remat, the scan's unroll (maxtrain.parallel.plan)

    @classmethod
    def from_config(cls, c) -> "ModelArgs":
        return cls(
            vocab=c.vocab_size, embed=c.base_emb_dim, heads=c.base_num_query_heads,
            kv_heads=c.base_num_kv_heads, head_dim=c.head_dim, mlp=c.base_mlp_dim,
            layers=c.base_num_decoder_layers, rope_theta=c.rope_theta,
            rope_scaling=(c.rope_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor,
                          c.rope_original_max_position_embeddings),
            norm_eps=c.normalization_layer_epsilon, tied_embeddings=c.logits_via_embedding,
            qkv_bias=c.qkv_bias, dtype=jnp.dtype(c.dtype), weight_dtype=jnp.dtype(c.weight_dtype),
            scan_layers=c.scan_layers, logits_dot_in_fp32=c.logits_dot_in_fp32, qk_norm=c.use_qk_norm,
            quantized_mlp="mlp" in quantization.targets(c),
            num_experts=c.num_experts, experts_per_token=c.num_experts_per_tok, moe_mlp=c.moe_mlp_dim,
            shared_experts=c.shared_experts, first_dense_layers=c.first_num_dense_layers,
            capacity_factor=c.capacity_factor, routed_score_func=c.routed_score_func,
            norm_topk_prob=c.norm_topk_prob, routed_bias=c.routed_bias,
            routed_scaling_factor=c.routed_scaling_factor,
            plan=Plan.from_resolved(c) if isinstance(c, Resolved) else Plan.single_device(c))

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self.vocab)

    def stacks(self) -> list[tuple[str, int, bool]]:
        """(name, layers, is MoE) of each layer stack (maxtrain.models.stacks names them)."""
        return [(s.name, s.count, s.moe) for s in stacks_lib.stacks(self.layers, self.num_experts,
                                                                     self.first_dense_layers)]


def dense_init(fan_in_axes: tuple[int, ...]):
    """LeCun-normal over the contracted axes, so every projection starts with unit-ish gain."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=fan_in_axes,
                                            out_axis=-1)


def dense_weight(module: nn.Module, name: str, shape, axes, fan_in=(0,), stored_dtype=False):
    """A projection matrix: stored in weight_dtype with logical axes, used in the compute dtype."""
    init = nn.with_logical_partitioning(dense_init(fan_in), axes)
    w = module.param(name, init, shape, module.args.weight_dtype)
    return w if stored_dtype else w.astype(module.args.dtype)


def bias(module: nn.Module, name: str, shape, axes):
    init = nn.with_logical_partitioning(nn.initializers.zeros, axes)
    return module.param(name, init, shape, module.args.weight_dtype).astype(module.args.dtype)


class RMSNorm(nn.Module):
    args: ModelArgs
    dim: int | None = None  # default: the model width

    @nn.compact
    def __call__(self, x_BxLxD):
        scale_D = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                             (self.dim or self.args.embed,), self.args.weight_dtype)
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.args.norm_eps)
        return (x * scale_D.astype(jnp.float32)).astype(self.args.dtype)


def rope_frequencies(half: int, theta: float, scaling: tuple | None = None):
    """theta^(-i/half) for i < half. With a scaling factor > 1, Llama 3.1's: wavelengths longer than
    original/low_freq_factor slow down by `factor`, those shorter than original/high_freq_factor stay,
    and a linear blend in between (factor 1 leaves every frequency as it is)."""
    freq_K2 = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None or scaling[0] == 1.0:
        return freq_K2
    factor, low_freq_factor, high_freq_factor, original = scaling
    blend = (original * freq_K2 / (2 * jnp.pi) - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blend = jnp.clip(blend, 0.0, 1.0)
    return (1 - blend) * freq_K2 / factor + blend * freq_K2


def rope(x_BxLxHxK, positions_BxL, theta: float, scaling: tuple | None = None):
    """Rotary embedding, half-split layout (as HF Llama): rotate (x[:K/2], x[K/2:]) pairs."""
    half = x_BxLxHxK.shape[-1] // 2
    freq_K2 = rope_frequencies(half, theta, scaling)
    angle_BxLx1xK2 = (positions_BxL[:, :, None, None] * freq_K2).astype(jnp.float32)
    sin, cos = jnp.sin(angle_BxLx1xK2), jnp.cos(angle_BxLx1xK2)
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


class Attention(nn.Module):
    args: ModelArgs

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
        a = self.args
        wq_DxHxK = dense_weight(self, "wq", (a.embed, a.heads, a.head_dim), ("embed", "heads", "head_dim"))
        wk_DxNxK = dense_weight(self, "wk", (a.embed, a.kv_heads, a.head_dim), ("embed", "kv_heads", "head_dim"))
        wv_DxNxK = dense_weight(self, "wv", (a.embed, a.kv_heads, a.head_dim), ("embed", "kv_heads", "head_dim"))
        wo_HxKxD = dense_weight(self, "wo", (a.heads, a.head_dim, a.embed), ("heads", "head_dim", "embed"), (0, 1))

        q = jnp.einsum("bld,dhk->blhk", x_BxLxD, wq_DxHxK)
        k = jnp.einsum("bld,dnk->blnk", x_BxLxD, wk_DxNxK)
        v = jnp.einsum("bld,dnk->blnk", x_BxLxD, wv_DxNxK)
        if a.qkv_bias:  # Qwen2
            q = q + bias(self, "bq", (a.heads, a.head_dim), ("heads", "head_dim"))
            k = k + bias(self, "bk", (a.kv_heads, a.head_dim), ("kv_heads", "head_dim"))
            v = v + bias(self, "bv", (a.kv_heads, a.head_dim), ("kv_heads", "head_dim"))
        if a.qk_norm:  # Qwen3
            q = RMSNorm(a, a.head_dim, name="q_norm")(q)
            k = RMSNorm(a, a.head_dim, name="k_norm")(k)
        q, k, v = (checkpoint_name(q, remat.QUERY), checkpoint_name(k, remat.KEY),
                   checkpoint_name(v, remat.VALUE))
        q_BxLxHxK = constrain(rope(q, positions_BxL, a.rope_theta, a.rope_scaling),
                              ("batch", "length", "heads", "head_dim"))
        k_BxLxNxK = constrain(rope(k, positions_BxL, a.rope_theta, a.rope_scaling),
                              ("batch", "length", "kv_heads", "head_dim"))
        v_BxLxNxK = constrain(v, ("batch", "length", "kv_heads", "head_dim"))

        ctx_BxLxHxK = a.plan.attend(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL)
        ctx_BxLxHxK = checkpoint_name(ctx_BxLxHxK, remat.CONTEXT)
        return checkpoint_name(jnp.einsum("blhk,hkd->bld", ctx_BxLxHxK, wo_HxKxD), remat.OUT)


@jax.custom_vjp
def matmul(x, w_DxF):
    """x[..., D] @ w, with the weight gradient written as x^T @ g over the flattened rows. The same
    math as autodiff's, but from autodiff's form XLA:CPU (float32) makes a dot outside YNNPACK and a
    slow transposing fusion for the [rows, F] gradient: ~7% of a small float32 step."""
    return x @ w_DxF


def _matmul_fwd(x, w):
    return x @ w, (x, w)


def _matmul_bwd(residuals, g):
    x, w = residuals
    x_RxD, g_RxF = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return (g @ w.T).astype(x.dtype), (x_RxD.T @ g_RxF).astype(w.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


class MLP(nn.Module):
    args: ModelArgs
    width: int | None = None  # default: the model's mlp width

    @nn.compact
    def __call__(self, x_BxLxD):
        a = self.args
        f = self.width or a.mlp
        gate_DxF = dense_weight(self, "wi_gate", (a.embed, f), ("embed", "mlp"))
        up_DxF = dense_weight(self, "wi_up", (a.embed, f), ("embed", "mlp"))
        down_FxD = dense_weight(self, "wo", (f, a.embed), ("mlp", "embed"))
        mm = (lambda x, w: jnp.einsum("...d,df->...f", x, w)) if a.quantized_mlp else matmul  # noqa: E731

        def mlp(x_BxCxD):
            gate_BxCxF = checkpoint_name(mm(x_BxCxD, gate_DxF), remat.MLP_IN)
            up_BxCxF = checkpoint_name(mm(x_BxCxD, up_DxF), remat.MLP_IN)
            h_BxCxF = constrain(nn.silu(gate_BxCxF) * up_BxCxF, ("batch", "length", "mlp"))
            return checkpoint_name(mm(h_BxCxF, down_FxD), remat.MLP_OUT)

        return a.plan.mlp(mlp, x_BxLxD)  # long sequences: in chunks of positions


class DecoderLayer(nn.Module):
    args: ModelArgs
    moe: bool = False  # the MLP is a mixture of experts

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
        axes = ("batch", "length", "embed")
        x_BxLxD = constrain(x_BxLxD, axes)
        h = Attention(self.args, name="attention")(RMSNorm(self.args, name="attention_norm")(x_BxLxD),
                                                   positions_BxL, segment_ids_BxL)
        x_BxLxD = constrain(x_BxLxD + h, axes)
        mlp = moe.MoEBlock(self.args, name="mlp") if self.moe else MLP(self.args, name="mlp")
        h = mlp(RMSNorm(self.args, name="mlp_norm")(x_BxLxD))
        return constrain(x_BxLxD + h, axes), None  # (carry, per-layer output) for nn.scan


class Decoder(nn.Module):
    args: ModelArgs

    @nn.compact
    def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None, return_hidden=False):
        """Logits [B,L,V] in float32; with return_hidden, (final hidden [B,L,D], output matrix [D,V] in
        its stored dtype) so the loss can form the logits chunk by chunk."""
        a = self.args
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.ones_like(tokens_BxL)

        embed_init = nn.with_logical_partitioning(nn.initializers.normal(a.embed ** -0.5), ("vocab", "embed"))
        embedding_VxD = self.param("embedding", embed_init, (a.padded_vocab, a.embed), a.weight_dtype)
        x_BxLxD = a.plan.embed(embedding_VxD, tokens_BxL, a.dtype)

        layer = a.plan.remat(DecoderLayer, a.scan_layers)
        first = 0
        for name, count, is_moe in a.stacks():
            if a.scan_layers:  # intermediates: MoE layers record their load and auxiliary losses
                stack = nn.scan(layer, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                                in_axes=(nn.broadcast, nn.broadcast), length=count,
                                unroll=a.plan.unroll(count), metadata_params={nn.PARTITION_NAME: "layers"})
                x_BxLxD, _ = stack(a, is_moe, name=name)(x_BxLxD, positions_BxL, segment_ids_BxL)
            else:
                for i in range(first, first + count):
                    x_BxLxD, _ = layer(a, is_moe, name=stacks_lib.unrolled(i))(x_BxLxD, positions_BxL, segment_ids_BxL)
            first += count

        x_BxLxD = RMSNorm(a, name="final_norm")(x_BxLxD)
        if a.tied_embeddings:
            out_DxV = embedding_VxD.T
        else:
            out_DxV = dense_weight(self, "output", (a.embed, a.padded_vocab), ("embed", "vocab"), stored_dtype=True)
        if return_hidden:  # the output matrix padded: see mask_padding
            return x_BxLxD, out_DxV
        logits_BxLxV = output_logits(x_BxLxD, out_DxV, a.logits_dot_in_fp32)[..., :a.vocab]
        return constrain(logits_BxLxV, ("batch", "length", "vocab"))


def output_logits(x_BxLxD, out_DxV, dot_in_fp32: bool):
    """float32 logits from a matmul in x's (the compute) dtype: its output in float32, or rounded to
    the compute dtype and then cast (half the memory traffic; faster where float32 output is costly)."""
    out_DxV = out_DxV.astype(x_BxLxD.dtype)
    if dot_in_fp32:
        return jnp.einsum("bld,dv->blv", x_BxLxD, out_DxV, preferred_element_type=jnp.float32)
    return jnp.einsum("bld,dv->blv", x_BxLxD, out_DxV).astype(jnp.float32)


def mask_padding(logits_BxLxV, vocab: int):
    """Logits over the padded vocabulary with the padding's at -inf: out of log Z, probability 0, gradient 0."""
    if logits_BxLxV.shape[-1] == vocab:
        return logits_BxLxV
    return jnp.where(jnp.arange(logits_BxLxV.shape[-1]) < vocab, logits_BxLxV, -jnp.inf)


def unstack_layers(params: dict, args: ModelArgs) -> dict:
    """Scanned params ({'layers': stacked}, or an MoE model's stacks) -> unrolled ({'layers_0': ...})."""
    params, first = dict(params), 0
    for name, count, _ in args.stacks():
        stacked = params.pop(name)
        for i in range(count):
            params[stacks_lib.unrolled(first + i)] = jax.tree.map(lambda x, i=i: x[i], stacked)
        first += count
    return params


def stack_layers(params: dict, args: ModelArgs) -> dict:
    """Unrolled layout -> scanned layout: each stack with a leading `layers` axis."""
    params, first = dict(params), 0
    for name, count, _ in args.stacks():
        layers = [params.pop(stacks_lib.unrolled(i)) for i in range(first, first + count)]
        params[name] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        first += count
    return params
