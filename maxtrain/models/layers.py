"""The decoder's building blocks: projections, RMSNorm, RoPE and the SwiGLU MLP.

Shape suffixes: B batch, L length, D embed, H query heads, N kv heads, G query heads per kv head,
K head dim, F mlp, V vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import remat
from maxtrain.models.args import ModelArgs
from maxtrain.parallel.rules import constrain


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



@jax.custom_vjp
def matmul(x, w_DxF):
    """x[..., D] @ w, with the weight gradient written as x^T @ g over the flattened rows. The same
    math as autodiff's, but from autodiff's form XLA:CPU (float32) makes a dot outside YNNPACK and a
    slow transposing fusion for the [rows, F] gradient."""
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

