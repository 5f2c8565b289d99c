"""HuggingFace interop: import/export with logits parity against transformers, greedy generation,
fine-tuning from an imported checkpoint, and one-line refusals of what cannot be converted.

HF models here are random-weight transformers models built from small configs (nothing is downloaded).
Every tensor, norms and biases included, is randomized so each one's mapping is exercised.
"""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import yaml
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)


from maxtrain import convert, generate, train
from maxtrain.config import load as config_lib
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib
from maxtrain.infer.sampling import Sampling

from conftest import SHAKESPEARE, TESTS, decode
from helpers import (TOLERANCE, assert_import_refused, cpu_env, edit_hf_config, hf_logits, load_maxtrain,
                     maxtrain_logits, random_hf, save_hf)

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256)
VARIANTS = {
    "llama-gqa": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_theta=500000.0)),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None, tie_word_embeddings=False)),
    # Heads wider than hidden_size / heads: catches a swapped D and H*K in the q/o reshapes.
    "llama-wide-heads": (LlamaConfig, LlamaForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    # use_sliding_window with every layer below max_window_layers: no layer slides (as in Qwen2.5 configs).
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=True,
                                                  sliding_window=8, max_window_layers=2)),
    # Llama 3.1's RoPE scaling, with an original length short enough to matter on 24 tokens.
    "llama3.1": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


def random_hf_model(kind: str, randomize=True, **overrides):
    config_cls, model_cls, extra = VARIANTS[kind]
    config = config_cls(**{**SMALL, **extra, **overrides})
    if not randomize:  # as transformers initializes it
        torch.manual_seed(0)
        return model_cls(config).eval()
    return random_hf(model_cls, config)


TOKENS = np.random.RandomState(0).randint(0, SMALL["vocab_size"], (8, 24))


@pytest.mark.parametrize("kind,scan,hf_dtype", [
    ("llama-gqa", True, "float32"), ("llama-gqa", False, "float32"), ("llama-tied", True, "float32"),
    ("llama-tied", False, "float32"), ("mistral", True, "float32"), ("qwen2", True, "float32"),
    ("qwen2", False, "float32"), ("llama3.1", True, "float32"), ("llama-wide-heads", True, "float32"),
    ("llama-gqa", True, "bfloat16")])
def test_imported_model_gives_hf_logits(tmp_path, kind, scan, hf_dtype):
    model = random_hf_model(kind)
    if hf_dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # several shards + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=(f"scan_layers={scan}",))
    c, trainer, params = load_maxtrain(out / "maxtrain.yml")
    assert c.scan_layers == scan and ("layers" in params) == scan
    ours = maxtrain_logits(trainer, params, TOKENS)
    # Reference: the saved weights (bf16 ones exactly) in a float32 model; HF's own .float() would keep
    # the rotary frequencies rounded by the earlier .to(bfloat16).
    ref = hf_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval(), TOKENS)
    assert np.abs(ref).max() > 1.0  # a meaningful comparison, not two near-zero outputs
    assert np.abs(ours - ref).max() <= TOLERANCE


@pytest.mark.parametrize("kind,scan,weight_dtype", [("llama-gqa", True, "float32"), ("qwen2", False, "float32"),
                                                    ("llama3.1", True, "float32"), ("llama-tied", True, "bfloat16")])
def test_export_reloads_in_transformers_with_identical_weights(tmp_path, kind, scan, weight_dtype):
    model = random_hf_model(kind, bos_token_id=7, eos_token_id=[8, 9])
    model.save_pretrained(tmp_path / "hf")
    convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"),
                           overrides=(f"scan_layers={scan}", f"weight_dtype={weight_dtype}"))
    convert.maxtrain_to_hf(str(tmp_path / "mt"), str(tmp_path / "back"), max_shard_bytes=60_000)
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(model)
    # What maxtrain does not model travels with the import: token ids, context length.
    assert (again.config.bos_token_id, again.config.eos_token_id) == (7, [8, 9])
    assert again.config.max_position_embeddings == SMALL["max_position_embeddings"]
    want, got = model.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        expected = tensor.to(torch.bfloat16) if weight_dtype == "bfloat16" else tensor
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name
    if weight_dtype == "float32":  # and the config describes the same function
        np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


@pytest.mark.slow
def test_trained_checkpoint_exported_gives_the_same_logits_in_transformers(tmp_path, train_tiny):
    result = train_tiny("enable_checkpointing=true", "steps=3", "qkv_bias=true")
    step_dir = tmp_path / "tiny" / "checkpoints" / "3"
    convert.maxtrain_to_hf(str(step_dir), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"  # q/k/v biases
    c = train.load_config([str(TESTS / "configs" / "tiny.yml"), "qkv_bias=true"])
    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    tokens = np.random.RandomState(1).randint(0, c.vocab_size, (8, 32))
    ours = maxtrain_logits(trainer, result["state"].params, tokens)
    assert np.abs(ours - hf_logits(model, tokens)).max() <= TOLERANCE
    assert model.config.eos_token_id is None  # trained from scratch: no HF source to take token ids from


@pytest.mark.slow
def test_import_with_a_shipped_config_extends_it_from_any_directory(tmp_path, monkeypatch):
    """`--config configs/shakespeare.yml` outside the checkout is the config the package ships (it was written
    as <cwd>/configs/shakespeare.yml, which did not exist): the data keys come with it, paths beside it."""
    hf = _saved(tmp_path)
    plain = yaml.safe_load((convert.hf_to_maxtrain(str(hf), str(tmp_path / "plain")) / "maxtrain.yml").read_text())
    model = [f"{k}={v}" for k, v in plain.items() if k not in ("load_parameters_path", "tokenizer_type")]
    monkeypatch.chdir(tmp_path)
    out = convert.hf_to_maxtrain(str(hf), "mt", "configs/shakespeare.yml", overrides=tuple(model))
    written = yaml.safe_load((out / "maxtrain.yml").read_text())
    assert written["base_config"] == str(config_lib.CONFIG_DIR / "shakespeare.yml")
    c = config_lib.load([str(out / "maxtrain.yml")])
    assert c.train_files == str(config_lib.CONFIG_DIR / "data" / "tinyshakespeare.txt") and c.eval_interval == 100


def test_greedy_generation_matches_transformers(tmp_path):
    model = random_hf_model("llama-gqa")
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    c, trainer, params = load_maxtrain(out / "maxtrain.yml")
    prompt = [5, 17, 90, 3, 42]
    ours = decode(c, trainer, params, [prompt], 16)[0]
    # Sampling restricted to the single most likely token is greedy decoding again.
    top1 = decode(c, trainer, params, [prompt], 16, Sampling(temperature=1.0, top_k=1, seed=3))[0]
    eos = ours[5]  # stops right after the first time it produces the end-of-sequence token
    stopped = decode(c, trainer, params, [prompt], 16, eos_id=eos)[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours) == 16 and ours == ref and top1 == ref
    assert stopped == ref[:ref.index(eos) + 1]


@pytest.mark.slow
def test_finetune_from_imported_checkpoint_on_shakespeare(tmp_path, hf_tokenizer_json):
    # An HF model whose vocabulary is a BPE tokenizer trained on Shakespeare, shipped beside it.
    model = random_hf_model("llama-gqa", randomize=False, vocab_size=600, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(tmp_path / "hf")
    shutil.copy(hf_tokenizer_json, tmp_path / "hf" / "tokenizer.json")
    cli = [sys.executable, "-m", "maxtrain.convert", "hf_to_maxtrain", "--hf_dir", str(tmp_path / "hf"),
           "--out", str(tmp_path / "mt")]
    done = subprocess.run(cli, capture_output=True, text=True, env=cpu_env())
    assert done.returncode == 0, done.stderr[-2000:]
    written = (tmp_path / "mt" / "maxtrain.yml").read_text()
    assert "tokenizer_type: huggingface" in written and "hf_bos_token: <s>" in written

    devices = jax.devices()[:8]
    c = train.load_config([str(tmp_path / "mt" / "maxtrain.yml"), "dataset_type=text", f"train_files={SHAKESPEARE}",
                           "max_target_length=64", "per_device_batch_size=1", "steps=30", "learning_rate=3e-3",
                           "warmup_steps_fraction=0", f"base_output_directory={tmp_path}", "log_period=10",
                           "checkpoint_period=30", "metrics_backends=jsonl"], devices)
    losses = np.asarray(train.train(c, devices)["losses"])
    assert len(losses) == 30 and np.isfinite(losses).all()
    assert losses[:3].mean() > 6.0  # starts near ln(600) = 6.4: an untrained model, as imported
    assert losses[-5:].mean() < losses[:5].mean() - 0.5

    gen = [sys.executable, "-m", "maxtrain.generate", str(tmp_path / "mt" / "maxtrain.yml"), "prompt=ROMEO:",
           "max_new_tokens=8"]
    done = subprocess.run(gen, capture_output=True, text=True, env=cpu_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "generated ids: [" in done.stdout and "text: " in done.stdout

    # The trained run goes back to HF with the tokenizer and token ids of the model it started from.
    assert convert.main(["maxtrain_to_hf", "--checkpoint", str(tmp_path / c.run_name / "checkpoints" / "30"),
                         "--out", str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert (back.config.bos_token_id, back.config.eos_token_id) == (1, 2)
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == hf_tokenizer_json.read_bytes()


# ---------------------------------------------------------------------------------------------
# Refusals: exit 2, one line naming the tensor or key, nothing written


def _saved(tmp_path, kind="llama-gqa", **overrides):
    return save_hf(random_hf_model(kind, **overrides), tmp_path / "hf")


def missing_tensor(tmp_path):
    from safetensors.torch import save_file
    model = random_hf_model("llama-gqa")
    model.config.save_pretrained(tmp_path / "hf")
    tensors = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    return ["--hf_dir", str(tmp_path / "hf")], "model.layers.1.mlp.up_proj.weight: missing"


def wrong_shape(tmp_path):
    hf = _saved(tmp_path)
    edit_hf_config(hf, intermediate_size=128)
    return ["--hf_dir", str(hf)], "model.layers.0.mlp.gate_proj.weight: shape [160, 64]"


def config_mismatch(tmp_path):
    return ["--hf_dir", str(_saved(tmp_path)), "--config", str(TESTS / "configs" / "tiny.yml")], "vocab_size:"


def rope_scaling(tmp_path):
    hf = _saved(tmp_path)
    edit_hf_config(hf, rope_parameters={"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 8.0})
    return ["--hf_dir", str(hf)], "rope type 'dynamic' is not supported"


def sliding_window(tmp_path):  # Qwen2's window from max_window_layers on: some layers only
    hf = _saved(tmp_path, "qwen2")
    edit_hf_config(hf, use_sliding_window=True, sliding_window=64, max_window_layers=1,
                 layer_types=["full_attention", "sliding_attention"])
    return ["--hf_dir", str(hf)], "sliding_window=64 is not supported"


def pickle_only(tmp_path):
    model = random_hf_model("llama-gqa")
    model.config.save_pretrained(tmp_path / "hf")
    torch.save(model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    return ["--hf_dir", str(tmp_path / "hf")], "pickle files, which maxtrain never loads"


def bad_key(tmp_path):
    return ["--hf_dir", str(_saved(tmp_path)), "scan_layer=false"], "scan_layer: unknown key"


@pytest.mark.parametrize("case", [missing_tensor, wrong_shape, config_mismatch, rope_scaling, sliding_window,
                                  pickle_only, bad_key])
def test_import_refusals_are_one_line_and_write_nothing(tmp_path, capsys, case):
    assert_import_refused(tmp_path, capsys, *case(tmp_path))


def test_export_refusals(tmp_path, capsys):
    code = convert.main(["maxtrain_to_hf", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "not a maxtrain checkpoint step directory" in err and len(err.splitlines()) == 1
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    code = convert.main(["hf_to_maxtrain", "--hf_dir", str(tmp_path), "--out", str(tmp_path / "full")])
    assert code == 2 and "already exists and is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("args,expected", [
    (["prompt_ids=1,2"], "load_parameters_path: required"),
    (["load_parameters_path=/nonexistent", "prompt=a", "prompt_ids=1"], "prompt: set exactly one"),
    (["load_parameters_path=/nonexistent", "prompt_ids=1,x"], "prompt_ids: expected comma-separated"),
    (["load_parameters_path=/nonexistent", "prompt_ids=1,999"], "prompt_ids: token id 999 is outside"),
    (["load_parameters_path=/nonexistent", "prompt_ids=,"], "prompt_ids: gives no tokens"),
    (["load_parameters_path=/nonexistent", "prompt_ids=1", "top_k=300"], "top_k: 300 exceeds vocab_size=256"),
    (["load_parameters_path=/nonexistent", "prompt_ids=1", "max_new_tokens=4"],
     "not a maxtrain checkpoint step directory"),
])
def test_generate_refusals(capsys, args, expected):
    assert generate.main([str(TESTS / "configs" / "tiny.yml"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


def test_llama3_rope_frequencies_match_transformers():
    from maxtrain.models.rope import Rope
    model = random_hf_model("llama3.1")
    hf_inv_freq = model.model.rotary_emb.inv_freq.numpy()
    ours = np.asarray(Rope(500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_length=64).frequencies(8))
    plain = np.asarray(Rope(500000.0).frequencies(8))
    np.testing.assert_allclose(ours, hf_inv_freq, rtol=1e-6)
    assert (ours < plain).sum() >= 4  # the scaling really slows the long wavelengths here


@pytest.mark.slow
def test_an_imported_model_generates_to_its_own_context(tmp_path, capsys):
    """config.json's max_position_embeddings (2048 here) travels as the key of that name: generate runs a
    32-token prompt to 2048 though the run's max_target_length is 128, and says which bound it hit past that."""
    from maxtrain.config.keys import ConfigError
    random_hf_model("llama-gqa", max_position_embeddings=2048).save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    assert "max_position_embeddings: 2048" in (out / "maxtrain.yml").read_text()
    c = config_lib.load([str(out / "maxtrain.yml"), "max_target_length=128", "max_new_tokens=2017"])
    with pytest.raises(ConfigError, match=r"^max_new_tokens: 2017 after a 32-token prompt exceeds "
                                          r"max_position_embeddings=2048, the context the model runs at"):
        generate.check_length(c, [[1] * 32], "prompt_ids")
    prompt = ",".join(str(i) for i in range(5, 37))
    capsys.readouterr()
    code = generate.main([str(out / "maxtrain.yml"), "max_target_length=128", f"prompt_ids={prompt}",
                          "max_new_tokens=2016"])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    ids = json.loads(next(x for x in printed.out.splitlines() if x.startswith("generated ids: ")).split(": ", 1)[1])
    assert len(ids) == 2016  # positions 32 .. 2047: the model's whole context (no eos: none is set)


def test_convert_help_names_every_supported_model_type(capsys):
    from maxtrain.models.hf import supported
    with pytest.raises(SystemExit):
        convert.main(["--help"])
    out = capsys.readouterr().out
    assert "Mistral with its sliding window\nor without" in out
    assert all(kind in out for kind in supported()) and "mistral" in supported()
