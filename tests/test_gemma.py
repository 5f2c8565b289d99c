"""Gemma 3, Gemma 2 and windowed Mistral against transformers: random-weight models from small configs,
float32; sequences longer than the window, so the sliding layers really slide (and the global ones, with
their own RoPE, really see everything)."""

import numpy as np
import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, MistralConfig, MistralForCausalLM)

from maxtrain import convert
from maxtrain.config import load as config_lib
from maxtrain.models import hf as hf_format, registry
from maxtrain.runtime.errors import ConvertError

from test_convert import TOLERANCE, hf_logits, load_maxtrain, maxtrain_logits

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256)
WINDOW = 6
MODELS = {
    # 5 sliding layers to 1 global, RoPE 10000 on the sliding ones and 1e6 linearly scaled on the global ones,
    # a query scale that is not head_dim's
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **SMALL, num_hidden_layers=7, sliding_window=WINDOW, query_pre_attn_scalar=24, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "gemma3-untied": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **SMALL, num_hidden_layers=3, sliding_window=WINDOW, tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    # alternating, soft caps on the scores and the logits
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(
        **SMALL, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0)),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(
        **SMALL, num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False, rms_norm_eps=1e-5)),
}
TOKENS = np.random.RandomState(0).randint(0, SMALL["vocab_size"], (4, 4 * WINDOW))


def random_model(kind):
    torch.manual_seed(0)
    model = MODELS[kind]().float().eval()
    with torch.no_grad():  # norms and biases randomized too, so every mapping is exercised
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name and kind.startswith("gemma")
                    else 1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def imported(tmp_path, kind, *overrides):
    model = random_model(kind)
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=overrides)
    return model, out


@pytest.mark.parametrize("kind,scan", [("gemma3", True), ("gemma3", False), ("gemma3-untied", True),
                                       ("gemma2", True), ("mistral-window", True), ("mistral-window", False)])
def test_imported_model_gives_hf_logits(tmp_path, kind, scan):
    model, out = imported(tmp_path, kind, f"scan_layers={scan}")
    c, trainer, params = load_maxtrain(out / "maxtrain.yml")
    assert c.sliding_window_size == WINDOW
    ours = maxtrain_logits(trainer, params, TOKENS)
    ref = hf_logits(model, TOKENS)
    assert np.abs(ref).max() > 1.0
    assert np.abs(ours - ref).max() <= TOLERANCE
    # the window matters here: transformers' same model without it gives other logits
    model.config.sliding_window = 10 * TOKENS.shape[1]
    assert np.abs(hf_logits(model, TOKENS) - ref).max() > 100 * TOLERANCE


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "mistral-window"])
def test_export_reloads_in_transformers_with_the_same_logits(tmp_path, kind):
    model, out = imported(tmp_path, kind)
    convert.maxtrain_to_hf(str(out), str(tmp_path / "back"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(model)
    assert again.config.layer_types == model.config.layer_types if kind != "mistral-window" else True
    want, got = model.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    np.testing.assert_allclose(hf_logits(again, TOKENS), hf_logits(model, TOKENS), atol=1e-6)


def test_fresh_gemma_exports_without_a_source(tmp_path, train_tiny):
    train_tiny("enable_checkpointing=true", "steps=2", "model_name=gemma3-tiny", "dtype=float32")
    convert.maxtrain_to_hf(str(tmp_path / "tiny" / "checkpoints" / "2"), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model) is Gemma3ForCausalLM
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert model.config.sliding_window == 32


def test_layer_types_outside_the_pattern_are_refused():
    config = Gemma3TextConfig(**SMALL, num_hidden_layers=4,
                              layer_types=["full_attention", "sliding_attention", "full_attention",
                                           "sliding_attention"]).to_dict()
    with pytest.raises(ConvertError, match="layer_types .* is not supported"):
        hf_format.model_keys_from_hf(config)


def test_gemma_export_refuses_a_partial_gemma():
    c = config_lib.load([str(config_lib.BASE_YML), "model_name=gemma3-tiny", "use_post_ffw_norm=false"])
    with pytest.raises(ConvertError, match="use_post_ffw_norm=False: every Gemma has True"):
        hf_format.hf_kind(dict(c))


def test_a_variant_llama_cannot_carry_is_refused_at_export():
    c = config_lib.load([str(config_lib.BASE_YML), "attention_sinks=true"])
    assert registry.spec_for(dict(c)).name == "llama"
    with pytest.raises(ConvertError, match="attention_sinks=True: no HF model of this family"):
        hf_format.hf_kind(dict(c))
