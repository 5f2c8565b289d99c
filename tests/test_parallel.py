"""The same training on 1 device and on every kind of 8-device mesh gives the same losses."""

import jax
import numpy as np
import pytest

from maxtrain.parallel import mesh as mesh_lib, rules as rules_lib
from maxtrain.training import step as step_lib

# 8 query and 8 kv heads so that tensor=8 divides both; global batch 8 in every run.
MODEL = ("base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=8")
# fp32 on CPU: collectives change summation order only, so losses agree to ~1e-6; stated 1e-5.
RTOL = 1e-5


@pytest.fixture
def single_device_losses(reference_losses):
    return reference_losses(*MODEL, "per_device_batch_size=8")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    ("ici_data_parallelism=8", "ici_fsdp_parallelism=1"),
    ("ici_fsdp_parallelism=8",),
    ("ici_tensor_parallelism=8", "ici_fsdp_parallelism=1"),
    ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
], ids=["data8", "fsdp8", "tensor8", "data2xfsdp2xtensor2"])
def test_meshes_match_single_device(train_tiny, single_device_losses, mesh):
    losses = train_tiny(*MODEL, *mesh, "per_device_batch_size=1")["losses"]
    assert len(losses) == len(single_device_losses) == 5
    np.testing.assert_allclose(losses, single_device_losses, rtol=RTOL)
    assert losses[-1] < losses[0]


def test_fsdp_shards_every_large_parameter(tiny_config):
    c = tiny_config("ici_fsdp_parallelism=8")
    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
    for path, x in jax.tree_util.tree_leaves_with_path(state.params):
        name = jax.tree_util.keystr(path)
        per_device = {s.data.nbytes for s in x.addressable_shards}
        assert len(x.addressable_shards) == 8
        if "scale" in name:  # norm scales are tiny and replicated by the rules
            assert per_device == {x.nbytes}, name
        else:
            assert per_device == {x.nbytes // 8}, name
    # Adam moments follow their parameters' sharding.
    mu = state.opt_state[1][0].mu["layers"]["mlp"]["wo"]
    assert {s.data.nbytes for s in mu.addressable_shards} == {mu.nbytes // 8}


def test_tensor_parallel_shards_heads_and_mlp(tiny_config):
    c = tiny_config(*MODEL, "ici_tensor_parallelism=8", "ici_fsdp_parallelism=1")
    trainer = step_lib.build(c, mesh_lib.make_mesh(c))
    params = trainer.abstract_state.params
    wq, wo = params["layers"]["attention"]["wq"], params["layers"]["mlp"]["wo"]
    assert wq.sharding.shard_shape(wq.shape) == (2, 64, 1, 8)   # heads 8 -> 1 per device
    assert wo.sharding.shard_shape(wo.shape) == (2, 16, 64)     # mlp 128 -> 16 per device


@pytest.mark.slow
def test_blockwise_attention_trains_like_dot_product(train_tiny):
    """Blocks of 256 queries over 300 positions (the last block short) on fsdp x tensor: same losses."""
    mesh = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "max_target_length=300", "steps=3")
    plain = train_tiny(*mesh, "run_name=plain", "attention=dot_product")["losses"]
    blocks = train_tiny(*mesh, "run_name=blockwise", "attention=blockwise")["losses"]
    np.testing.assert_allclose(blocks, plain, rtol=1e-5)


@pytest.mark.slow
def test_splash_attention_under_shard_map_trains_like_dot_product(train_tiny):
    """Splash runs per shard (batch over fsdp, heads over tensor); same losses as plain attention."""
    mesh = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "max_target_length=128", "steps=3")
    plain = train_tiny(*mesh, "run_name=plain", "attention=dot_product")["losses"]
    splash = train_tiny(*mesh, "run_name=splash", "attention=splash")["losses"]
    np.testing.assert_allclose(splash, plain, rtol=1e-5)


@pytest.mark.parametrize("mesh", [
    ("ici_fsdp_parallelism=8",),
    ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    ("ici_context_parallelism=4", "ici_fsdp_parallelism=2"),
    ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "model_family=mixtral",
     "num_experts=4"),
], ids=["fsdp8", "data2xfsdp2xtensor2", "context4xfsdp2", "data2xfsdp2xexpert2"])
def test_embedding_lookup_and_its_gradient_match_one_device(tiny_config, mesh):
    """The sharded embedding lookup (each device looks up every token in its columns of the table, then an all-to-all)
    gives the rows and the table gradient of a plain take."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    import flax.linen as nn
    from maxtrain.parallel import embedding
    c = tiny_config(*mesh, "per_device_batch_size=1", "max_target_length=64")
    mesh_ = mesh_lib.make_mesh(c)
    table = jax.random.normal(jax.random.key(0), (c.vocab_size, c.base_emb_dim))
    tokens = jax.random.randint(jax.random.key(1), (8, 64), 0, c.vocab_size)
    cotangent = jax.random.normal(jax.random.key(2), (8, 64, c.base_emb_dim))

    def loss(t, tok):
        return jnp.sum(embedding.lookup(t, tok, jnp.float32) * cotangent)
    want_loss, want_grad = jax.value_and_grad(loss)(table, tokens)
    with mesh_lib.activate(mesh_, rules_lib.axis_rules(c)):
        place = lambda x, axes: jax.device_put(x, NamedSharding(mesh_, PartitionSpec(*nn.logical_to_mesh_axes(axes))))  # noqa: E731
        table_, tokens_ = place(table, ("vocab", "embed")), place(tokens, ("batch", "length"))
        step = jax.jit(jax.value_and_grad(loss))
        got_loss, got_grad = step(table_, tokens_)
        assert "all_to_all" in step.lower(table_, tokens_).as_text()
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-5)
