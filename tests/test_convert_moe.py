"""HuggingFace interop for mixtures of experts (Mixtral, Qwen3-MoE): import/export with logits parity
against transformers, greedy generation, and one-line refusals of what maxtrain cannot express.

As in test_convert.py: random-weight transformers models from small configs (nothing is downloaded), every
tensor randomized (norms, q/k norms and routers included) so each one's mapping is exercised.
"""

import functools
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch, save_file
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)


from maxtrain.config import load as config_lib
from maxtrain.config import schema
from maxtrain import convert
from maxtrain.models import hf as hf_format
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib
from maxtrain import train

import helpers
from conftest import TESTS, decode
from helpers import TOLERANCE, assert_import_refused, cpu_env, edit_hf_config, hf_logits, maxtrain_logits, random_hf, save_hf

SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False)
VARIANTS = {
    # 8 experts of width 48, top-2, renormalised (Mixtral always is).
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(intermediate_size=48, num_local_experts=8,
                                                        num_experts_per_tok=2, router_aux_loss_coef=0.02)),
    # q/k norms; heads wider than hidden_size / heads; a dense intermediate_size that no layer uses.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        intermediate_size=160, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Top-3 of 4 weighted by their softmax scores as they are; tied embeddings.
    "qwen3_moe-raw-topk": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        intermediate_size=160, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=3, norm_topk_prob=False,
        head_dim=16, tie_word_embeddings=True)),
}
TOKENS = np.random.RandomState(0).randint(0, SMALL["vocab_size"], (8, 24))


def random_hf_model(kind: str, **overrides):
    config_cls, model_cls, extra = VARIANTS[kind]
    return random_hf(model_cls, config_cls(**{**SMALL, **extra, **overrides}))


# The MoE families' parity runs plain attention (the other kernels have tests of their own).
load_maxtrain = functools.partial(helpers.load_maxtrain, attention="dot_product")


def save_fused(model, hf_dir):
    """The model in transformers 5's in-memory layout (experts fused per layer), which it also loads."""
    model.config.save_pretrained(hf_dir)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, hf_dir / "model.safetensors",
              metadata={"format": "pt"})


def test_save_pretrained_writes_one_tensor_per_expert(tmp_path):
    """What the conversion tables rest on: transformers 5 fuses the experts in memory but writes them (as
    the Hub's checkpoints hold them) one tensor per expert."""
    for kind, expert, router in [("mixtral", "block_sparse_moe.experts.7.w2.weight", "block_sparse_moe.gate.weight"),
                                 ("qwen3_moe", "mlp.experts.7.down_proj.weight", "mlp.gate.weight")]:
        model = random_hf_model(kind)
        assert model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 96, 64)
        model.save_pretrained(tmp_path / kind)
        saved = load_file(tmp_path / kind / "model.safetensors")
        assert saved[f"model.layers.1.{expert}"].shape == (64, 48)
        assert saved[f"model.layers.1.{router}"].shape == (8, 64)
        assert not any("gate_up_proj" in name for name in saved)


@pytest.mark.slow
@pytest.mark.parametrize("kind,scan,matmul,layout", [
    ("mixtral", True, "blocked", "saved"), ("mixtral", False, "ragged_dot", "saved"),
    ("qwen3_moe", True, "ragged_dot", "saved"), ("qwen3_moe", False, "blocked", "saved"),
    ("qwen3_moe-raw-topk", True, "blocked", "saved"),
    ("mixtral", True, "blocked", "fused"), ("qwen3_moe", False, "blocked", "fused")])
def test_imported_model_gives_hf_logits(tmp_path, kind, scan, matmul, layout):
    model = random_hf_model(kind)
    if layout == "fused":
        save_fused(model, tmp_path / "hf")
    else:
        model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # several shards + index
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=(f"scan_layers={scan}",))
    c, trainer, params = load_maxtrain(out / "maxtrain.yml", f"moe_grouped_matmul={matmul}")
    assert c.num_experts == model.config.num_local_experts and ("moe_layers" in params) == scan
    assert c.load_balance_loss_weight == model.config.router_aux_loss_coef
    ours = maxtrain_logits(trainer, params, TOKENS)
    ref = hf_logits(model, TOKENS)
    assert np.abs(ref).max() > 1.0  # a meaningful comparison, not two near-zero outputs
    assert np.abs(ours - ref).max() <= TOLERANCE


@pytest.mark.parametrize("kind,scan,weight_dtype", [("mixtral", True, "float32"), ("qwen3_moe", False, "float32"),
                                                    ("qwen3_moe-raw-topk", True, "bfloat16")])
def test_export_reloads_in_transformers_with_identical_weights(tmp_path, kind, scan, weight_dtype):
    model = random_hf_model(kind, bos_token_id=7, eos_token_id=[8, 9])
    model.save_pretrained(tmp_path / "hf")
    convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"),
                           overrides=(f"scan_layers={scan}", f"weight_dtype={weight_dtype}"))
    convert.maxtrain_to_hf(str(tmp_path / "mt"), str(tmp_path / "back"), max_shard_bytes=60_000)
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    # The files hold what save_pretrained wrote, name for name and bit for bit.
    original = load_torch(tmp_path / "hf" / "model.safetensors")
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"]
    exported = {}
    for shard in sorted(set(index.values())):
        exported |= load_torch(tmp_path / "back" / shard)
    assert set(exported) == set(original)
    for name, x in original.items():
        expected = x.to(torch.bfloat16) if weight_dtype == "bfloat16" else x
        assert exported[name].dtype == expected.dtype and torch.equal(exported[name], expected), name
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(model)
    assert (again.config.bos_token_id, again.config.eos_token_id) == (7, [8, 9])
    assert again.config.router_aux_loss_coef == model.config.router_aux_loss_coef
    want, got = model.state_dict(), again.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        expected = tensor.to(torch.bfloat16) if weight_dtype == "bfloat16" else tensor
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name
    if weight_dtype == "float32":  # and the config describes the same function
        np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_export_without_an_hf_source_picks_the_model_class(tmp_path, kind):
    model = random_hf_model(kind)
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"), overrides=("scan_layers=false",))
    for name in (out / "hf").iterdir():  # as if trained from scratch: no HF config to carry over
        name.unlink()
    (out / "hf").rmdir()
    convert.maxtrain_to_hf(str(out), str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == model.config.model_type
    assert written["architectures"] == [type(model).__name__]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(model) and again.config.eos_token_id is None
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


@pytest.mark.slow
def test_trained_moe_checkpoint_exported_gives_the_same_logits_in_transformers(tmp_path, train_tiny):
    result = train_tiny("enable_checkpointing=true", "steps=2", "model_family=qwen3_moe", "num_experts=4",
                        "num_experts_per_tok=2", "norm_topk_prob=true", "use_qk_norm=true", "base_moe_mlp_dim=32")
    convert.maxtrain_to_hf(str(tmp_path / "tiny" / "checkpoints" / "2"), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"  # q/k norms
    c = train.load_config([str(TESTS / "configs" / "tiny.yml"), "model_family=qwen3_moe", "num_experts=4",
                           "num_experts_per_tok=2", "norm_topk_prob=true", "use_qk_norm=true", "base_moe_mlp_dim=32",
                           "attention=dot_product"])
    trainer = step_lib.build(c, mesh_lib.make_mesh(c))
    tokens = np.random.RandomState(1).randint(0, c.vocab_size, (8, 32))
    ours = maxtrain_logits(trainer, result["state"].params, tokens)
    assert np.abs(ours - hf_logits(model, tokens)).max() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_greedy_generation_matches_transformers(tmp_path, kind):
    model = random_hf_model(kind)
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    c, trainer, params = load_maxtrain(out / "maxtrain.yml")
    prompt = [5, 17, 90, 3, 42]
    ours = decode(c, trainer, params, [prompt], 16)[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours) == 16 and ours == ref


@pytest.mark.slow
def test_cli_round_trip_and_generation(tmp_path):
    model = random_hf_model("mixtral")
    model.save_pretrained(tmp_path / "hf")
    env = cpu_env()
    done = subprocess.run([sys.executable, "-m", "maxtrain.convert", "hf_to_maxtrain", "--hf_dir", str(tmp_path / "hf"),
                           "--out", str(tmp_path / "mt")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    prompt = [5, 17, 90, 3, 42]
    done = subprocess.run([sys.executable, "-m", "maxtrain.generate", str(tmp_path / "mt" / "maxtrain.yml"),
                           f"prompt_ids={','.join(map(str, prompt))}", "max_new_tokens=16", "dtype=float32",
                           "attention=dot_product"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = json.loads(re.search(r"generated ids: (\[[0-9, ]*\])", done.stdout + done.stderr).group(1))
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref
    done = subprocess.run([sys.executable, "-m", "maxtrain.convert", "maxtrain_to_hf", "--checkpoint",
                           str(tmp_path / "mt"), "--out", str(tmp_path / "back")],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "back")) is MixtralForCausalLM


# ---------------------------------------------------------------------------------------------
# Refusals: exit 2, one line naming the tensor or key, nothing written


def _saved(tmp_path, kind="mixtral", **overrides):
    return save_hf(random_hf_model(kind, **overrides), tmp_path / "hf")


def qwen2_moe(tmp_path):
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(Qwen2MoeConfig(**SMALL, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                                       num_experts_per_tok=2, shared_expert_intermediate_size=96)
                        ).save_pretrained(tmp_path / "hf")
    return ["--hf_dir", str(tmp_path / "hf")], "model_type 'qwen2_moe' is not supported"


def mlp_only_layers(tmp_path):
    return ["--hf_dir", str(_saved(tmp_path, "qwen3_moe", mlp_only_layers=[0]))], "mlp_only_layers=[0] is not supported"


def decoder_sparse_step(tmp_path):
    hf = _saved(tmp_path, "qwen3_moe")
    edit_hf_config(hf, decoder_sparse_step=2)
    return ["--hf_dir", str(hf)], "decoder_sparse_step=2 is not supported"


def qwen3_sliding_window(tmp_path):
    hf = _saved(tmp_path, "qwen3_moe")
    edit_hf_config(hf, use_sliding_window=True, sliding_window=64)
    return ["--hf_dir", str(hf)], "sliding_window=64 is not supported"


def missing_expert(tmp_path):
    hf = _saved(tmp_path)
    tensors = load_file(hf / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    from safetensors.numpy import save_file as save_numpy
    save_numpy(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return ["--hf_dir", str(hf)], "model.layers.1.block_sparse_moe.experts.3.w2.weight: missing"


def expert_width(tmp_path):
    hf = _saved(tmp_path, "qwen3_moe")
    edit_hf_config(hf, moe_intermediate_size=64)
    return ["--hf_dir", str(hf)], "model.layers.0.mlp.experts.0.gate_proj.weight: shape [48, 64]"


def fewer_experts(tmp_path):  # the config says 4 experts, the files hold 8
    hf = _saved(tmp_path)
    edit_hf_config(hf, num_local_experts=4)
    return ["--hf_dir", str(hf)], "model.layers.0.block_sparse_moe.gate.weight: shape [8, 64]"


def too_many_per_token(tmp_path):
    hf = _saved(tmp_path)
    edit_hf_config(hf, num_experts_per_tok=9)
    return ["--hf_dir", str(hf)], "num_experts_per_tok=9 exceeds num_local_experts=8"


def config_mismatch(tmp_path):
    preset = config_lib.CONFIG_DIR / "models" / "mixtral-tiny.yml"
    return ["--hf_dir", str(_saved(tmp_path)), "--config", str(preset)], "vocab_size:"


@pytest.mark.parametrize("case", [qwen2_moe, mlp_only_layers, decoder_sparse_step,
                                  qwen3_sliding_window, missing_expert, expert_width, fewer_experts,
                                  too_many_per_token, config_mismatch])
def test_import_refusals_are_one_line_and_write_nothing(tmp_path, capsys, case):
    assert_import_refused(tmp_path, capsys, *case(tmp_path))


MOE = ("num_experts=4", "num_experts_per_tok=2", "norm_topk_prob=true")


@pytest.mark.parametrize("overrides,expected", [
    (("model_family=deepseek", "shared_experts=1"), "shared_experts=1: neither Mixtral nor Qwen3-MoE"),
    (("model_family=deepseek", "first_num_dense_layers=1"), "first_num_dense_layers=1: neither"),
    (("model_family=deepseek", "routed_score_func=sigmoid"), "routed_score_func='sigmoid': neither"),
    (("model_family=deepseek", "routed_bias=true"), "routed_bias=True: neither"),
    (("model_family=deepseek", "routed_scaling_factor=2.5"), "routed_scaling_factor=2.5: neither"),
    (("model_family=deepseek", "qkv_bias=true"), "qkv_bias=True: neither"),
    (("model_family=mixtral", "norm_topk_prob=false"), "norm_topk_prob=false: Mixtral always renormalises"),
    # a dense model with q/k norms exports as Qwen3 (maxtrain/models/qwen3.py), which has no q/k/v biases
    (("model_family=qwen3", "num_experts=1", "num_experts_per_tok=1", "use_qk_norm=true", "qkv_bias=true"),
     "qkv_bias=true: Qwen3 has no q/k/v biases"),
])
def test_export_refuses_what_no_hf_moe_expresses(overrides, expected):
    c = config_lib.load([str(TESTS / "configs" / "tiny.yml"), *MOE, *overrides])
    with pytest.raises(hf_format.ConvertError, match=re.escape(expected)):
        hf_format.hf_config_for(dict(c), "float32", None, None)


@pytest.mark.slow
def test_export_refusal_through_the_cli(tmp_path, capsys, train_tiny):
    train_tiny("enable_checkpointing=true", "steps=1", *MOE, "model_family=deepseek", "routed_scaling_factor=2.0")
    code = convert.main(["maxtrain_to_hf", "--checkpoint", str(tmp_path / "tiny" / "checkpoints" / "1"),
                         "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "routed_scaling_factor=2.0: neither" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "hf").exists()


def test_export_refuses_an_hf_source_of_another_shape(tmp_path, capsys):
    random_hf_model("mixtral").save_pretrained(tmp_path / "hf")
    convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    random_hf_model("qwen3_moe").save_pretrained(tmp_path / "other")
    capsys.readouterr()
    code = convert.main(["maxtrain_to_hf", "--checkpoint", str(tmp_path / "mt"), "--out", str(tmp_path / "back"),
                         "--hf_source", str(tmp_path / "other")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "differs" in err and len(err.splitlines()) == 1, err


def test_export_of_a_dense_checkpoint_written_before_the_moe_keys(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, intermediate_size=96)).eval()
    model.save_pretrained(tmp_path / "hf")
    out = convert.hf_to_maxtrain(str(tmp_path / "hf"), str(tmp_path / "mt"))
    metadata = out / "model" / "metadata"  # the model description, as an older maxtrain wrote it
    keys = schema.model_keys()  # (from before model_family too: the family its keys describe)
    old_keys = keys[keys.index("vocab_size"):keys.index("qkv_bias") + 1] + ("scan_layers",)
    metadata.write_text(json.dumps({k: v for k, v in json.loads(metadata.read_text()).items() if k in old_keys}))
    convert.maxtrain_to_hf(str(out), str(tmp_path / "back"))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is LlamaForCausalLM
    np.testing.assert_array_equal(hf_logits(again, TOKENS), hf_logits(model, TOKENS))


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hf_config_round_trips_the_model_keys(kind):
    hf = random_hf_model(kind).config.to_dict()
    keys = hf_format.model_keys_from_hf(hf)
    c = config_lib.load([str(config_lib.BASE_YML), *(f"{k}={convert._as_override(v)}" for k, v in keys.items())])
    assert hf_format.model_keys_from_hf(hf_format.hf_config_for(dict(c), "float32", None, None)) == keys
