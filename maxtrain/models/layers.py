"""The decoder's building blocks: projections, RMSNorm and the gated MLP (RoPE: maxtrain.models.rope); their
specs, Norm and GatedMLP, are maxtrain.models.parts'.

Shape suffixes: B batch, L length, D embed, H query heads, N kv heads, G query heads per kv head,
K head dim, F mlp, V vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.parallel import remat
from maxtrain.models.args import ModelArgs
from maxtrain.models.parts import GatedMLP
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
    eps: float | None = None  # default: the model's normalization_layer_epsilon

    @nn.compact
    def __call__(self, x_BxLxD):
        a, norm = self.args, self.args.norm
        init = nn.initializers.zeros if norm.plus_one else nn.initializers.ones  # Gemma: x (1 + scale)
        scale_D = self.param("scale", nn.with_logical_partitioning(init, ("norm",)), (self.dim or a.embed,),
                             a.weight_dtype).astype(jnp.float32)
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + (norm.eps if self.eps is None else self.eps))
        return (x * (1.0 + scale_D if norm.plus_one else scale_D)).astype(a.dtype)


SWIGLU_ALPHA = 1.702  # gpt-oss's clamped SwiGLU: gate x sigmoid(alpha x gate)


def activate(gate, up, mlp: GatedMLP):
    """The gated MLP's hidden activation from its gate and up projections."""
    if mlp.activation == "gelu_tanh":
        return nn.gelu(gate, approximate=True) * up
    if mlp.activation == "clamped_swiglu":
        limit = mlp.limit
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return (up + 1) * gate * jax.nn.sigmoid(SWIGLU_ALPHA * gate)
    return nn.silu(gate) * up


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
    spec: GatedMLP | None = None  # default: the model's dense layers' (args.mlp)

    @nn.compact
    def __call__(self, x_BxLxD):
        a = self.args
        spec = self.spec or a.mlp
        f = spec.width
        gate_DxF = dense_weight(self, "wi_gate", (a.embed, f), ("embed", "mlp"))
        up_DxF = dense_weight(self, "wi_up", (a.embed, f), ("embed", "mlp"))
        down_FxD = dense_weight(self, "wo", (f, a.embed), ("mlp", "embed"))
        add = (lambda name, shape, axes: bias(self, name, shape, axes)) if spec.bias else (lambda *_: 0.0)  # noqa: E731
        gate_bias_F, up_bias_F, down_bias_D = (add("bi_gate", (f,), ("mlp",)), add("bi_up", (f,), ("mlp",)),
                                               add("bo", (a.embed,), ("embed",)))
        mm = (lambda x, w: jnp.einsum("...d,df->...f", x, w)) if a.quantized_mlp else matmul  # noqa: E731

        def mlp(x_BxCxD):
            gate_BxCxF = checkpoint_name(mm(x_BxCxD, gate_DxF) + gate_bias_F, remat.MLP_IN)
            up_BxCxF = checkpoint_name(mm(x_BxCxD, up_DxF) + up_bias_F, remat.MLP_IN)
            h_BxCxF = constrain(activate(gate_BxCxF, up_BxCxF, spec), ("batch", "length", "mlp"))
            return checkpoint_name(mm(h_BxCxF, down_FxD) + down_bias_D, remat.MLP_OUT)

        return a.plan.mlp(mlp, x_BxLxD)  # long sequences: in chunks of positions
