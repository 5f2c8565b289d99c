"""Config loading: layering, typed overrides, and one clear error per user mistake."""

import subprocess
import sys

import jax.numpy as jnp
import pytest

from maxtrain.config import load as config
from maxtrain.config.resolve import resolve
from maxtrain.config.keys import ConfigError
from maxtrain.models.args import ModelArgs

from conftest import TINY

BASE = str(config.BASE_YML)


def error_of(argv, devices=8, slices=1):
    with pytest.raises(ConfigError) as e:
        resolve(config.load(argv), devices, slices)
    return e.value


def test_defaults_load_and_are_frozen():
    c = resolve(config.load([BASE]), 1)
    assert c.steps == 200 and c.remat_policy == "full"
    assert c.mesh_shape == {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    assert c.global_batch_size == 4
    with pytest.raises(AttributeError):
        c.steps = 3


def test_base_config_chain_and_command_line_precedence(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yml").write_text(f"base_config: {BASE}\nsteps: 7\nlearning_rate: 0.5\n")
    (tmp_path / "sub" / "b.yml").write_text("base_config: ../a.yml\nsteps: 9\n")
    c = config.load([str(tmp_path / "sub" / "b.yml"), "learning_rate=0.25"])
    assert c.steps == 9            # child file wins over parent
    assert c.learning_rate == 0.25  # command line wins over files
    assert c.vocab_size == 512      # untouched default from base.yml


def test_override_types_follow_defaults():
    c = config.load([BASE, "steps=12", "learning_rate=1e-4", "scan_layers=false",
                     "per_device_batch_size=2", 'logical_axis_rules=[["batch", "data"]]'])
    assert c.steps == 12 and isinstance(c.steps, int)
    assert c.learning_rate == 1e-4
    assert c.scan_layers is False
    assert c.per_device_batch_size == 2.0
    assert c.logical_axis_rules == [["batch", "data"]]


def test_learning_rate_schedule_steps_defaults_to_steps():
    assert config.load([BASE, "steps=33"]).learning_rate_schedule_steps == 33


def test_unknown_key_suggests_closest():
    e = error_of([BASE, "learning_rte=0.1"])
    assert e.key == "learning_rte" and "did you mean learning_rate" in str(e)


def test_unknown_key_in_file(tmp_path):
    (tmp_path / "x.yml").write_text("base_emb_dims: 8\n")
    e = error_of([str(tmp_path / "x.yml")])
    assert e.key == "base_emb_dims" and "base_emb_dim" in str(e)


@pytest.mark.parametrize("arg,key", [("steps=ten", "steps"), ("steps=2.5", "steps"),
                                      ("learning_rate=fast", "learning_rate"),
                                      ("scan_layers=maybe", "scan_layers")])
def test_wrong_type_on_command_line(arg, key):
    assert error_of([BASE, arg]).key == key


def test_wrong_type_in_file(tmp_path):
    (tmp_path / "x.yml").write_text("steps: 1.5\n")
    e = error_of([str(tmp_path / "x.yml")])
    assert e.key == "steps" and "expected int" in str(e)


def test_floats_yaml_reads_as_strings(tmp_path):
    (tmp_path / "x.yml").write_text("learning_rate: 3e-4\nadam_eps: 1.0e8\n")
    c = config.load([str(tmp_path / "x.yml")])
    assert c.learning_rate == 3e-4 and c.adam_eps == 1.0e8
    (tmp_path / "y.yml").write_text("learning_rate: 3e-4x\n")
    assert "expected float" in str(error_of([str(tmp_path / "y.yml")]))


@pytest.mark.parametrize("key,value", [("remat_policy", "sometimes"), ("dtype", "float16"),
                                        ("weight_dtype", "int8"), ("dataset_type", "csv"),
                                        ("lr_schedule_type", "step"), ("attention", "flash")])
def test_value_outside_allowed_set(key, value):
    e = error_of([BASE, f"{key}={value}"])
    assert e.key == key and "not one of" in str(e)


@pytest.mark.parametrize("key", ["base_emb_dim", "base_num_decoder_layers", "vocab_size", "steps",
                                 "max_target_length", "head_dim"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_zero_or_negative_sizes(key, value):
    assert error_of([BASE, f"{key}={value}"]).key == key


def test_negative_batch_size():
    assert error_of([BASE, "per_device_batch_size=-1"]).key == "per_device_batch_size"


def test_mesh_product_must_match_devices():
    e = error_of([BASE, "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], devices=8)
    assert "product 4" in str(e) and "8 devices" in str(e)


def test_fill_axis_must_divide():
    e = error_of([BASE, "ici_tensor_parallelism=3"], devices=8)
    assert e.key == "ici_fsdp_parallelism" and "cannot fill" in str(e)


def test_only_one_fill_axis_per_group():
    e = error_of([BASE, "ici_data_parallelism=-1"])
    assert "at most one" in str(e)


def test_fill_resolves_mesh():
    c = resolve(config.load([BASE, "ici_tensor_parallelism=2"]), 8)
    assert c.mesh_shape == {"stage": 1, "data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}


def test_dcn_product_must_match_slices():
    e = error_of([BASE, "dcn_data_parallelism=4", "ici_fsdp_parallelism=4"], devices=8, slices=2)
    assert "2 slices" in str(e)


def test_heads_divisible_by_kv_heads():
    e = error_of([BASE, "base_num_query_heads=6", "base_num_kv_heads=4"])
    assert e.key == "base_num_kv_heads"


def test_heads_divisible_by_tensor_axis():
    e = error_of([BASE, "base_num_query_heads=4", "base_num_kv_heads=4", "ici_tensor_parallelism=8"])
    assert e.key == "base_num_query_heads" and "tensor axis (8)" in str(e)


def test_kv_heads_divisible_by_tensor_axis():
    e = error_of([BASE, "base_num_query_heads=8", "base_num_kv_heads=2", "ici_tensor_parallelism=4",
                  "ici_fsdp_parallelism=2"])
    assert e.key == "base_num_kv_heads"


def test_global_batch_divisible_by_batch_shards():
    e = error_of([BASE, "per_device_batch_size=0.5"], devices=8)  # batch 4 over 8 fsdp shards
    assert e.key == "per_device_batch_size" and "8 batch shards" in str(e)


def test_fractional_batch_allowed_when_divisible():
    c = resolve(config.load([BASE, "per_device_batch_size=0.5", "ici_fsdp_parallelism=4",
                                         "ici_tensor_parallelism=2"]), 8)
    assert c.global_batch_size == 4


def test_gradient_accumulation_must_divide_batch():
    e = error_of([BASE, "per_device_batch_size=1", "gradient_accumulation_steps=3"], devices=8)
    assert e.key == "per_device_batch_size" and "3 micro-batches" in str(e)


def test_bad_axis_rules():
    assert error_of([BASE, 'logical_axis_rules=[["batch", "pipeline"]]']).key == "logical_axis_rules"
    assert error_of([BASE, 'logical_axis_rules=[["batch"]]']).key == "logical_axis_rules"


def test_missing_file_and_bad_yaml(tmp_path):
    assert "cannot read" in str(error_of([str(tmp_path / "nope.yml")]))
    (tmp_path / "bad.yml").write_text("steps: [1,\n")
    assert "not valid YAML" in str(error_of([str(tmp_path / "bad.yml")]))


def test_argument_without_equals():
    assert "expected key=value" in str(error_of([BASE, "steps"]))


def test_model_preset_applies_below_command_line():
    c = config.load([BASE, "model_name=llama2-7b", "base_num_decoder_layers=2"])
    assert c.base_emb_dim == 4096 and c.base_num_decoder_layers == 2


def test_unknown_model_preset():
    e = error_of([BASE, "model_name=gpt5"])
    assert e.key == "model_name" and "llama2-7b" in str(e)


def test_cli_prints_one_line_exits_2_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "maxtrain.train", TINY, "remat_policy=bogus", f"base_output_directory={out}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("config error: remat_policy:")
    assert "Traceback" not in proc.stderr and not out.exists()


def test_cli_mesh_error_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "maxtrain.train", TINY, "ici_fsdp_parallelism=3",
         f"base_output_directory={tmp_path}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("config error: ici_*_parallelism:")
    assert "product 3" in proc.stderr


def test_attention_auto_is_each_platforms_kernel_and_an_explicit_value_wins():
    def resolved(*overrides, platform):
        return resolve(config.load([BASE, *overrides]), 1, platform=platform).attention
    assert resolved(platform="tpu") == "splash" and resolved(platform="gpu") == "jax_nn"
    assert resolved(platform="cpu") == "blockwise"
    assert resolved("max_target_length=100", platform="tpu") == "blockwise"  # splash needs blocks of 128
    assert resolved("attention=dot_product", platform="tpu") == "dot_product"
    # beside quantized attention projections jax_nn's einsums would be quantized: blockwise on GPU
    assert resolved("quantization=int8", platform="gpu") == "blockwise"
    assert resolved("quantization=int8", "quantization_targets=mlp", platform="gpu") == "jax_nn"


def test_dtype_auto_is_float32_only_for_narrow_models_on_cpu():
    def dtype(*overrides, platform="cpu"):
        return resolve(config.load([BASE, *overrides]), 1, platform=platform).dtype
    assert dtype("base_emb_dim=128") == "float32"  # issue #41's tiny model (benchmarks/README.md)
    assert dtype() == "bfloat16"  # base.yml's width 256
    assert dtype("base_emb_dim=128", platform="tpu") == dtype("base_emb_dim=128", platform="gpu") == "bfloat16"
    assert dtype("base_emb_dim=128", "dtype=bfloat16") == "bfloat16"  # an explicit value wins
    assert config.load([BASE]).dtype == "auto" and ModelArgs.from_config(config.load([BASE])).dtype == jnp.bfloat16


def test_auto_chunks_switch_on_where_the_unchunked_tensors_are_large():
    def chunks(*overrides, devices=64):
        c = resolve(config.load([BASE, *overrides]), devices, platform="tpu")
        return c.loss_chunk_size, c.mlp_chunk_size
    # llama2-7b at 4096 on 64 chips: 2 GiB of float32 logits and 360 MB of bf16 MLP activations per chip.
    assert chunks("model_name=llama2-7b", "max_target_length=4096") == (512, 2048)
    # The CPU demo's logits (4 x 128 x 512) are small: nothing is chunked.
    assert chunks(devices=1) == (0, 0)
    # Chunks divide the length; an explicit value wins.
    assert chunks("model_name=llama3-8b", "max_target_length=3000") == (500, 1500)
    assert chunks("model_name=llama2-7b", "max_target_length=4096", "loss_chunk_size=0") == (0, 2048)


def test_scan_unroll_auto_unrolls_small_models_without_remat_on_cpu():
    def unroll(*overrides, platform="cpu"):
        return resolve(config.load([BASE, *overrides]), 1, platform=platform).scan_unroll
    assert unroll("remat_policy=none") == 4  # base.yml's 4 layers, no loop
    assert unroll() == 1 and unroll("remat_policy=minimal") == 1  # full remat: the loop
    assert unroll("remat_policy=none", platform="tpu") == 1
    assert unroll("remat_policy=none", "model_name=llama2-7b") == 1  # 32 layers: compile time
    assert unroll("remat_policy=none", "scan_unroll=2") == 2


def test_an_moe_layer_chunks_only_under_expert_parallelism():
    def moe_chunk(*overrides):
        c = config.load([BASE, "model_name=mixtral-8x7b", "max_target_length=4096", *overrides])
        return resolve(c, 64, platform="tpu").moe_chunk_size
    # Expert 8: a chip receives 8 peers x 4 sequences x 1 assignment per position, 14336 wide in bf16:
    # 917,504 bytes a position, so 128 positions keep it under 128 MiB.
    assert moe_chunk("ici_expert_parallelism=8", "ici_fsdp_parallelism=8") == 128
    assert moe_chunk("ici_expert_parallelism=2", "ici_fsdp_parallelism=32") == 256  # 4 experts a chip: 2 each
    assert moe_chunk() == 0  # no expert axis: the gathered weights dominate
    assert moe_chunk("ici_expert_parallelism=8", "ici_fsdp_parallelism=8", "mlp_chunk_size=0") == 0
    assert moe_chunk("mlp_chunk_size=256") == 256


def test_a_preset_over_the_files_keys_is_said_once(tmp_path, capsys):
    mine = tmp_path / "mine.yml"
    mine.write_text("base_config: base.yml\nvocab_size: 384\nlearning_rate: 1.0e-3\n")
    c = config.load([str(mine), "model_name=gemma3-tiny"])
    assert c.vocab_size == 512 and c.learning_rate == 1e-3
    assert capsys.readouterr().out == ("note: model_name=gemma3-tiny sets vocab_size=512 over the file's 384 (a preset's "
                                       "keys win over the config file's; key=value wins over both)\n")
    assert config.load([str(mine), "model_name=gemma3-tiny", "vocab_size=640"]).vocab_size == 640
    assert capsys.readouterr().out == ""  # key=value chose: nothing to say
    config.load([str(mine)])
    assert capsys.readouterr().out == ""
