"""Context parallelism: the `context` mesh axis splits each sequence's positions; training is the same."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.ops import attention
from maxtrain.config import keys as config_keys, load as config_lib
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib

from conftest import decode

# Global batch 8 x 64 tokens in every run; fp32 on CPU, so collectives change only the order of sums.
MODEL = ("base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=8", "max_target_length=64")
RTOL = 1e-5
MESHES = {
    "context2": ("ici_context_parallelism=2",),
    "context8": ("ici_context_parallelism=8", "ici_fsdp_parallelism=1"),
    "context4xfsdp2": ("ici_context_parallelism=4", "ici_fsdp_parallelism=2"),
    "context2xtensor2xdata2": ("ici_context_parallelism=2", "ici_tensor_parallelism=2", "ici_data_parallelism=2",
                               "ici_fsdp_parallelism=1"),
}
BALANCE = {"balanced": (), "unbalanced": ("context_parallel_load_balance=false",)}


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """A text file of short documents of many lengths: packed rows carry several segment ids each."""
    rng = np.random.default_rng(0)
    words = "the a of to and in that it was for on are with as his they be at one have this".split()
    docs = [" ".join(rng.choice(words, size=rng.integers(1, 6))) for _ in range(400)]
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    path.write_text("\n\n".join(docs) + "\n")
    return ("dataset_type=text", f"train_files={path}", "vocab_size=384")


def reference_losses(tmp_path_factory, *overrides):
    from maxtrain import train
    devices = jax.devices()[:1]
    c = train.load_config([str(__import__("conftest").TINY), *MODEL, *overrides, "per_device_batch_size=8",
                           f"base_output_directory={tmp_path_factory.mktemp('one')}"], devices)
    return train.train(c, devices)["losses"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, documents):
    return {"synthetic": reference_losses(tmp_path_factory), "packed": reference_losses(tmp_path_factory, *documents)}


@pytest.mark.slow
@pytest.mark.parametrize("mesh,balance", [  # each mesh once, each layout on two
    ("context8", "balanced"), ("context2xtensor2xdata2", "balanced"),
    ("context2", "unbalanced"), ("context4xfsdp2", "unbalanced")])
def test_the_same_losses_on_every_context_mesh(train_tiny, one_device, mesh, balance):
    losses = train_tiny(*MODEL, *MESHES[mesh], *BALANCE[balance], "per_device_batch_size=1")["losses"]
    np.testing.assert_allclose(losses, one_device["synthetic"], rtol=RTOL)
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["context4xfsdp2"])  # context8: the ring's below
def test_packed_documents_train_the_same(train_tiny, one_device, documents, mesh):
    losses = train_tiny(*MODEL, *documents, *MESHES[mesh], "per_device_batch_size=1")["losses"]
    np.testing.assert_allclose(losses, one_device["packed"], rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,window,chunk", [  # each mesh, window and chunk once
    ("context8", 24, 4), ("context4xfsdp2", 0, 512)],
    ids=["context8-window24-chunks-of-4", "context4xfsdp2-causal-one-chunk"])
def test_ring_attention_trains_as_one_device(train_tiny, tmp_path_factory, one_device, documents, mesh, window,
                                             chunk, monkeypatch):
    """context_parallel_strategy=ring, load-balanced, on packed documents: the 5 losses of one device. A
    window of 24 is longer than a device's runs of positions (4 or 8) + 1, so the ring carries it, not the
    neighbour exchange; chunks of 4 cut each step into scans of 4 x 4 pairs and skip the hidden ones."""
    from maxtrain.parallel import ring
    monkeypatch.setattr(ring, "CHUNK", chunk)
    windowed = (f"sliding_window_size={window}",) if window else ()
    losses = train_tiny(*MODEL, *documents, *windowed, *MESHES[mesh], "per_device_batch_size=1",
                        "context_parallel_strategy=ring")["losses"]
    expected = reference_losses(tmp_path_factory, *documents, *windowed) if window else one_device["packed"]
    assert len(losses) == 5
    np.testing.assert_allclose(losses, expected, rtol=RTOL)


@pytest.mark.slow
def test_the_ring_passes_blocks_and_gathers_no_sequence(tiny_config):
    """The compiled train step, context 8 (each device 8 of 64 positions of 8 rows, 8 kv heads of 8): under
    the ring, keys and values move as a device's block, f32[8,8,8,8], in collective-permutes (7 steps
    forward, 7 + 1 back, keys and values each, at least), and no [8,64,8,8] whole-sequence block is ever
    gathered; under all_gather the same step gathers them."""
    import re

    def collectives(strategy, op):
        c = tiny_config(*MODEL, *MESHES["context8"], "per_device_batch_size=1", "base_num_decoder_layers=1",
                        f"context_parallel_strategy={strategy}")
        hlo = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices())).compile_train_step().as_text()
        return re.findall(rf"= (\w+\[[\d,]*\])\S* {op}\(", hlo)
    assert "f32[8,64,8,8]" in collectives("all_gather", "all-gather")
    assert "f32[8,64,8,8]" not in collectives("ring", "all-gather")
    assert collectives("ring", "collective-permute").count("f32[8,8,8,8]") >= 2 * (7 + 8)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,mesh,balance", [  # each kernel and each layout once, on the mesh of most axes
    ("splash", "context2xtensor2xdata2", "unbalanced"), ("tokamax_splash", "context2xtensor2xdata2", "balanced")])
def test_splash_under_context_parallelism_trains_the_same(train_tiny, tmp_path_factory, documents, kernel, mesh,
                                                          balance):
    """The Pallas kernel (interpret mode on CPU) on each device's queries against the gathered keys, its
    block map split by query shard; packed documents, so the segment ids travel too. 256 tokens: splash
    takes each device's share in blocks of 128."""
    splash = (*MODEL, *documents, "max_target_length=256", "steps=3")
    losses = train_tiny(*splash, *MESHES[mesh], *BALANCE[balance], "per_device_batch_size=1",
                        f"attention={kernel}")["losses"]
    np.testing.assert_allclose(losses, reference_losses(tmp_path_factory, *splash), rtol=RTOL)


@pytest.mark.slow
def test_gradients_equal_the_unsharded_ones(tiny_config, documents):
    """One packed batch, load-balanced over context 4 x fsdp 2: every parameter's gradient as on one device
    (of the summed loss, float32, gradients up to ~7: within 1e-4 relative or 5e-5 absolute, the summation
    order's noise)."""
    def grads(devices, *mesh):
        c = tiny_config(*MODEL, *documents, "per_device_batch_size=1", *mesh, devices=devices)
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
        from maxtrain.data import pipeline as data
        batch = next(iter(data.make_iterator(c, trainer.batch_sharding)))
        params = trainer.init(jax.random.key(0)).params
        balance = step_lib.load_balancer(c)
        grad = jax.jit(jax.grad(lambda p, b: step_lib.loss_fn(p, trainer.model, balance(b))[0]))
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            return c, jax.tree.map(np.asarray, grad(params, batch)), np.asarray(batch["segment_ids"])
    c, sharded, segments = grads(jax.devices(), *MESHES["context4xfsdp2"])
    assert c.mesh_shape["context"] == 4 and segments.max() >= 4  # several documents a row
    _, single, _ = grads(jax.devices()[:1], "per_device_batch_size=8")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5), sharded, single)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_the_load_balanced_layout_gives_every_shard_the_same_work(shards):
    """Unmasked causal query-key pairs per context shard: equal in zigzag order, not in the plain one."""
    length = 128

    def pairs(order):
        positions = jnp.asarray(order).reshape(shards, -1)  # shard i holds a contiguous run of places
        return [int(np.sum(p[:, None] >= np.arange(length)[None, :])) for p in np.asarray(positions)]
    balanced = pairs(attention.zigzag_order(length, shards))
    assert len(set(balanced)) == 1 and sum(balanced) == length * (length + 1) // 2
    assert len(set(pairs(np.arange(length)))) == shards
    assert sorted(attention.zigzag_order(length, shards)) == list(range(length))


def rules_with(**targets) -> str:
    """base.yml's logical_axis_rules with these logical names mapped elsewhere, as a key=value override."""
    rule_list = [[name, targets.get(name, target)] for name, target in config_lib.defaults()["logical_axis_rules"]]
    return json.dumps(rule_list)


# Rule sets that split a sequence's positions differently on the same context mesh (the tests' own variety)
RULE_SETS = {"default": "", "length replicated": rules_with(length=None, cache_length=None),
             "length on context and tensor": rules_with(length=["context", "tensor"], vocab=None, heads=None,
                                                        kv_heads=None, mlp=None, moe_mlp=None)}


@pytest.mark.slow
@pytest.mark.parametrize("balance", BALANCE)
def test_a_context_mesh_whose_rules_keep_sequences_whole_trains_as_one_device(train_tiny, one_device, balance):
    """context 2 x fsdp 4 with `length` mapped to nothing: no device splits a sequence, so nothing is reordered
    for load balancing (it once was, while the kernels masked by index: a wrong loss, exit 0)."""
    losses = train_tiny(*MODEL, *MESHES["context2"], *BALANCE[balance], "per_device_batch_size=1",
                        f"logical_axis_rules={RULE_SETS['length replicated']}")["losses"]
    np.testing.assert_allclose(losses, one_device["synthetic"], rtol=RTOL)


@pytest.mark.parametrize("rule_set", RULE_SETS)
@pytest.mark.parametrize("mesh", ["context2", "context4xfsdp2", "context2xtensor2xdata2"])
def test_every_caller_gets_one_answer_to_how_a_sequence_splits(tiny_config, rule_set, mesh):
    """The config's planners, the batch's sharding, the traced kernels' view, the load-balancing reorder and
    decoding all ask rules.sequence_shards."""
    from maxtrain.infer.decode import PROMPT_MULTIPLE, Engine
    from maxtrain.parallel import rules
    extra = (f"logical_axis_rules={RULE_SETS[rule_set]}",) if RULE_SETS[rule_set] else ()
    c = tiny_config(*MODEL, *MESHES[mesh], "per_device_batch_size=1", *extra)
    answer = rules.sequence_shards(c.logical_axis_rules, c.mesh_shape)
    mesh_ = mesh_lib.make_mesh(c, jax.devices())
    trainer = step_lib.build(c, mesh_)
    B, L = c.global_batch_size, c.max_target_length
    assert L // trainer.batch_sharding.shard_shape((B, L))[1] == answer
    with mesh_lib.activate(mesh_, trainer.rules):
        assert rules.length_shards() == answer
    batch = {"inputs": np.tile(np.arange(L), (B, 1))}
    reordered = not np.array_equal(step_lib.load_balancer(c)(batch)["inputs"], batch["inputs"])
    assert reordered == (answer > 1 and c.context_parallel_load_balance)
    assert Engine(c, mesh_).multiple == np.lcm(PROMPT_MULTIPLE, answer)
    expected = {"default": c.mesh_shape["context"], "length replicated": 1,
                "length on context and tensor": c.mesh_shape["context"] * c.mesh_shape["tensor"]}[rule_set]
    assert answer == expected


@pytest.mark.parametrize("overrides,message", [
    (("ici_context_parallelism=8", "ici_fsdp_parallelism=1", "max_target_length=24"),
     "max_target_length: 24 does not split into 16 equal pieces"),
    (("ici_context_parallelism=8", "ici_fsdp_parallelism=1", "max_target_length=20",
      "context_parallel_load_balance=false"), "max_target_length: 20 does not split into 8 equal pieces"),
    (("ici_context_parallelism=4", "attention=splash", "max_target_length=256"),
     "attention: splash needs each device's share of the sequence in blocks of 128: max_target_length 256 / "
     "context (4) = 64"),
    (("ici_context_parallelism=4", "loss_chunk_size=16"),
     "loss_chunk_size: 16 must divide each device's share of the sequence: max_target_length 32 / context (4) = 8"),
    (("ici_context_parallelism=8", "ici_fsdp_parallelism=1", "per_device_batch_size=0.0625"),
     "per_device_batch_size: 0.0625 x 8 devices is not a whole batch"),
    (("ici_context_parallelism=2", f"logical_axis_rules={rules_with(length='fsdp')}"),
     "logical_axis_rules: `length` splits over ['fsdp'] in ['length'] but over nothing in the token batch"),
])
def test_bad_context_settings_name_the_key(tiny_config, overrides, message):
    with pytest.raises(config_keys.ConfigError) as err:
        tiny_config(*overrides)
    assert str(err.value).startswith(message), str(err.value)


def test_a_fraction_of_a_sequence_per_device(tiny_config):
    """per_device_batch_size 0.25 with context 4 x fsdp 2: 2 sequences, each over 4 devices."""
    c = tiny_config("ici_context_parallelism=4", "ici_fsdp_parallelism=2", "per_device_batch_size=0.25")
    assert c.global_batch_size == 2 and c.mesh_shape["context"] == 4


@pytest.mark.slow
def test_chunked_loss_and_mlp_train_the_same(train_tiny, one_device):
    """Loss and MLP chunks of 8 of each device's 16 positions (context 4): each chunk takes positions from
    every device's share, and the losses are those of one device."""
    losses = train_tiny(*MODEL, *MESHES["context4xfsdp2"], "per_device_batch_size=1", "loss_chunk_size=8",
                        "mlp_chunk_size=8")["losses"]
    np.testing.assert_allclose(losses, one_device["synthetic"], rtol=RTOL)


@pytest.mark.slow
def test_mixture_of_experts_under_context_parallelism(train_tiny, tmp_path_factory):
    """The experts' shard_map takes each device's own positions; the capacity rule still counts per
    sequence and in order of position (not of the load-balanced layout): the losses of one device, with
    drops (dropless, the same shard_map without the rule, was a second case of 50 s)."""
    moe = (*MODEL, "model_family=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "capacity_factor=1.0")
    losses = train_tiny(*moe, *MESHES["context4xfsdp2"], "per_device_batch_size=1")["losses"]
    np.testing.assert_allclose(losses, reference_losses(tmp_path_factory, *moe), rtol=RTOL)


def test_splash_block_map_of_the_load_balanced_layout():
    """The mask splash builds its block map from (its shortcut for whole blocks above or below the
    diagonal) equals the plain comparison of places, block by block."""
    places = attention.zigzag_order(64, 4)
    mask = attention._placed_causal_mask_type()((64, 64), places)
    for rows in range(0, 64, 16):
        for cols in range(0, 64, 16):
            want = places[rows:rows + 16, None] >= np.arange(cols, cols + 16)[None, :]
            np.testing.assert_array_equal(mask[slice(rows, rows + 16), slice(cols, cols + 16)], want)
    assert mask[slice(0, 8), slice(56, 64)].sum() == 0 and mask[slice(56, 64), slice(0, 8)].all()


@pytest.mark.slow
@pytest.mark.parametrize("model,prompt_length", [
    (("max_target_length=256", "attention=splash"), 200),  # a 256-token buffer: splash's blocks per device
    (("model_family=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "capacity_factor=1.0"),
     62),
    (("context_parallel_strategy=ring",), 62),  # the prompt's prefill round the ring
], ids=["splash", "moe-capacity", "ring"])  # tokamax_splash: as splash, the next test
def test_generation_under_context_parallelism_matches_one_device(tiny_config, model, prompt_length):
    """Decoding's prefill is in sequence order (not training's load-balanced layout) and padded to what the
    context axis and splash take; the decode steps run on every context device alike: the same greedy tokens
    as on one device (an MoE model dropless in both, its capacity_factor a training device)."""

    def tokens(devices, *mesh):
        c = tiny_config(*model, *mesh, devices=devices)
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            params = trainer.init(jax.random.key(0)).params
        return decode(c, trainer, params, [[i % 250 + 1 for i in range(prompt_length)]], 4)[0]
    assert tokens(jax.devices(), "ici_context_parallelism=2") == tokens(jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [("ici_context_parallelism=2",)], ids=["context2xfsdp4"])
def test_tokamax_splash_decodes_the_same_greedy_tokens_as_splash(tiny_config, mesh):
    """The same parameters, prompt and greedy decoding under JAX's splash and Tokamax's (interpreted)."""
    def tokens(kernel):
        c = tiny_config("max_target_length=256", f"attention={kernel}", *mesh)
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()))
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            params = trainer.init(jax.random.key(0)).params
        return decode(c, trainer, params, [[i % 250 + 1 for i in range(200)]], 6)[0]
    assert tokens("tokamax_splash") == tokens("splash")
