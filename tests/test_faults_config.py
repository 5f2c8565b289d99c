"""Config edges a hostile user reaches: duplicate keys, overflowing numbers, kernels the platform cannot
run, path-like names, and settings that cannot take effect. Each refusal is one line, exit 2, at load."""

import pytest

from maxtrain.config import load as config, schema
from maxtrain.config.resolve import resolve
from conftest import TINY, TESTS
from helpers import main_in_process, one_line, run_cli

BASE = str(config.BASE_YML)


def refusal(argv, capsys) -> str:
    code, err = main_in_process(argv, capsys)
    assert code == 2, err
    return one_line(err)


# ---- duplicate keys ----------------------------------------------------------------------------------

def test_a_key_twice_in_a_config_file_is_refused(tmp_path, capsys):
    path = tmp_path / "run.yml"
    path.write_text(f"base_config: {TINY}\nsteps: 3\nlearning_rate: 0.1\nsteps: 5\n")
    assert refusal([str(path)], capsys) == f"config error: steps: set twice in {path} (lines 2 and 4)"


def test_a_key_twice_in_a_base_config_or_a_flow_mapping_is_refused(tmp_path, capsys):
    parent = tmp_path / "parent.yml"
    parent.write_text(f"base_config: {TINY}\ndtype: float32\ndtype: bfloat16\n")
    (tmp_path / "child.yml").write_text("base_config: parent.yml\nsteps: 2\n")
    assert refusal([str(tmp_path / "child.yml")], capsys) == \
        f"config error: dtype: set twice in {parent} (lines 2 and 3)"
    flow = tmp_path / "flow.yml"
    flow.write_text(f"base_config: {TINY}\nlogical_axis_rules: {{steps: 2, steps: 3}}\n")
    assert refusal([str(flow)], capsys) == f"config error: steps: set twice in {flow} (lines 2 and 2)"


def test_a_key_twice_in_a_model_preset_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "models").mkdir()
    preset = tmp_path / "models" / "twice.yml"
    preset.write_text("base_emb_dim: 64\nvocab_size: 256\nbase_emb_dim: 128\n")
    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path)
    assert refusal([TINY, "model_name=twice"], capsys) == \
        f"config error: base_emb_dim: set twice in {preset} (lines 1 and 3)"


def test_yaml_merge_keys_still_override_and_shipped_configs_have_no_duplicates(tmp_path):
    path = tmp_path / "merge.yml"
    path.write_text(f"base_config: {TINY}\nlogical_axis_rules: [{{<<: {{a: 1}}, a: 2}}]\n")
    assert config.yaml_file.safe_load(path.read_text())["logical_axis_rules"] == [{"a": 2}]
    shipped = [*config.CONFIG_DIR.glob("*.yml"), *(config.CONFIG_DIR / "models").glob("*.yml"),
               *(TESTS / "configs").glob("*.yml")]
    assert len(shipped) > 20
    for p in shipped:
        config.yaml_file.safe_load(p.read_text())  # raises DuplicateKey on a key given twice


# ---- numbers that would overflow int32 or float32 --------------------------------------------------

MOE = ("model_family=mixtral", "num_experts=4", "num_experts_per_tok=2")


@pytest.mark.parametrize("overrides, expected", [
    ((*MOE, "capacity_factor=1e9"), "capacity_factor: 1000000000.0 is out of range: at most 1000 (<= 0 is "
     "dropless; above num_experts / num_experts_per_tok nothing is dropped)"),
    ((*MOE, "capacity_factor=1e308"), "capacity_factor: 1e+308 is out of range: at most 1000 (<= 0 is "
     "dropless; above num_experts / num_experts_per_tok nothing is dropped)"),
    (("num_experts=2147483647",), "num_experts: 2147483647 is out of range: at most 65536 (experts)"),
    (("per_device_batch_size=1e308",), "per_device_batch_size: 1e+308 is out of range: at most 2147483647 "
     "(sequences; the global batch reaches jax as int32)"),
    (("per_device_batch_size=2147483647",), "per_device_batch_size: 2147483647.0 x 8 devices x max_target_length "
     "32 = 549755813632 tokens per step, out of range: at most 2147483647"),
    ((*MOE, "per_device_batch_size=65536", "max_target_length=65536"), "per_device_batch_size: 65536.0 x 8 devices "
     "x max_target_length 65536 x num_experts_per_tok 2 = 68719476736 expert assignments per step, out of range: "
     "at most 2147483647"),
    (("max_target_length=2147483647",), "max_target_length: 2147483647 is out of range: at most 2097152 "
     "(positions)"),
    (("learning_rate=1e39",), "learning_rate: 1e+39 is out of range (at most 3.403e+38 in magnitude: float32)"),
    (("rope_theta=1e308",), "rope_theta: 1e+308 is out of range (at most 3.403e+38 in magnitude: float32)"),
    (("head_dim=15",), "head_dim: 15 must be even (RoPE rotates pairs of dimensions)"),
    (("data_shuffle_seed=-5",), "data_shuffle_seed: must be >= 0, got -5"),
    # the attention and block variants
    (("sliding_window_size=-1",), "sliding_window_size: must be >= 0, got -1"),
    (("global_layer_interval=2",), "global_layer_interval: needs sliding_window_size > 0 (without a window every "
     "layer sees every key)"),
    (("sliding_window_size=8", "global_layer_interval=3"), "global_layer_interval: 3 exceeds "
     "base_num_decoder_layers=2: no layer would be global"),
    (("local_rope_theta=0",), "local_rope_theta: must be > 0 or -1 (sliding layers use rope_theta), got 0.0"),
    (("rope_type=dynamic",), "rope_type: 'dynamic' is not one of llama3, linear, yarn"),
    (("mlp_activation=relu",), "mlp_activation: 'relu' is not one of silu, gelu_tanh, clamped_swiglu"),
    (("mlp_activation_limit=0",), "mlp_activation_limit: must be > 0, got 0.0"),
    (("rope_yarn_beta_fast=1",), "rope_yarn_beta_fast: must exceed rope_yarn_beta_slow=1.0"),
    (("sliding_window_size=8", "global_layer_interval=2", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"),
     "global_layer_interval: a pattern of sliding and global layers cannot be pipelined yet "
     "(ici/dcn_pipeline_parallelism=1)"),
])
def test_out_of_range_numbers_are_one_line(overrides, expected, capsys, tmp_path):
    assert refusal([TINY, f"base_output_directory={tmp_path}", *overrides], capsys) == f"config error: {expected}"
    assert not (tmp_path / "tiny").exists()  # refused before anything is written


def test_a_number_beyond_any_float_in_a_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "huge.yml"
    path.write_text(f"base_config: {TINY}\nlearning_rate: 1{'0' * 400}\n")
    assert refusal([str(path)], capsys) == f"config error: learning_rate: must be a finite number, got 1{'0' * 400}"


def test_real_models_are_within_the_bounds():
    for name in ("deepseek-v3", "llama3.1-405b", "qwen3-30b-a3b", "mixtral-8x7b", "smollm2-135m"):
        c = config.load([BASE, f"model_name={name}", "max_target_length=131072", "capacity_factor=1.25"])
        c = resolve(c, 64, platform="tpu")  # fsdp 64: every width above divides
        assert c.mesh_shape["fsdp"] == 64 and c.moe_grouped_matmul == "tokamax"
    c = config.load([BASE, *MOE, "capacity_factor=1000", "max_target_length=2097152", "num_experts=65536",
                     "num_experts_per_tok=65536", "per_device_batch_size=1e-3"])
    assert c.capacity_factor == 1000 and c.max_target_length == 2**21  # the bounds themselves are allowed


# ---- kernels the platform cannot run ------------------------------------------------------------------

def test_megablox_off_tpu_is_refused_at_load(capsys, tmp_path):
    assert refusal([TINY, f"base_output_directory={tmp_path}", *MOE, "moe_grouped_matmul=megablox"], capsys) == \
        "config error: moe_grouped_matmul: megablox is a TPU kernel (Pallas Mosaic); on cpu use tokamax, " \
        "blocked or ragged_dot (auto = blocked)"
    c = config.load([BASE, *MOE, "moe_grouped_matmul=megablox"])
    with pytest.raises(config.ConfigError, match="on gpu use tokamax, blocked or ragged_dot \\(auto = ragged_dot\\)"):
        resolve(c, 1, platform="gpu")
    assert resolve(c, 1, platform="tpu").moe_grouped_matmul == "megablox"
    dense = config.load([BASE, "moe_grouped_matmul=megablox"])  # no experts: the key is never read
    assert resolve(dense, 1, platform="cpu").moe_grouped_matmul == "megablox"


# ---- names that are not paths ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../base", "../models/tiny", "/etc/passwd", ""])
def test_model_name_is_a_preset_name_not_a_path(name, capsys, tmp_path):
    line = refusal([TINY, f"base_output_directory={tmp_path}", f"model_name={name}"], capsys)
    known = sorted(p.stem for p in (config.CONFIG_DIR / "models").glob("*.yml"))
    assert line == f"config error: model_name: no preset {name!r}; known: default, {', '.join(known)}"
    assert "deepseek-v3" in known and "tiny" in known


# ---- settings that cannot take effect: one warning each, the run goes on -----------------------------

def test_no_effect_warnings():
    def warnings(*overrides):
        return schema.no_effect_warnings(config.load([TINY, *overrides]))
    assert warnings() == []
    assert warnings("eval_interval=2") == [
        "eval_interval: 2 has no effect: dataset_type=synthetic has no eval data"]
    text = ("dataset_type=text", "train_files=data/tinyshakespeare.txt", "eval_interval=2")
    assert warnings(*text) == [
        "eval_interval: 2 has no effect: no eval data (set eval_files or eval_split_fraction)"]
    assert warnings(*text, "eval_split_fraction=0.1") == []
    assert warnings("profiler=xplane", "profiler_start_step=6") == [
        "profiler_start_step: 6 is after the last step (steps=5): profiler=xplane traces nothing"]
    assert warnings("profiler=xplane", "profiler_start_step=5", "profiler_steps=3") == []  # traces step 5
    assert warnings("profiler_start_step=6") == []  # the profiler is off: the window is not a promise
    assert warnings("capacity_factor=1.25") == ["capacity_factor: 1.25 has no effect: num_experts=1 (a dense model)"]
    assert warnings(*MOE, "capacity_factor=1.25") == []
    local = ("enable_checkpointing=true", "local_checkpoint_directory=/tmp/x", "checkpoint_period=50")
    assert warnings(*local, "local_checkpoint_period=100") == [
        "local_checkpoint_period: 100 has no effect: every local step is a persistent one (checkpoint_period=50); "
        "save locally more often"]
    assert warnings(*local, "local_checkpoint_period=10") == warnings(*local, "local_checkpoint_period=75") == []


@pytest.mark.slow
def test_no_effect_settings_warn_once_and_the_run_succeeds(tmp_path):
    code, out, err, _ = run_cli(TINY, "steps=2", "eval_interval=1", "profiler=xplane", "profiler_start_step=9",
                                out=tmp_path)
    assert code == 0, err[-3000:]
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: eval_interval: 1 has no effect: dataset_type=synthetic has no eval data",
                        "warning: profiler_start_step: 9 is after the last step (steps=2): profiler=xplane "
                        "traces nothing"]
    assert out.index("warning:") < out.index("maxtrain:")  # at start, before the run's first line
    assert "done: 2 steps" in out and not (tmp_path / "tiny" / "profile").exists()
