"""Llama 4 (maxtrain/models/llama4.py): HF import/export with logits parity against transformers'
Llama4ForCausalLM (sequences three chunks long, every tensor random, RoPE and NoPE layers, temperature
tuning within reach), greedy generation through the KV cache, the same losses on every mesh, its presets."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file as load_torch
from transformers import AutoModelForCausalLM, Llama4ForCausalLM, Llama4TextConfig

from maxtrain import convert
from maxtrain.config import load as config_lib
from maxtrain.models import hf as hf_format, registry
from maxtrain.models.decoder import Decoder
from maxtrain.ops import attention
from maxtrain.runtime.errors import ConfigError, ConvertError

from conftest import decode
from helpers import TOLERANCE, hf_logits, maxtrain_logits, random_hf
from test_convert_moe import load_maxtrain

# top-2 of 4 experts (Scout and Maverick route top-1: two make the input scaling per assignment matter),
# chunks of 8, temperature from position 3 on, llama3 RoPE with Scout's equal frequency factors
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             attention_chunk_size=8, floor_scale=4, attn_scale=0.5, max_position_embeddings=256, rms_norm_eps=1e-5,
             router_aux_loss_coef=0.02, bos_token_id=1, eos_token_id=2,
             rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 1.0, "original_max_position_embeddings": 16})
TOKENS = np.random.RandomState(0).randint(3, SMALL["vocab_size"], (4, 24))  # 3 chunks long


def random_llama4(**overrides):
    return random_hf(Llama4ForCausalLM, Llama4TextConfig(**{**SMALL, **overrides}, attn_implementation="eager"))


def imported(tmp_path, model, *overrides):
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=overrides)
    return out, *load_maxtrain(out / "maxtrain.yml")


def test_save_pretrained_layout():
    """What the tensor table rests on: fused experts as x @ W, a shared expert, NoPE every 4th layer."""
    model = random_llama4()
    state = model.state_dict()
    assert state["model.layers.0.feed_forward.experts.gate_up_proj"].shape == (4, 64, 64)
    assert state["model.layers.0.feed_forward.experts.down_proj"].shape == (4, 32, 64)
    assert state["model.layers.0.feed_forward.router.weight"].shape == (4, 64)
    assert state["model.layers.0.feed_forward.shared_expert.gate_proj.weight"].shape == (32, 64)
    assert model.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert model.config.no_rope_layers == [1, 1, 1, 0]


@pytest.mark.slow
@pytest.mark.parametrize("scan,matmul,kernel,step", [
    (True, "blocked", "dot_product", 1), (False, "ragged_dot", "blockwise", 1), (True, "blocked", "blockwise", 2),
    (False, "blocked", "dot_product", 2)],
                         ids=["scanned", "unrolled", "interleaved-scanned", "interleaved-unrolled"])
def test_imported_model_gives_hf_logits(tmp_path, scan, matmul, kernel, step):
    """Every layer an MoE (Scout), or every 2nd with dense layers between (Maverick's interleave)."""
    model = random_llama4(interleave_moe_layer_step=step)
    _, c, trainer, params = imported(tmp_path, model, f"scan_layers={scan}")
    assert registry.spec_for(c).name == "llama4"
    assert (c.nope_layer_interval, c.chunk_attn_window_size, c.use_qk_l2_norm, c.temperature_tuning) == (
        4, 8, True, True)
    assert (c.base_mlp_dim, c.base_moe_mlp_dim, c.shared_experts, c.routed_score_func) == (48, 32, 1, "sigmoid")
    assert c.interleave_moe_layer_step == step
    _, trainer, params = load_maxtrain(tmp_path / "mt" / "maxtrain.yml", f"moe_grouped_matmul={matmul}",
                                       f"attention={kernel}")
    ours, ref = maxtrain_logits(trainer, params, TOKENS), hf_logits(model, TOKENS)
    assert np.abs(ref).max() > 0.5
    assert np.abs(ours - ref).max() <= TOLERANCE


@pytest.mark.slow
def test_the_chunks_the_temperature_the_l2_norm_and_the_input_scaling_each_matter(tmp_path):
    """The parity above is no accident: without any one of Llama 4's own pieces, the logits move."""
    model = random_llama4()
    _, _, trainer, params = imported(tmp_path, model)
    ref, args = hf_logits(model, TOKENS), trainer.model.args
    at = args.attention
    for change in ({"attention": dataclasses.replace(at, chunk=0)},
                   {"attention": dataclasses.replace(at, temperature_tuning=False)},
                   {"attention": dataclasses.replace(at, l2_norm=False)},
                   {"moe": dataclasses.replace(args.moe, scale_input=False)}):
        changed = dataclasses.replace(trainer, model=Decoder(dataclasses.replace(args, **change)))
        assert np.abs(maxtrain_logits(changed, params, TOKENS) - ref).max() > 1e-2, change


@pytest.mark.parametrize("step,scan", [(1, True), (2, True), (2, False)])
def test_export_is_bitwise_and_reloads_in_transformers(tmp_path, step, scan):
    model = random_llama4(interleave_moe_layer_step=step)
    out, *_ = imported(tmp_path, model, f"scan_layers={scan}")
    convert.maxtrain_to_hf(str(out), str(tmp_path / "back"))
    original, exported = load_torch(tmp_path / "hf" / "model.safetensors"), load_torch(
        tmp_path / "back" / "model.safetensors")
    assert set(exported) == set(original)
    for name, x in original.items():
        assert torch.equal(exported[name], x), name
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert type(again) is Llama4ForCausalLM
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["no_rope_layers"] == [1, 1, 1, 0] and written["attention_chunk_size"] == 8
    assert written["moe_layers"] == list(range(step - 1, 4, step))
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("step", [2])  # MoE and dense layers interleaved: every layer of both kinds
def test_greedy_generation_matches_transformers(tmp_path, step):
    model = random_llama4(interleave_moe_layer_step=step)
    _, c, trainer, params = imported(tmp_path, model)
    prompt = [5, 17, 90, 3, 42]  # 37 positions in all: past four chunk boundaries
    ours = decode(c, trainer, params, [prompt], 32)[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours) == 32 and ours == ref


def test_a_chunk_sees_its_own_keys_only():
    """chunk_segments against the definition: a query at p sees the keys from C x floor(p / C) to p, per
    document (positions restart at each)."""
    segment_ids = np.array([[1] * 11 + [2] * 9])
    positions = np.concatenate([np.arange(11), np.arange(9)])[None]
    chunked = attention.chunk_segments(segment_ids, positions, 4)
    seen = np.asarray(attention.document_mask(positions, positions, chunked, chunked, 4))[0, 0]
    q, k = np.meshgrid(np.arange(20), np.arange(20), indexing="ij")
    want = (segment_ids[0][q] == segment_ids[0][k]) & (positions[0][k] <= positions[0][q]) & (
        positions[0][k] >= 4 * (positions[0][q] // 4))
    np.testing.assert_array_equal(seen, want)


@pytest.mark.parametrize("change,message", [
    ({"moe_layers": [0, 3]}, "config.json: moe_layers [0, 3] is not supported (maxtrain's Llama 4 has every Nth layer "
                             "a mixture of experts, N dividing num_hidden_layers: Scout 1, Maverick 2)"),
    ({"no_rope_layers": [1, 0, 1, 1]}, "config.json: no_rope_layers [1, 0, 1, 1] is not supported (maxtrain's "
                                       "Llama 4 has every Nth layer without RoPE)"),
])
def test_unsupported_configs_are_refused_in_one_line(change, message):
    with pytest.raises(ConvertError) as e:
        hf_format.model_keys_from_hf({"model_type": "llama4_text", **SMALL, **change})
    assert str(e.value) == message


@pytest.mark.parametrize("change,message", [
    (("norm_topk_prob=true",), "norm_topk_prob=True: Llama 4 has False (HF export needs it)"),
    (("shared_experts=2",), "shared_experts=2: Llama 4 has 1 (HF export needs it)"),
    (("mlp_bias=true",), "mlp_bias=True: no HF model of this family (llama4_text) has it (HF export needs False)"),
    (("chunk_attn_window_size=0",), "chunk_attn_window_size=0: HF's Llama 4 chunks its RoPE layers' attention "
                                    "(export needs a chunk)"),
])
def test_export_refuses_what_llama4_cannot_express(change, message):
    c = config_lib.load([str(config_lib.BASE_YML), "model_name=llama4-tiny", *change])
    with pytest.raises(ConvertError) as e:
        hf_format.hf_kind(c)
    assert str(e.value) == message


@pytest.mark.parametrize("change,key", [
    (("nope_layer_interval=0",), "model_family"),  # llama4 needs nope_layer_interval > 0
    (("use_qk_norm=true",), "use_qk_norm"),
    (("nope_layer_interval=9",), "nope_layer_interval"),
    (("ici_pipeline_parallelism=2",), "nope_layer_interval"),
])
def test_config_refuses_what_llama4_layers_cannot_do(change, key):
    with pytest.raises(ConfigError) as e:
        config_lib.load([str(config_lib.BASE_YML), "model_name=llama4-tiny", *change])
    assert e.value.key == key


def test_the_family_counts_its_parameters_as_its_model_and_transformers_do(tiny_config):
    from test_registry import built_count, transformers_count
    c = tiny_config("model_name=llama4-tiny")
    spec = registry.spec_for(c)
    assert spec.name == "llama4" and hf_format.hf_kind(dict(c)) == "llama4_text"
    assert spec.count_params(c, False) == c.num_params == built_count(c) == transformers_count(c)
    # a token uses its top-k experts; the router and the shared expert whole
    assert c.num_active_params == c.num_params - c.base_num_decoder_layers * (
        c.num_experts - c.num_experts_per_tok) * 3 * c.base_emb_dim * c.base_moe_mlp_dim


# ---------------------------------------------------------------------------------------------
# Training on every mesh

LLAMA4_TINY = ("model_name=llama4-tiny", "chunk_attn_window_size=8", "temperature_tuning_floor_scale=4",
               "interleave_moe_layer_step=2")
# expert, context and fsdp in one mesh (each a run of 50 to 80 s; a fault of any shows here)
MESH_RUNS = {"expert2xcontext2xfsdp2": ("ici_expert_parallelism=2", "ici_context_parallelism=2",
                                        "ici_fsdp_parallelism=2")}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESH_RUNS))
def test_the_same_losses_on_every_mesh(train_tiny, reference_losses, mesh):
    """5 steps of training, float32, sequences of 4 chunks, MoE and dense layers interleaved (a scanned step of
    two layers): one device, and expert 2 x context 2 x fsdp 2."""
    one = reference_losses(*LLAMA4_TINY, "per_device_batch_size=8")
    assert len(one) == 5 and one[-1] < one[0]
    losses = train_tiny(*LLAMA4_TINY, *MESH_RUNS[mesh], f"run_name={mesh}")["losses"]
    for name, run in (("one", one), (mesh, losses)):
        print(f"llama4 losses {name}: {' '.join(f'{x:.6f}' for x in run)}")  # shown with pytest -s
    np.testing.assert_allclose(losses, one, rtol=1e-5, err_msg=mesh)

