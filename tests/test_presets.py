"""Model presets: each one's parameter count equals what transformers builds from the same config (on
the meta device: nothing is allocated or downloaded), and the named models' published totals."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from maxtrain.config import load as config_lib
from maxtrain.models import hf as hf_format

# Total parameters of the released checkpoints (their safetensors metadata / model cards).
PUBLISHED = {
    "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "mistral-7b": 7_248_023_552,
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648,
    "smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "smollm2-1.7b": 1_711_376_384,
    "tinyllama-1.1b": 1_100_048_384, "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624,
    "mistral-7b-v0.1": 7_241_732_096, "gemma3-1b": 999_885_952,  # Gemma 3 4B/12B/27B are multimodal checkpoints: their text decoders are checked above
    "gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672,
}
# Released totals given only rounded (DeepSeek's model cards, its multi-token prediction depth left out):
# billions, to the digits published.
ROUNDED = {"deepseek-v3": (671, 37), "deepseek-v2-lite": (15.7, None)}
PRESETS = sorted(p.stem for p in (config_lib.CONFIG_DIR / "models").glob("*.yml"))


def test_every_published_model_has_a_preset():
    assert set(PUBLISHED) <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_parameter_count_matches_transformers(name):
    # transformers' models have no multi-token prediction depths (tests/test_registry.py counts them)
    c = config_lib.load([str(config_lib.BASE_YML), f"model_name={name}", "mtp_num_layers=0"])
    hf = hf_format.hf_config_for(dict(c), "float32", None, None)
    imported = hf_format.model_keys_from_hf(hf)  # the preset survives an HF export and import
    # (max_position_embeddings: a preset's own where it sets one; else export writes a default context)
    assert {k: v for k, v in imported.items() if k != "max_position_embeddings" or c[k]} == {
        k: c[k] for k in imported if k != "max_position_embeddings" or c[k]}
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())  # tied embeddings are counted once
    count += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))  # DeepSeek-V3's
    assert c.num_params == count
    if name in PUBLISHED:
        assert count == PUBLISHED[name]
    if name in ROUNDED:
        total, active = ROUNDED[name]
        digits = 0 if float(total).is_integer() else 1
        assert round(c.num_params / 1e9, digits) == total
        # "37B activated": 37.55B counting the embedding, 36.6B without it
        assert active is None or abs(c.num_active_params / 1e9 - active) < 1
