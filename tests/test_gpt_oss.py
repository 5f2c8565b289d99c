"""gpt-oss (maxtrain/models/gpt_oss.py): its MoE block (router logit bias, expert biases, clamped SwiGLU)
against a per-token reference through every grouped matmul and mesh; HF import/export with logits parity
against transformers' GptOssForCausalLM; greedy generation; the same losses on every mesh; presets."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file as load_torch
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM

from maxtrain import convert
from maxtrain.config import load as config_lib
from maxtrain.models import hf as hf_format, registry
from maxtrain.models.decoder import Decoder
from maxtrain.ops import grouped_matmul as gmm
from maxtrain.runtime.errors import ConvertError

from conftest import decode
from helpers import TOLERANCE, hf_logits, maxtrain_logits, norms_about_one, random_hf
from test_convert_moe import load_maxtrain
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
    out, limit = np.zeros_like(xs), args.moe.expert.limit
    for t, x_t in enumerate(xs):
        logits = x_t @ p["router"] + p["router_logit_bias"]
        chosen = np.argsort(-logits)[:args.moe.experts_per_token]
        weights = np.exp(logits[chosen] - logits[chosen].max())
        for e, w in zip(chosen, weights / weights.sum()):
            gate = np.minimum(x_t @ p["wi_gate"][e] + p["bi_gate"][e], limit)
            up = np.clip(x_t @ p["wi_up"][e] + p["bi_up"][e], -limit, limit)
            h = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            out[t] += w * (h @ p["wo"][e] + p["bo"][e])
    return out.reshape(x.shape)


@pytest.mark.slow
@pytest.mark.parametrize("method,mesh", [  # each method on two meshes, each mesh with two methods
    ("blocked", None), ("blocked", "expert2xtensor2xdata2"), ("ragged_dot", "expert4xfsdp2"), ("ragged_dot", None),
    ("tokamax", "expert2xtensor2xdata2"), ("tokamax", "expert4xfsdp2")])
def test_moe_block_equals_the_reference(tiny_config, method, mesh):
    args, c = block_args(tiny_config, *GPT_OSS_MOE, *mesh_overrides(MESHES[mesh or "expert1"]),
                         moe_grouped_matmul=method)
    x = random_x(args)
    params = randomized(init_block(args, x))
    assert {"router_logit_bias", "bi_gate", "bi_up", "bo"} <= set(params)
    out = apply_block(args, params, x, c, MESHES[mesh] if mesh else None)
    np.testing.assert_allclose(out, gpt_oss_reference(args, params, x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
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


@pytest.mark.slow
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
    for method in ("megablox", "blocked", "ragged_dot", "tokamax"):
        y = np.asarray(gmm.grouped_matmul(x, w, sizes, method, b))
        assert not np.any(y[228:]), method
        np.testing.assert_allclose(y[:100], np.asarray(x[:100] @ w[1] + b[1]), atol=1e-3)


# ---------------------------------------------------------------------------------------------
# HF import/export against transformers' GptOssForCausalLM

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
             max_position_embeddings=256, swiglu_limit=0.6, rms_norm_eps=1e-5, router_aux_loss_coef=0.02,
             rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "beta_fast": 8.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
TOKENS = np.random.RandomState(0).randint(0, SMALL["vocab_size"], (4, 24))  # 3 windows long


def random_gpt_oss(**overrides):
    """Every tensor random: norms about 1, the sinks about 0.5, the rest (every bias included) about 0.1."""
    return random_hf(GptOssForCausalLM, GptOssConfig(**{**SMALL, **overrides}, attn_implementation="eager"),
                     lambda name: (0.0, 0.5) if "sinks" in name else norms_about_one(name))


def test_save_pretrained_layout():
    """What the tensor table rests on: one tensor per kind for all experts, gate and up interleaved."""
    model = random_gpt_oss()
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 96)
    assert state["model.layers.0.mlp.experts.gate_up_proj_bias"].shape == (4, 96)
    assert state["model.layers.0.mlp.experts.down_proj"].shape == (4, 48, 64)
    assert state["model.layers.0.self_attn.sinks"].shape == (4,)
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2


@pytest.mark.slow
@pytest.mark.parametrize("scan,matmul,attention", [(True, "blocked", "dot_product"),
                                                   (False, "ragged_dot", "blockwise")])
def test_imported_model_gives_hf_logits(tmp_path, scan, matmul, attention):
    model = random_gpt_oss()
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=(f"scan_layers={scan}",))
    c, trainer, params = load_maxtrain(out / "maxtrain.yml", f"moe_grouped_matmul={matmul}", f"attention={attention}")
    assert (c.sliding_window_size, c.global_layer_interval, c.rope_type, c.mlp_activation_limit) == (8, 2, "yarn", 0.6)
    assert c.attention_sinks and c.mlp_bias and c.router_logit_bias and c.qkv_bias and c.attention_out_bias
    ours = maxtrain_logits(trainer, params, TOKENS)
    ref = hf_logits(model, TOKENS)
    assert np.abs(ref).max() > 1.0
    assert np.abs(ours - ref).max() <= TOLERANCE


@pytest.mark.slow
def test_the_window_the_clamps_and_yarn_each_matter(tmp_path):
    """The parity above is no accident of small inputs: without the window, the clamps or yarn, the logits move."""
    model = random_gpt_oss()
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    _, trainer, params = load_maxtrain(out / "maxtrain.yml")
    ref, args = hf_logits(model, TOKENS), trainer.model.args
    clamps = {"moe": dataclasses.replace(args.moe, expert=dataclasses.replace(args.moe.expert, limit=7.0))}
    no_window = {"attention": dataclasses.replace(args.attention, window=None)}
    for change in (no_window, clamps, {"rope": dataclasses.replace(args.rope, factor=1.0)}):
        changed = dataclasses.replace(trainer, model=Decoder(dataclasses.replace(args, **change)))
        assert np.abs(maxtrain_logits(changed, params, TOKENS) - ref).max() > 1e-2, change


def test_export_reloads_in_transformers_with_identical_weights(tmp_path):
    model = random_gpt_oss(bos_token_id=7, eos_token_id=[8, 9])
    model.save_pretrained(tmp_path / "hf")
    convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    convert.maxtrain_to_hf(str(tmp_path / "mt"), str(tmp_path / "back"))
    original, exported = load_torch(tmp_path / "hf" / "model.safetensors"), load_torch(
        tmp_path / "back" / "model.safetensors")
    assert set(exported) == set(original)
    for name, x in original.items():
        assert torch.equal(exported[name], x), name
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is GptOssForCausalLM and again.config.eos_token_id == [8, 9]
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


def test_export_without_an_hf_source_writes_gpt_oss(tmp_path):
    model = random_gpt_oss()
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=("scan_layers=false",))
    shutil.rmtree(out / "hf")  # as if trained from scratch: no HF config to carry over
    convert.maxtrain_to_hf(str(out), str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("gpt_oss", ["GptOssForCausalLM"])
    assert written["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert written["rope_parameters"] == {**SMALL["rope_parameters"], "rope_type": "yarn"}
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


@pytest.mark.slow
def test_greedy_generation_matches_transformers(tmp_path):
    model = random_gpt_oss()
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    c, trainer, params = load_maxtrain(out / "maxtrain.yml")
    prompt = [5, 17, 90, 3, 42]  # 21 positions in all: past the window
    ours = decode(c, trainer, params, [prompt], 16)[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours) == 16 and ours == ref


@pytest.mark.parametrize("change,message", [
    ({"swiglu_alpha": 1.5}, "config.json: swiglu_alpha=1.5 is not supported (maxtrain's clamped SwiGLU has 1.702)"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2},
     "config.json: layer_types ['full_attention', 'sliding_attention', 'full_attention', 'sliding_attention'] is not "
     "supported (maxtrain's gpt-oss alternates sliding_attention and full_attention, starting with sliding_attention)"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "attention_factor": 2.0}},
     "config.json: yarn attention_factor=2.0 is not supported (cos and sin scale by 0.1 ln(factor) + 1, or as "
     "mscale and mscale_all_dim say)"),
])
def test_unsupported_configs_are_refused_in_one_line(tmp_path, change, message):
    hf = {"model_type": "gpt_oss", **SMALL, **change}
    with pytest.raises(ConvertError) as e:
        hf_format.model_keys_from_hf(hf)
    assert str(e.value) == message


@pytest.mark.parametrize("change,message", [
    (("mlp_bias=false",), "mlp_bias=False: HF's gpt-oss has True"),
    (("attention_out_bias=false",), "qkv_bias=True with attention_out_bias=False: HF's gpt-oss has both or neither "
                                    "(attention_bias)"),
    (("global_layer_interval=3",), "global_layer_interval=3: HF's gpt-oss alternates sliding and full layers (2), "
                                   "or slides in all (0)"),
])
def test_export_refuses_what_gpt_oss_cannot_express(change, message):
    c = config_lib.load([str(config_lib.BASE_YML), "model_name=gpt-oss-tiny", *change])
    with pytest.raises(ConvertError) as e:
        hf_format.hf_kind(c)
    assert str(e.value) == message


# ---------------------------------------------------------------------------------------------
# The family and its presets


def test_the_family_counts_its_parameters_as_its_model_and_transformers_do(tiny_config):
    from test_registry import built_count, transformers_count
    c = tiny_config("model_name=gpt-oss-tiny", "vocab_size=200")
    spec = registry.spec_for(c)
    assert spec.name == "gpt_oss" and spec.priority > registry.family("deepseek").priority
    assert registry.family("deepseek").matches(c)  # q/k/v biases: deepseek's predicate claims it too, lower
    assert hf_format.hf_kind(dict(c)) == "gpt_oss" and registry.by_hf_type("gpt_oss") is spec
    assert spec.count_params(c, False) == c.num_params == built_count(c) == transformers_count(c)
    # a token uses its top-k experts and their biases; the router and its bias it uses whole
    unused = c.base_num_decoder_layers * (c.num_experts - c.num_experts_per_tok) * (
        3 * c.base_emb_dim * c.base_mlp_dim + 2 * c.base_mlp_dim + c.base_emb_dim)
    assert c.num_active_params == c.num_params - unused


def test_biases_and_sinks_take_no_weight_decay_and_all_train():
    spec = registry.family("gpt_oss")
    mlp = {"router": 1, "router_logit_bias": 1, "wi_gate": 1, "bi_gate": 1, "bi_up": 1, "wo": 1, "bo": 1}
    params = {"moe_layers": {"mlp": mlp, "attention": {"sinks": 1, "bo": 1, "bq": 1, "wq": 1}}}
    decayed = spec.decayed(params)["moe_layers"]
    assert {k for k, v in decayed["mlp"].items() if v} == {"router", "wi_gate", "wo"}
    assert {k for k, v in decayed["attention"].items() if v} == {"wq"}
    assert all(jax.tree.leaves(spec.trained(params)))



# ---------------------------------------------------------------------------------------------
# Training on every mesh

GPT_OSS_TINY = ("model_family=gpt_oss", "num_experts=4", "num_experts_per_tok=2", "norm_topk_prob=true", "qkv_bias=true",
                "attention_out_bias=true", "attention_sinks=true", "sliding_window_size=8", "global_layer_interval=2",
                "rope_type=yarn", "rope_scaling_factor=4.0", "rope_original_max_position_embeddings=16",
                "rope_yarn_truncate=false", *GPT_OSS_MOE)
# expert, tensor and fsdp in one mesh (each a run of 40 to 70 s; a fault of any shows here)
MESH_RUNS = {"expert2xtensor2xfsdp2": ("ici_expert_parallelism=2", "ici_tensor_parallelism=2",
                                       "ici_fsdp_parallelism=2")}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESH_RUNS))
def test_the_same_losses_on_every_mesh(train_tiny, reference_losses, mesh):
    """5 steps of training, float32, sequences of 4 windows: one device, and expert 2 x tensor 2 x fsdp 2."""
    one = reference_losses(*GPT_OSS_TINY, "per_device_batch_size=8")
    assert len(one) == 5 and one[-1] < one[0]
    losses = train_tiny(*GPT_OSS_TINY, *MESH_RUNS[mesh], f"run_name={mesh}")["losses"]
    np.testing.assert_allclose(losses, one, rtol=1e-5, err_msg=mesh)
