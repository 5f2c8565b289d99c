"""gpt-oss (maxtrain/models/gpt_oss.py): its MoE block (router logit bias, expert biases, clamped SwiGLU)
against a per-token reference through every grouped matmul and mesh; HF import/export with logits parity
against transformers' GptOssForCausalLM; greedy generation; the same losses on every mesh; presets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.ops import grouped_matmul as gmm

from test_moe import MESHES, apply_block, block_args, init_block, mesh_overrides, random_x

GPT_OSS_MOE = ("mlp_bias=true", "router_logit_bias=true", "mlp_activation=clamped_swiglu",
               "mlp_activation_limit=0.8")  # a limit the random activations reach, so the clamps matter


def randomized(params, seed=2):
    """Every parameter random (biases start at zero, which would hide a missing one)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def gpt_oss_reference(args, params, x):
    """Per token in float64 numpy, as transformers' GptOssMLP: softmax over the top-k of the biased
    logits; each expert's clamped SwiGLU with its biases."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    xs = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out, limit = np.zeros_like(xs), args.mlp_activation_limit
    for t, x_t in enumerate(xs):
        logits = x_t @ p["router"] + p["router_logit_bias"]
        chosen = np.argsort(-logits)[:args.experts_per_token]
        weights = np.exp(logits[chosen] - logits[chosen].max())
        for e, w in zip(chosen, weights / weights.sum()):
            gate = np.minimum(x_t @ p["wi_gate"][e] + p["bi_gate"][e], limit)
            up = np.clip(x_t @ p["wi_up"][e] + p["bi_up"][e], -limit, limit)
            h = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            out[t] += w * (h @ p["wo"][e] + p["bo"][e])
    return out.reshape(x.shape)


@pytest.mark.parametrize("method", ["blocked", "ragged_dot"])
@pytest.mark.parametrize("mesh", [None, "expert4xfsdp2", "expert2xtensor2xdata2"])
def test_moe_block_equals_the_reference(tiny_config, method, mesh):
    args, c = block_args(tiny_config, *GPT_OSS_MOE, *mesh_overrides(MESHES[mesh or "expert1"]),
                         moe_grouped_matmul=method)
    x = random_x(args)
    params = randomized(init_block(args, x))
    assert {"router_logit_bias", "bi_gate", "bi_up", "bo"} <= set(params)
    out = apply_block(args, params, x, c, MESHES[mesh] if mesh else None)
    np.testing.assert_allclose(out, gpt_oss_reference(args, params, x), atol=1e-5, rtol=1e-5)


def test_moe_block_with_capacity_drops_the_down_bias_too(tiny_config):
    """A dropped assignment contributes nothing, its expert's down bias included: capacity 0.5 on the
    expert-parallel mesh equals the reference with the dropped experts' weights zeroed."""
    args, c = block_args(tiny_config, *GPT_OSS_MOE, *mesh_overrides(MESHES["expert4xfsdp2"]), capacity_factor=0.5)
    x = random_x(args)
    params = randomized(init_block(args, x))
    dropless = apply_block(dataclasses.replace(args, capacity_factor=-1.0), params, x, c,
                           MESHES["expert4xfsdp2"])
    dropped = apply_block(args, params, x, c, MESHES["expert4xfsdp2"])
    assert not np.allclose(dropless, dropped)
    np.testing.assert_allclose(dropless, gpt_oss_reference(args, params, x), atol=1e-5, rtol=1e-5)


def test_megablox_with_biases_equals_blocked_in_the_interpreter(monkeypatch):
    """The TPU kernel's bias path (Pallas' interpreter on CPU): the same values and gradients as blocked's,
    rows past the groups 0."""
    monkeypatch.setattr(gmm, "MEGABLOX_INTERPRET", True)
    rng = np.random.default_rng(0)
    sizes = jnp.array([0, 100, 7, 0, 121], jnp.int32)  # 28 rows past all groups
    x = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 128, 128)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(5, 128)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)

    def grads(method):
        f = lambda x, w, b: jnp.sum(gmm.grouped_matmul(x, w, sizes, method, b) * dy)  # noqa: E731
        return jax.value_and_grad(f, argnums=(0, 1, 2))(x, w, b)
    (v1, g1), (v2, g2), (v3, g3) = grads("megablox"), grads("blocked"), grads("ragged_dot")
    np.testing.assert_allclose(v1, v2, rtol=1e-4)
    np.testing.assert_allclose(v3, v2, rtol=1e-4)
    for a, b_, c_ in zip(g1, g2, g3):
        np.testing.assert_allclose(a, b_, atol=1e-3)
        np.testing.assert_allclose(c_, b_, atol=1e-3)
    for method in ("megablox", "blocked", "ragged_dot"):
        y = np.asarray(gmm.grouped_matmul(x, w, sizes, method, b))
        assert not np.any(y[228:]), method
        np.testing.assert_allclose(y[:100], np.asarray(x[:100] @ w[1] + b[1]), atol=1e-3)
