"""Model: parameter count, scan == unrolled, remat policies, causality, document isolation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxtrain.ops.attention
from maxtrain.config import load as config_lib
from maxtrain.config.schema import model_keys
from maxtrain.models import registry
from maxtrain.parallel import remat
from maxtrain.models.args import ModelArgs, attention_of
from maxtrain.models.parts import MLA, GatedMLP, MoE, Norm
from maxtrain.models.decoder import Decoder, stack_layers, unstack_layers
from maxtrain.models.layers import matmul


def build(c):
    model = Decoder(ModelArgs.from_config(c))
    tokens = jax.random.randint(jax.random.key(1), (2, c.max_target_length), 0, c.vocab_size)
    params = jax.jit(lambda k: nn.meta.unbox(model.init(k, tokens)["params"]))(jax.random.key(0))
    return model, params, tokens


def logits(model, params, tokens, *args):
    return jax.jit(model.apply)({"params": params}, tokens, *args)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [(), ("logits_via_embedding=true",), ("qkv_bias=true",),
                                       ("mtp_num_layers=2",)])
def test_param_count_matches_config(tiny_config, overrides):
    """Multi-token prediction is the decoder's, not DeepSeek's: the tiny Llama builds and counts its depths."""
    c = tiny_config(*overrides)
    _, params, _ = build(c)
    assert sum(x.size for x in jax.tree.leaves(params)) == c.num_params == registry.spec_for(c).count_params(c, False)
    assert ("mtp_2" in params) == ("mtp_num_layers=2" in overrides)


@pytest.mark.parametrize("preset,approx", [("125m", 124e6), ("llama2-7b", 6.74e9), ("llama3-8b", 8.03e9)])
def test_preset_param_counts(tiny_config, preset, approx):
    c = tiny_config(f"model_name={preset}")
    model = Decoder(ModelArgs.from_config(c))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    count = sum(np.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(shapes)))
    assert count == c.num_params
    assert abs(count - approx) / approx < 0.01


def test_logits_shape_and_dtype(tiny_config):
    c = tiny_config("dtype=bfloat16")
    model, params, tokens = build(c)
    out = logits(model, params, tokens)
    assert out.shape == (*tokens.shape, c.vocab_size) and out.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(out)))
    assert jax.tree.leaves(params)[0].dtype == jnp.float32  # weight_dtype stays float32


@pytest.mark.slow
def test_scan_equals_unrolled_and_layouts_round_trip(tiny_config):
    c = tiny_config()
    scanned, params, tokens = build(c)
    unrolled = Decoder(ModelArgs.from_config(c.replace(scan_layers=False)))
    flat = unstack_layers(params, ModelArgs.from_config(c))
    assert set(flat) >= {"layers_0", "layers_1"} and "layers" not in flat
    unrolled_shapes = jax.eval_shape(unrolled.init, jax.random.key(0), tokens)["params"]
    assert jax.tree.structure(nn.meta.unbox(unrolled_shapes)) == jax.tree.structure(flat)
    np.testing.assert_allclose(logits(scanned, params, tokens), logits(unrolled, flat, tokens),
                               atol=1e-5, rtol=1e-5)
    restacked = stack_layers(flat, ModelArgs.from_config(c))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, restacked))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "full"])
def test_an_unrolled_scan_gives_the_looped_scans_loss_and_gradients(tiny_config, policy):
    c = tiny_config(f"remat_policy={policy}", "scan_unroll=1", "base_num_decoder_layers=4")
    _, params, tokens = build(c)

    def loss_and_grads(unroll):
        m = Decoder(ModelArgs.from_config(c.replace(scan_unroll=unroll)))
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(logits(m, p, tokens) ** 2)))(params)
    looped = loss_and_grads(1)
    for unroll in (2, 4):  # two layers per iteration; all four (no loop)
        for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(loss_and_grads(unroll))):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5, err_msg=f"unroll {unroll}")


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_every_remat_policy_gives_the_same_gradients(tiny_config, scan):
    c = tiny_config(f"scan_layers={str(scan).lower()}")
    model, params, tokens = build(c.replace(remat_policy="none"))

    def grads(policy):
        m = Decoder(ModelArgs.from_config(c.replace(remat_policy=policy)))
        loss = lambda p: jnp.mean(logits(m, p, tokens) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    reference = grads("none")
    # Unrolled layers share the remat code path; two policies suffice there (compiles are slow).
    for policy in remat.POLICY_NAMES if scan else ("full", "minimal"):
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(grads(policy))):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5, err_msg=policy)


@pytest.mark.slow
def test_remat_policies_differ_in_what_they_save(tiny_config):
    """The policies are real: full remat keeps fewer residuals than none."""
    c = tiny_config()
    _, params, tokens = build(c)

    def saved_bytes(policy):
        m = Decoder(ModelArgs.from_config(c.replace(remat_policy=policy)))
        f = lambda p: jnp.sum(logits(m, p, tokens))  # noqa: E731
        compiled = jax.jit(jax.grad(f)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert saved_bytes("full") < saved_bytes("none")


def test_causal(tiny_config):
    c = tiny_config()
    model, params, tokens = build(c)
    t = c.max_target_length // 2
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % c.vocab_size)
    a, b = logits(model, params, tokens), logits(model, params, changed)
    np.testing.assert_allclose(a[:, :t], b[:, :t], atol=1e-6)
    assert not np.allclose(a[:, t:], b[:, t:])


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["dot_product", "blockwise", "jax_nn"])
def test_packed_documents_equal_documents_alone(tiny_config, attention, monkeypatch):
    """With segment ids and restarting positions, a packed row equals each document run alone."""
    monkeypatch.setattr(maxtrain.ops.attention, "BLOCK", 8)  # blockwise: 4 blocks, a document boundary inside one
    c = tiny_config(f"attention={attention}")
    model, params, _ = build(c)
    doc1 = jax.random.randint(jax.random.key(2), (1, 12), 0, c.vocab_size)
    doc2 = jax.random.randint(jax.random.key(3), (1, 20), 0, c.vocab_size)
    packed = jnp.concatenate([doc1, doc2], axis=1)
    positions = jnp.concatenate([jnp.arange(12), jnp.arange(20)])[None]
    segments = jnp.concatenate([jnp.full(12, 1), jnp.full(20, 2)])[None]
    out = logits(model, params, packed, positions, segments)
    np.testing.assert_allclose(out[:, :12], logits(model, params, doc1), atol=1e-5)
    np.testing.assert_allclose(out[:, 12:], logits(model, params, doc2), atol=1e-5)


def test_jax_nn_attention_matches_dot_product(tiny_config):
    c = tiny_config("attention=dot_product")
    model, params, tokens = build(c)
    other = Decoder(ModelArgs.from_config(c.replace(attention="jax_nn")))
    np.testing.assert_allclose(logits(model, params, tokens), logits(other, params, tokens), atol=1e-5)


@pytest.mark.slow
def test_blockwise_attention_matches_dot_product(monkeypatch):
    """Blocks of 8 over 36 positions (the last block short), GQA 4:2, two packed documents: the same
    outputs and gradients as all positions at once."""
    monkeypatch.setattr(maxtrain.ops.attention, "BLOCK", 8)
    q_key, k_key, v_key, w_key = jax.random.split(jax.random.key(5), 4)
    q, out_weights = (jax.random.normal(key, (2, 36, 4, 16)) for key in (q_key, w_key))
    k, v = (jax.random.normal(key, (2, 36, 2, 16)) for key in (k_key, v_key))
    segments = jnp.concatenate([jnp.full((2, 15), 1), jnp.full((2, 21), 2)], axis=1)

    def value_and_grads(kernel):
        loss = lambda q, k, v: jnp.sum(kernel(q, k, v, segments) * out_weights)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    blocks, plain = value_and_grads(maxtrain.ops.attention.blockwise), value_and_grads(maxtrain.ops.attention.dot_product)
    for a, b in zip(jax.tree.leaves(blocks), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_have_no_output_matrix(tiny_config):
    _, params, _ = build(tiny_config("logits_via_embedding=true"))
    assert "output" not in params and "embedding" in params


@pytest.mark.slow
def test_splash_attention_matches_dot_product(tiny_config):
    """Pallas splash kernel (interpret mode on CPU) with packed documents and GQA."""
    c = tiny_config("max_target_length=128", "attention=dot_product")
    model, params, _ = build(c)
    splash = Decoder(ModelArgs.from_config(c.replace(attention="splash")))
    tokens = jax.random.randint(jax.random.key(4), (2, 128), 0, c.vocab_size)
    segments = jnp.concatenate([jnp.full((2, 50), 1), jnp.full((2, 78), 2)], axis=1)
    positions = jnp.concatenate([jnp.arange(50), jnp.arange(78)])[None].repeat(2, 0)
    np.testing.assert_allclose(logits(splash, params, tokens, positions, segments),
                               logits(model, params, tokens, positions, segments), atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_gradients_equal_autodiff(dtype):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (2, 3, 8), dtype), jax.random.normal(kw, (8, 5), dtype)
    g = jax.random.normal(kg, (2, 3, 5), dtype)
    ours = jax.vjp(matmul, x, w)
    plain = jax.vjp(lambda a, b: a @ b, x, w)
    np.testing.assert_array_equal(ours[0], plain[0])
    # Only the summation order differs: each gradient is within a few roundings of the terms it sums (the
    # dot product's error bound, eps x the same gradient of |x|, |w| and |g|), not of the sum, which may be ~0.
    f32 = lambda t: np.asarray(t, np.float32)  # noqa: E731
    bounds = jax.vjp(lambda a, b: a @ b, jnp.abs(x).astype(jnp.float32), jnp.abs(w).astype(jnp.float32))[1](
        jnp.abs(g).astype(jnp.float32))
    for a, b, bound in zip(ours[1](g), plain[1](g), bounds, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.all(np.abs(f32(a) - f32(b)) <= 4 * float(jnp.finfo(dtype).eps) * f32(bound)), (a, b)


@pytest.mark.parametrize("name", sorted(p.stem for p in (config_lib.CONFIG_DIR / "models").glob("*.yml")))
def test_a_models_parts_come_from_its_model_keys_alone(name):
    """A checkpoint's model description (the model keys) builds the same parts as the whole config: conversion and
    the counts ask the parts without a run's settings."""
    c = config_lib.load([str(config_lib.BASE_YML), f"model_name={name}"])
    m = {k: c[k] for k in model_keys()}
    args = ModelArgs.from_config(c)
    assert (attention_of(m), GatedMLP.from_config(m), MoE.from_config(m), Norm.from_config(m)) == (
        args.attention, args.mlp, args.moe, args.norm)
    assert isinstance(args.attention, MLA) == (c.attention_type == "mla")
    assert (args.moe is None) == (c.num_experts == 1)
