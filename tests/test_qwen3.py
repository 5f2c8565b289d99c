"""Qwen3 (dense), the family in maxtrain/models/qwen3.py: HF import with logits parity against
transformers, export back with identical weights, a trained checkpoint exported, and its parameter
counts (registry, built model, transformers, the released models)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from maxtrain.config import load as config_lib
from maxtrain import convert, train
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib
from maxtrain.runtime.errors import ConvertError
from maxtrain.models import hf, registry

from conftest import TESTS
from helpers import hf_logits, load_maxtrain, maxtrain_logits, random_hf
from test_registry import built_count, transformers_count

# Heads wider than hidden_size / heads (32 against 16), as Qwen3's 128.
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, max_position_embeddings=256,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
TOLERANCE = 1e-4  # max abs logit difference in float32
TOKENS = np.random.RandomState(0).randint(0, SMALL["vocab_size"], (8, 24))
PUBLISHED = {"qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360}  # model cards (0.6B: its embedding once)


def random_qwen3(**overrides):
    return random_hf(Qwen3ForCausalLM, Qwen3Config(**{**SMALL, **overrides}))  # q/k norms about 1 too


@pytest.mark.parametrize("tied,scan", [(False, True), (True, False)])
def test_imported_qwen3_gives_hf_logits(tmp_path, tied, scan):
    model = random_qwen3(tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=(f"scan_layers={scan}",))
    c, trainer, params = load_maxtrain(out / "maxtrain.yml")
    assert c.use_qk_norm and c.head_dim == 32 and c.logits_via_embedding == tied
    assert registry.spec_for(c).name == "qwen3"
    ours = maxtrain_logits(trainer, params, TOKENS)
    ref = hf_logits(model, TOKENS)
    assert np.abs(ref).max() > 1.0  # a meaningful comparison, not two near-zero outputs
    assert np.abs(ours - ref).max() <= TOLERANCE


def test_export_reloads_in_transformers_with_identical_weights(tmp_path):
    model = random_qwen3(bos_token_id=7, eos_token_id=8)
    model.save_pretrained(tmp_path / "hf")
    convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    convert.maxtrain_to_hf(str(tmp_path / "mt"), str(tmp_path / "back"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is Qwen3ForCausalLM
    assert (again.config.bos_token_id, again.config.eos_token_id) == (7, 8)
    want, got = model.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


@pytest.mark.slow
def test_trained_checkpoint_exports_as_qwen3_with_the_same_logits(tmp_path, train_tiny):
    result = train_tiny("enable_checkpointing=true", "steps=3", "model_family=qwen3", "use_qk_norm=true")
    convert.maxtrain_to_hf(str(tmp_path / "tiny" / "checkpoints" / "3"), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model) is Qwen3ForCausalLM  # q/k norms on a dense model, no HF source: Qwen3
    c = train.load_config([str(TESTS / "configs" / "tiny.yml"), "model_family=qwen3", "use_qk_norm=true"])
    trainer = step_lib.build(c, mesh_lib.make_mesh(c))
    tokens = np.random.RandomState(1).randint(0, c.vocab_size, (8, 32))
    ours = maxtrain_logits(trainer, result["state"].params, tokens)
    assert np.abs(ours - hf_logits(model, tokens)).max() <= TOLERANCE


def test_qwen3_counts_its_parameters_as_its_model_and_transformers_do(tiny_config):
    c = tiny_config("vocab_size=200", "model_family=qwen3", "use_qk_norm=true", "head_dim=32",
                    "logits_via_embedding=true")
    spec = registry.spec_for(c)
    assert spec.name == "qwen3" and hf.hf_kind(dict(c)) == "qwen3"
    assert spec.count_params(c, False) == c.num_params == built_count(c) == transformers_count(c)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_are_the_released_models(name):
    c = config_lib.load([str(config_lib.BASE_YML), f"model_name={name}"])
    assert registry.spec_for(c).name == "qwen3"
    assert c.num_params == PUBLISHED[name] == transformers_count(c)


def test_export_refuses_qkv_biases():
    c = config_lib.load([str(TESTS / "configs" / "tiny.yml"), "model_family=qwen3", "use_qk_norm=true",
        "qkv_bias=true"])
    with pytest.raises(ConvertError, match="qkv_bias=true: Qwen3 has no q/k/v biases"):
        hf.hf_config_for(dict(c), "float32", None, None)
