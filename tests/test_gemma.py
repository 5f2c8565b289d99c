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

from conftest import decode
from helpers import TOLERANCE, hf_logits, load_maxtrain, maxtrain_logits, norms_about_one, random_hf

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
    """Every tensor random; Gemma's norms scale by 1 + weight, so theirs are about 0."""
    values = (lambda name: (0.0, 0.1)) if kind.startswith("gemma") else norms_about_one
    return random_hf(lambda config: MODELS[kind]().float(), None, values)


def imported(tmp_path, kind, *overrides):
    model = random_model(kind)
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=overrides)
    return model, out


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "mistral-window"])
def test_greedy_generation_matches_transformers(tmp_path, kind):
    model, out = imported(tmp_path, kind)
    c, trainer, params = load_maxtrain(out / "maxtrain.yml")
    prompt = [5, 17, 90, 3, 42, 11, 60, 7]  # and 16 new tokens: well past the window of 6
    ours = decode(c, trainer, params, [prompt], 16)[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours) == 16 and ours == ref


# Sequences of 32 over windows of 8: sliding layers slide; 4 layers, every 2nd global (gemma3-tiny's own
# pattern is 5:1 over 6 layers).
MESH_MODELS = {"gemma3-tiny": ("model_name=gemma3-tiny", "sliding_window_size=8", "global_layer_interval=2",
                               "base_num_decoder_layers=4"),
               "mistral-window": ("sliding_window_size=8",)}
MESHES = {"fsdp4xtensor2": ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
          "expert4xfsdp2": ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2")}


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh", [("gemma3-tiny", "fsdp4xtensor2"), ("mistral-window", "expert4xfsdp2")])
def test_the_same_losses_on_every_mesh(train_tiny, reference_losses, model, mesh):
    """5 steps of training in float32 on 1 device and on 8-device meshes: the same sums in other orders."""
    keys = (*MESH_MODELS[model], "dtype=float32")
    one = reference_losses(*keys, "per_device_batch_size=8")
    assert len(one) == 5 and one[-1] < one[0]
    losses = train_tiny(*keys, *MESHES[mesh], f"run_name={mesh}")["losses"]
    np.testing.assert_allclose(losses, one, rtol=1e-5, err_msg=mesh)


@pytest.mark.slow
def test_the_fused_loss_with_a_final_soft_cap_matches_autodiff():
    import jax
    import jax.numpy as jnp
    from maxtrain.training.loss import cross_entropy_loss
    rng = np.random.RandomState(0)
    x, w = jnp.asarray(rng.randn(2, 8, 16), jnp.float32), jnp.asarray(rng.randn(16, 128), jnp.float32)
    targets, weights = jnp.asarray(rng.randint(0, 100, (2, 8))), jnp.ones((2, 8), jnp.float32)

    def reference(x, w):
        logits = 3.0 * jnp.tanh((x @ w) / 3.0)
        logits = jnp.where(jnp.arange(128) < 100, logits, -jnp.inf)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        return jnp.sum(log_z - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])

    for chunk in (8, 4):
        fused = lambda x, w: cross_entropy_loss(x, w, targets, weights, chunk, True, vocab=100, softcap=3.0)[0]  # noqa: E731
        np.testing.assert_allclose(fused(x, w), reference(x, w), rtol=1e-5)
        for ours, theirs in zip(jax.grad(fused, (0, 1))(x, w), jax.grad(reference, (0, 1))(x, w)):
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_gemma_trains_with_chunks_and_int8(train_tiny):
    """A Gemma 2-like tiny model (soft caps, alternating windows): the loss and MLP in chunks give the same
    losses; int8 matmuls (Qwix, the attention and MLP projections) train too."""
    keys = ("model_name=gemma3-tiny", "use_qk_norm=false", "local_rope_theta=-1", "attn_logit_softcapping=20",
            "final_logit_softcapping=10", "sliding_window_size=8", "global_layer_interval=2",
            "base_num_decoder_layers=2")
    plain = train_tiny(*keys, "run_name=plain")["losses"]
    chunked = train_tiny(*keys, "loss_chunk_size=8", "mlp_chunk_size=8", "run_name=chunked")["losses"]
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    int8 = train_tiny(*keys, "quantization=int8", "run_name=int8")["losses"]
    assert np.all(np.isfinite(int8)) and int8[-1] < int8[0]
    assert np.abs(np.asarray(int8) - plain).max() > 0  # the matmuls really were quantized
