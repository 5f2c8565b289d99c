"""Decoding with a KV cache (maxtrain.infer): the cache gives transformers' greedy ids and the full rerun's,
on one device and on meshes; a batch of prompts of different lengths gives each prompt its own ids; each
decode step's logits are the full forward's; sampling, eos, the compiled programs and the cache's layout.

HF models are random-weight transformers models from small configs (tests/test_convert.py, test_convert_moe.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import test_convert
import test_convert_moe
from conftest import decode
from helpers import load_maxtrain
from maxtrain import convert
from maxtrain.infer import reference
from maxtrain.infer.decode import Engine
from maxtrain.infer.kv_cache import bytes_per_slot
from maxtrain.infer.sampling import Sampling
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib

NEW = 32
PROMPTS = [[5, 17, 90, 3, 42], [7, 8], [int(x) for x in np.random.RandomState(3).randint(1, 96, 19)]]
FAMILIES = {  # dense GQA; q/k/v biases with tied embeddings; an MoE; an MoE with q/k norms
    "llama": (test_convert, "llama-gqa"), "qwen2": (test_convert, "qwen2"),
    "mixtral": (test_convert_moe, "mixtral"), "qwen3_moe": (test_convert_moe, "qwen3_moe"),
}
MESHES = {
    "1device": (1, ()),
    "fsdp4xtensor2": (8, ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")),
    "expert4xfsdp2": (8, ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2")),
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """imported(family) -> (the transformers model, its greedy ids for PROMPTS, maxtrain.yml of its import)."""
    made = {}

    def get(family):
        if family not in made:
            module, kind = FAMILIES[family]
            model = module.random_hf_model(kind)
            out = tmp_path_factory.mktemp(family)
            model.save_pretrained(out / "hf")
            yml = convert.hf_to_maxtrain(str(out / "hf"), str(out / "mt")) / "maxtrain.yml"
            greedy = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
            made[family] = model, greedy, yml
        return made[family]
    return get


# Each family on one or two meshes, each mesh with a dense and an MoE family (every pair was 12 cases, 125 s);
# the first case is the fast tier's.
SLOW_CASES = (("llama", "expert4xfsdp2"), ("qwen2", "1device"), ("mixtral", "expert4xfsdp2"), ("mixtral", "1device"),
              ("qwen3_moe", "fsdp4xtensor2"))


@pytest.mark.parametrize("family,mesh", [("llama", "fsdp4xtensor2"),
                                         *(pytest.param(*case, marks=pytest.mark.slow) for case in SLOW_CASES)])
def test_greedy_ids_with_the_cache_equal_transformers_and_the_full_rerun(imported, family, mesh):
    _, greedy, yml = imported(family)
    devices, overrides = MESHES[mesh]
    c, trainer, params = load_maxtrain(yml, *overrides, n_devices=devices)
    assert decode(c, trainer, params, PROMPTS, NEW, batch_size=3) == greedy  # one batch, left-padded
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        assert reference.full_rerun(c, trainer, params, PROMPTS[2], NEW) == greedy[2]


@pytest.mark.slow
def test_a_batch_gives_each_prompt_the_ids_it_gets_alone(imported):
    _, greedy, yml = imported("llama")
    c, trainer, params = load_maxtrain(yml, n_devices=1)
    assert [decode(c, trainer, params, [p], NEW)[0] for p in PROMPTS] == greedy
    assert decode(c, trainer, params, PROMPTS, NEW, batch_size=2) == greedy  # two batches, the last one short


def step_logits_against_full_forward(c, trainer, params, prompts, steps):
    """The largest |logit difference| between each decode step (prefill, then `steps` greedy steps, the
    prompts in one left-padded batch) and the full forward over each sequence at the same position (one
    forward over the final sequences, right-padded: causal attention makes the padding irrelevant)."""
    engine = Engine(c, trainer.mesh)
    shape = engine.shape(prompts, steps + 1, len(prompts))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        weights = engine.weights(params)
        tokens, start, _, _ = engine._batch(prompts, 0, shape)
        logits, cache = jax.jit(engine.prefill, static_argnums=3)(weights, tokens, start, shape.slots)
        step, each_step = jax.jit(engine.step), []
        for _ in range(steps + 1):
            each_step.append(np.asarray(logits)[:len(prompts)])
            chosen = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, cache = step(weights, chosen[:, None], cache)
        chosen_SxB = np.argmax(np.stack(each_step), axis=-1)
        final = np.zeros((len(prompts), max(map(len, prompts)) + steps + 1), np.int32)
        for b, p in enumerate(prompts):
            final[b, :len(p) + steps + 1] = p + chosen_SxB[:, b].tolist()
        full = np.asarray(jax.jit(trainer.model.apply)({"params": params}, final))
    return max(float(np.abs(each_step[t][b] - full[b, len(p) - 1 + t]).max())
               for t in range(steps + 1) for b, p in enumerate(prompts))


@pytest.mark.slow
@pytest.mark.parametrize("family,mesh", [("llama", "1device"), ("mixtral", "fsdp4xtensor2"),
                                         ("qwen2", "expert4xfsdp2")])
def test_each_decode_step_gives_the_full_forward_logits(imported, family, mesh):
    _, _, yml = imported(family)
    devices, overrides = MESHES[mesh]
    c, trainer, params = load_maxtrain(yml, *overrides, n_devices=devices)
    assert step_logits_against_full_forward(c, trainer, params, PROMPTS, 12) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("model_family=qwen3", "use_qk_norm=true", "logits_via_embedding=true"),
    ("rope_scaling_factor=8.0", "rope_original_max_position_embeddings=8", "rope_theta=500000.0"),
    # DeepSeek-like: a dense first layer, sigmoid routing with its bias, a shared expert
    ("model_family=deepseek", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32",
     "first_num_dense_layers=1", "shared_experts=1", "routed_score_func=sigmoid", "routed_bias=true", "routed_scaling_factor=2.5"),
], ids=["qk_norm-tied", "rope_scaling", "deepseek_like"])
def test_the_other_model_options_decode_as_the_full_forward(tiny_config, overrides):
    devices = jax.devices()[:1]
    c = tiny_config(*overrides, "max_target_length=64", devices=devices)
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        params = trainer.init(jax.random.key(0)).params
    assert step_logits_against_full_forward(c, trainer, params, [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]], 16) <= 1e-4


@pytest.mark.slow
def test_int8_decodes_through_qwix_with_the_cache(tiny_config):
    """Quantized: activations scale per call, so the cache's steps are not the full forward's bits; the
    decode runs the unrolled layers under Qwix and gives ids in the vocabulary."""
    c = tiny_config("quantization=int8", devices=jax.devices()[:1])
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        params = trainer.init(jax.random.key(0)).params
    engine = Engine(c, trainer.mesh)
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        _, decode_program = engine.compile(engine.shape([[5, 6, 7]], 8, 1), Sampling(), -1)
    assert "s8[" in decode_program.as_text()  # the projections' matmuls run on 8-bit operands
    ids = decode(c, trainer, params, [[5, 6, 7]], 8)[0]
    assert len(ids) == 8 and all(0 <= i < 256 for i in ids)


# ---- sampling ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(imported):
    _, greedy, yml = imported("llama")
    return (*load_maxtrain(yml, n_devices=1), greedy)


@pytest.mark.slow
def test_top_k_1_and_a_tiny_top_p_are_greedy(llama):
    c, trainer, params, greedy = llama
    assert decode(c, trainer, params, PROMPTS, NEW, Sampling(temperature=1.0, top_k=1, seed=3)) == greedy
    assert decode(c, trainer, params, PROMPTS, NEW, Sampling(temperature=2.0, top_p=1e-6, seed=3)) == greedy


@pytest.mark.slow
def test_a_sample_depends_on_the_seed_and_the_prompt_number_only(llama):
    c, trainer, params, _ = llama
    hot = Sampling(temperature=1.0, top_k=40, top_p=0.9, seed=7)
    batched = decode(c, trainer, params, PROMPTS, 16, hot, batch_size=3)
    assert decode(c, trainer, params, PROMPTS, 16, hot, batch_size=1) == batched  # whatever generate_batch_size
    assert decode(c, trainer, params, PROMPTS, 16, Sampling(temperature=1.0, top_k=40, top_p=0.9, seed=8)) != batched
    with mesh_lib.activate(trainer.mesh, trainer.rules):  # the same draws as the full rerun's (prompt number 0)
        assert reference.full_rerun(c, trainer, params, PROMPTS[0], 16, hot) == batched[0]


def test_top_p_keeps_the_fewest_tokens_that_reach_p():
    logits_BxV = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 256))
    keys_B = Sampling().row_keys(jnp.arange(256))
    for top_p, allowed in ((0.5, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        drawn = set(np.asarray(Sampling(temperature=1.0, top_p=top_p).choose(logits_BxV, keys_B, 0)).tolist())
        assert drawn == allowed, top_p


def test_each_sequence_stops_at_its_own_eos(llama):
    c, trainer, params, greedy = llama
    first = greedy[0]
    eos = next(t for i, t in enumerate(first) if i >= 3 and t not in first[:i])  # a first occurrence at 3 or later
    stopped = decode(c, trainer, params, PROMPTS, NEW, eos_id=eos)
    want = [ids[:ids.index(eos) + 1] if eos in ids else ids for ids in greedy]
    assert stopped == want and len(stopped[0]) < NEW


# ---- the programs and the cache -------------------------------------------------------------------

def test_one_prefill_and_one_decode_program_serve_every_prompt_length_of_a_bucket(llama):
    c, trainer, params, greedy = llama
    engine = Engine(c, trainer.mesh)
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        weights = engine.weights(params)
        assert engine.generate(weights, PROMPTS[:2], NEW, batch_size=2).ids == greedy[:2]  # 5 and 2 tokens
        assert engine.generate(weights, [[9] * 16, [4] * 11], NEW, batch_size=2).ids  # 16 and 11: the same bucket
        assert len(engine._compiled) == 1
        engine.generate(weights, [[9] * 17, [4] * 11], NEW, batch_size=2)  # 17: the next bucket
        assert len(engine._compiled) == 2


def test_the_cache_splits_rows_over_batch_then_kv_heads_and_costs_its_formula(imported):
    _, _, yml = imported("llama")
    c, trainer, params = load_maxtrain(yml, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    engine = Engine(c, trainer.mesh)
    shape = engine.shape(PROMPTS, NEW, 3)
    assert (shape.rows, shape.prompt_slots, shape.slots) == (4, 32, 64)  # 3 prompts on 4 fsdp shards; 32 + 31 padded
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        tokens, start, _, _ = engine._batch(PROMPTS, 0, shape)
        _, cache = jax.jit(engine.prefill, static_argnums=3)(engine.weights(params), tokens, start, shape.slots)
    keys = cache.keys[0]
    assert keys.shape == (4 * 2, shape.slots, 16) and tuple(keys.sharding.spec)[:1] == (("fsdp", "tensor"),)
    assert all(axes is None for axes in tuple(keys.sharding.spec)[1:])
    total = sum(x.nbytes for x in (*cache.keys, *cache.values))
    assert total == c.base_num_decoder_layers * shape.rows * shape.slots * bytes_per_slot(engine.args)
    assert bytes_per_slot(engine.args) == 2 * 2 * 16 * 4  # keys and values, 2 kv heads of 16, float32
    assert np.asarray(start).tolist() == [27, 30, 13, 27]  # left-padded to 32; the unused row copies the first


@pytest.mark.slow
def test_under_context_parallelism_the_cache_slots_split_over_the_context_axis(tiny_config):
    """The rule cache_length -> context: each context device holds and scores its share of the slots (the
    softmax's sums are reduced across them), with one device's ids."""
    def run(devices, *mesh):
        c = tiny_config("max_target_length=64", *mesh, devices=devices)
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            params = trainer.init(jax.random.key(0)).params
        engine = Engine(c, trainer.mesh)
        shape = engine.shape(PROMPTS, 20, 2)
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            tokens, start, _, _ = engine._batch(PROMPTS[:2], 0, shape)
            _, cache = jax.jit(engine.prefill, static_argnums=3)(engine.weights(params), tokens, start, shape.slots)
        return decode(c, trainer, params, PROMPTS, 20, batch_size=2), shape, cache.keys[0].sharding.spec
    alone, _, _ = run(jax.devices()[:1])
    split, shape, spec = run(jax.devices(), "ici_context_parallelism=4", "ici_fsdp_parallelism=2")
    assert split == alone
    assert shape.slots % 4 == 0 and tuple(spec)[:2] == ("fsdp", "context")


@pytest.mark.slow
def test_the_prefill_runs_through_each_training_kernel(tiny_config):
    """A 300-token prompt: blockwise's blocks of 256 queries, jax_nn, dot_product give the same ids."""
    long_prompt = [int(x) for x in np.random.RandomState(5).randint(1, 256, 300)]
    ids = {}
    for kernel in ("dot_product", "blockwise", "jax_nn"):
        c = tiny_config("max_target_length=512", f"attention={kernel}", devices=jax.devices()[:1])
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
        with mesh_lib.activate(trainer.mesh, trainer.rules):
            params = trainer.init(jax.random.key(0)).params
        ids[kernel] = decode(c, trainer, params, [long_prompt, [1, 2]], 8, batch_size=2)
    assert ids["blockwise"] == ids["dot_product"] == ids["jax_nn"]
