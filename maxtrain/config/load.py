"""Layered YAML config: base.yml defaults <- base_config chain <- model preset <- key=value overrides.

configs/base.yml is the schema: it declares every key and its default, and each key's type is the
type of its default. Everything a user can get wrong is checked here, before anything compiles, and
reported as a ConfigError that names the key. Values that follow from the config and the devices
(parameter count; mesh shape, global batch) are derived once, in `_derive_static` and `maxtrain.config.resolve`.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from maxtrain.models import quantization
from maxtrain.config import run_name as run_name_lib, yaml_file
from maxtrain.runtime import storage
from maxtrain.runtime.errors import UserError
from maxtrain.models import registry

CONFIG_DIR = Path(__file__).parent.parent / "configs"
BASE_YML = CONFIG_DIR / "base.yml"

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
DTYPES = ("float32", "bfloat16")
MODEL_KEYS = (
    "vocab_size", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim",
    "base_mlp_dim", "base_num_decoder_layers", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
    "rope_high_freq_factor", "rope_original_max_position_embeddings", "normalization_layer_epsilon",
    "logits_via_embedding", "qkv_bias", "use_qk_norm", "num_experts", "num_experts_per_tok", "base_moe_mlp_dim",
    "shared_experts", "first_num_dense_layers", "routed_score_func", "norm_topk_prob", "routed_scaling_factor",
    "routed_bias",
)
# Keys that name files or directories: each may be a local path or a URL (maxtrain.runtime.storage).
PATH_KEYS = ("base_output_directory", "train_files", "eval_files", "tokenizer_path", "load_full_state_path",
             "load_parameters_path")
# Training settings a model carries with it (a preset, an HF config.json, a checkpoint's description: HF's
# router_aux_loss_coef), which a fine-tune may change: never part of the model's shape.
MODEL_TRAINING_KEYS = ("load_balance_loss_weight",)
PRESET_KEYS = (*MODEL_KEYS, *MODEL_TRAINING_KEYS)
# Keys whose value must be one of a fixed set. remat policies are listed by maxtrain.models.remat.
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES,
    "weight_dtype": DTYPES,
    "mu_dtype": DTYPES,
    "learning_rate_schedule": ("cosine", "linear", "constant"),
    "dataset_type": ("synthetic", "text", "parquet", "array_record"),
    "tokenizer_type": ("byte", "sentencepiece", "huggingface"),
    "attention": ("auto", "dot_product", "blockwise", "jax_nn", "splash"),
    "distributed_init": ("auto", "true", "false"),
    "nan_policy": ("skip", "stop", "rollback"),
    "profiler": ("", "xplane"),
    "routed_score_func": ("softmax", "sigmoid"),
    "moe_grouped_matmul": ("auto", "megablox", "ragged_dot", "blocked"),
    "quantization": ("", *quantization.MODES),
}
POSITIVE_INTS = (
    "steps", "log_period", "vocab_size", "base_emb_dim", "base_num_query_heads",
    "base_num_kv_heads", "head_dim", "base_mlp_dim", "base_num_decoder_layers",
    "max_target_length", "gradient_accumulation_steps", "eval_steps", "compile_topology_num_slices",
    "distributed_heartbeat_timeout_seconds", "max_new_tokens", "profiler_start_step", "profiler_steps",
    "num_experts", "num_experts_per_tok",
)
INT_MAX = 2**31 - 1  # steps and sizes reach jax as int32
METRICS_BACKENDS = ("tensorboard", "jsonl", "wandb")
# Keys that were replaced: what to write instead.
RENAMED = {"enable_tensorboard": "replaced by metrics_backends (default tensorboard,jsonl; metrics_backends=jsonl "
                                 "writes no tensorboard events)"}

# The embedding and output matrices hold the vocabulary padded to a multiple of this (Megatron's default
# make_vocab_size_divisible_by), so a tensor axis of up to 128 splits them evenly whatever the true size
# (32001, 50257). A multiple that does not depend on the mesh keeps the checkpoint's shapes the same on
# every mesh: a run resumes on another. The padded entries' logits are masked (loss) or cut (logits).
VOCAB_MULTIPLE = 128


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
FLOAT32_MAX = 3.4028234663852886e38  # float keys reach jax as float32: larger is inf there
# Upper bounds (inclusive) of keys whose products reach jax as int32 or that unroll Python loops when
# traced, far above any real model's values (the presets' largest: 256 experts); beside each, what the
# allowed range means.
UPPER_BOUNDS: dict[str, tuple[int, str]] = {
    "per_device_batch_size": (INT_MAX, "sequences; the global batch reaches jax as int32"),
    # blockwise attention unrolls a block per 256 positions when traced
    "max_target_length": (2**21, "positions"),
    # the blocked grouped matmul pads each expert's rows to blocks of up to 512: rows reach jax as int32
    "num_experts": (2**16, "experts"),
    # capacity = factor x length x top-k / experts: below 2**31 with the length's bound
    "capacity_factor": (1000, "<= 0 is dropless; above num_experts / num_experts_per_tok nothing is dropped"),
}
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ConfigError(UserError, ValueError):
    """A user-fixable config problem; `str()` is the one line the CLI prints."""
    kind = "config"

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class Config(Mapping):
    """Frozen, attribute-access view of the merged config."""

    def __init__(self, values: Mapping[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("Config is frozen; use config.replace(...)")

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def replace(self, **changes) -> "Config":
        return Config({**self._values, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def to_yaml(self) -> str:
        """The declared keys only (no derived values), so the file loads again as a config."""
        declared = _read_yaml(BASE_YML)
        return yaml.safe_dump({k: v for k, v in self._values.items() if k in declared}, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Reading and merging


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError("config", f"{path} is not a YAML text file") from None
    try:
        data = yaml_file.safe_load(text)
    except yaml_file.DuplicateKey as e:
        raise ConfigError(str(e.key), f"set twice in {path} (lines {e.lines[0]} and {e.lines[1]})") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError("config", f"{path}{where} is not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of key: value")
    return data


def _read_chain(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Values of `path` over those of its base_config chain (root first)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError("base_config", f"cycle through {path}")
    data = _read_yaml(path)
    parent = data.pop("base_config", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError("base_config", f"in {path} must be a path string")
    return {**_read_chain(path.parent / parent, seen + (path,)), **data}


def _parse_override(arg: str, defaults: Mapping[str, Any]) -> tuple[str, Any]:
    key, sep, text = arg.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(arg, "expected key=value")
    _check_known(key, defaults)
    default = defaults[key]
    if isinstance(default, bool):
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return key, True
        if low in ("false", "0", "no"):
            return key, False
        raise ConfigError(key, f"expected true or false, got {text!r}")
    if isinstance(default, int):
        try:
            return key, int(text)
        except ValueError:
            raise ConfigError(key, f"expected an integer, got {text!r}") from None
    if isinstance(default, float):
        try:
            return key, float(text)
        except ValueError:
            raise ConfigError(key, f"expected a number, got {text!r}") from None
    if isinstance(default, str):
        return key, text
    try:  # lists: YAML flow syntax, e.g. logical_axis_rules='[["batch","data"]]'
        return key, yaml_file.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(key, f"expected a YAML list, got {text!r}") from None


def _check_known(key: str, defaults: Mapping[str, Any]) -> None:
    if key in defaults:
        return
    if key in RENAMED:
        raise ConfigError(key, RENAMED[key])
    close = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ConfigError(key, f"unknown key{hint}")


def _check_type(key: str, value: Any, default: Any) -> Any:
    kind = type(default)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and abs(value) > INT_MAX:
            raise ConfigError(key, f"{value} is out of range (at most {INT_MAX})")
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) and 1.0e3 (no sign) as strings
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            value = float(value) if ok else value
        except OverflowError:  # an int beyond any float
            raise ConfigError(key, f"must be a finite number, got {value}") from None
        if ok and not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value}")
        if ok and abs(value) > FLOAT32_MAX and key not in UPPER_BOUNDS:  # those name their own range
            raise ConfigError(key, f"{value!r} is out of range (at most {FLOAT32_MAX:.4g} in magnitude: float32)")
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def config_path(arg: str) -> Path:
    """The config file as given or, where no such file exists, the one the package ships: `base.yml` and
    `configs/base.yml` work from any directory once maxtrain is installed."""
    given = Path(arg)
    for shipped in (CONFIG_DIR / arg, CONFIG_DIR / arg.removeprefix("configs/")):
        if not given.exists() and shipped.is_file():
            return shipped
    return given


def defaults() -> dict[str, Any]:
    """Every key's default, from base.yml."""
    return _read_yaml(BASE_YML)


def load(argv: Sequence[str]) -> Config:
    """argv = [config.yml, key=value, ...] -> validated Config (devices not yet known)."""
    if not argv or "=" in argv[0]:
        raise ConfigError("config", "first argument must be a YAML config file")
    defaults = _read_yaml(BASE_YML)
    files = _read_chain(config_path(argv[0]))
    for key in files:
        _check_known(key, defaults)
    overrides = dict(_parse_override(arg, defaults) for arg in argv[1:])

    model_name = overrides.get("model_name", files.get("model_name", defaults["model_name"]))
    preset = {} if model_name == "default" else _read_preset(model_name)

    values = {**defaults, **files, **preset, **overrides}
    for key, value in values.items():
        values[key] = _check_type(key, value, defaults[key])
    values["run_name_derived"] = not values["run_name"]  # none given: named after what defines the run
    values["run_name"] = values["run_name"] or run_name_lib.derive(argv[0], values, defaults)
    _validate(values)
    return Config(_derive_static(values))


def _read_preset(name: str) -> dict[str, Any]:
    known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yml"))
    if name not in known:  # a name, never a path: `../base` would read base.yml as a preset
        raise ConfigError("model_name", f"no preset {name!r}; known: default, {', '.join(known)}")
    path = CONFIG_DIR / "models" / f"{name}.yml"
    preset = _read_yaml(path)
    for key in preset:
        if key not in PRESET_KEYS:
            raise ConfigError(key, f"model preset {path.name} may only set model keys")
    return preset


# ---------------------------------------------------------------------------------------------
# Validation


def _validate(c: dict[str, Any]) -> None:
    from maxtrain.models.remat import POLICY_NAMES  # the remat module owns the list of policies

    choices = {**CHOICES, "remat_policy": POLICY_NAMES}
    for key, allowed in choices.items():
        if c[key] not in allowed:
            shown = ", ".join(a or '""' for a in allowed)
            raise ConfigError(key, f"{c[key]!r} is not one of {shown}")
    for key in POSITIVE_INTS:
        if c[key] <= 0:
            raise ConfigError(key, f"must be a positive integer, got {c[key]}")
    if c["per_device_batch_size"] <= 0:
        raise ConfigError("per_device_batch_size", "must be > 0")
    for key, (most, meaning) in UPPER_BOUNDS.items():
        if c[key] > most:
            raise ConfigError(key, f"{c[key]!r} is out of range: at most {most} ({meaning})")
    if c["head_dim"] % 2:
        raise ConfigError("head_dim", f"{c['head_dim']} must be even (RoPE rotates pairs of dimensions)")
    if c["data_shuffle_seed"] < 0:
        raise ConfigError("data_shuffle_seed", f"must be >= 0, got {c['data_shuffle_seed']}")
    if c["base_num_query_heads"] % c["base_num_kv_heads"]:
        raise ConfigError("base_num_kv_heads", f"{c['base_num_kv_heads']} must divide "
                          f"base_num_query_heads={c['base_num_query_heads']}")
    if not 0 <= c["warmup_steps_fraction"] <= 1:
        raise ConfigError("warmup_steps_fraction", "must be in [0, 1]")
    if not 0 <= c["cosine_learning_rate_final_fraction"] <= 1:
        raise ConfigError("cosine_learning_rate_final_fraction", "must be in [0, 1]")
    for key in ("adam_b1", "adam_b2"):
        if not 0 <= c[key] < 1:
            raise ConfigError(key, "must be in [0, 1)")
    for key in ("learning_rate", "adam_eps", "adam_weight_decay", "gradient_clipping_threshold",
                "z_loss_multiplier", "peak_tflops_per_device", "normalization_layer_epsilon", "temperature",
                "top_k", "load_balance_loss_weight", "router_z_loss_weight", "routed_bias_update_rate",
                "shared_experts", "first_num_dense_layers"):
        if c[key] < 0:
            raise ConfigError(key, "must be >= 0")
    backends = [b.strip() for b in c["metrics_backends"].split(",") if b.strip()]
    for b in backends:
        if b not in METRICS_BACKENDS:
            raise ConfigError("metrics_backends", f"{b!r} is not one of {', '.join(METRICS_BACKENDS)}")
        if backends.count(b) > 1:
            raise ConfigError("metrics_backends", f"{b!r} is named twice")
    c["metrics_backends"] = ",".join(backends)
    if c["scan_unroll"] == 0 or c["scan_unroll"] < -1:
        raise ConfigError("scan_unroll", "must be positive or -1 (auto)")
    for key in ("loss_chunk_size", "mlp_chunk_size"):
        if c[key] < -1 or (c[key] > 0 and c["max_target_length"] % c[key]):
            raise ConfigError(key, f"must be -1 (auto), 0 or divide max_target_length={c['max_target_length']}")
    if c["attention"] == "splash" and c["max_target_length"] % 128:
        raise ConfigError("attention", f"splash needs max_target_length divisible by 128, got {c['max_target_length']}")
    if c["rope_theta"] <= 0:
        raise ConfigError("rope_theta", "must be > 0")
    if c["rope_scaling_factor"] < 1:
        raise ConfigError("rope_scaling_factor", "must be >= 1 (1 = no scaling)")
    if c["rope_scaling_factor"] > 1 and not 0 < c["rope_low_freq_factor"] < c["rope_high_freq_factor"]:
        raise ConfigError("rope_high_freq_factor", "must exceed rope_low_freq_factor, which must be > 0")
    if c["rope_original_max_position_embeddings"] <= 0:
        raise ConfigError("rope_original_max_position_embeddings", "must be a positive integer")
    if c["learning_rate_schedule_steps"] == 0 or c["learning_rate_schedule_steps"] < -1:
        raise ConfigError("learning_rate_schedule_steps", "must be -1 (= steps) or positive")
    if c["max_nonfinite_steps"] < 0:
        raise ConfigError("max_nonfinite_steps", "must be >= 0")
    if c["loss_spike_factor"] != 0 and c["loss_spike_factor"] <= 1:
        raise ConfigError("loss_spike_factor", "must be 0 (no spike test) or > 1")
    for key in ("checkpoint_period", "max_num_checkpoints_to_keep"):
        if c[key] < (1 if key == "checkpoint_period" else 0):
            raise ConfigError(key, "must be a positive integer" if key == "checkpoint_period" else "must be >= 0")
    if not 0 <= c["eval_split_fraction"] < 1:
        raise ConfigError("eval_split_fraction", "must be in [0, 1)")
    if c["eval_interval"] < 0 or c["grain_worker_count"] < 0:
        raise ConfigError("eval_interval" if c["eval_interval"] < 0 else "grain_worker_count", "must be >= 0")
    if c["num_epochs"] == 0 or c["num_epochs"] < -1:
        raise ConfigError("num_epochs", "must be positive or -1 (repeat)")
    if c["dataset_type"] != "synthetic" and not c["train_files"]:
        raise ConfigError("train_files", f"dataset_type={c['dataset_type']} needs train_files (comma-separated globs)")
    for key in PATH_KEYS:  # URLs: a scheme that cannot be used is one line naming the key
        for value in c[key].split(",") if key.endswith("_files") else [c[key]]:
            storage.check(value.strip(), key)
    if c["load_full_state_path"] and c["load_parameters_path"]:
        raise ConfigError("load_parameters_path", "set either load_full_state_path or load_parameters_path, not both")
    if not RUN_NAME.fullmatch(c["run_name"]):
        raise ConfigError("run_name", f"{c['run_name']!r} is not a plain name (letters, digits, '.', '_', '-'; "
                          "not starting with '.')")
    for group in ("ici", "dcn"):
        sizes = {a: c[f"{group}_{a}_parallelism"] for a in MESH_AXES}
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(f"{group}_{axis}_parallelism", "must be positive or -1 (fill)")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(f"{group}_*_parallelism", "at most one axis per group may be -1")
    _validate_moe(c)
    quantization.validate(c, ConfigError)
    _validate_rules(c["logical_axis_rules"])
    _validate_prompt_ids(c["prompt_ids"], c["vocab_size"])
    if c["top_k"] > c["vocab_size"]:
        raise ConfigError("top_k", f"{c['top_k']} exceeds vocab_size={c['vocab_size']}")


def _validate_moe(c: dict[str, Any]) -> None:
    if c["num_experts_per_tok"] > c["num_experts"]:
        raise ConfigError("num_experts_per_tok", f"{c['num_experts_per_tok']} exceeds num_experts={c['num_experts']}")
    if c["base_moe_mlp_dim"] == 0 or c["base_moe_mlp_dim"] < -1:
        raise ConfigError("base_moe_mlp_dim", "must be positive or -1 (= base_mlp_dim)")
    if c["routed_scaling_factor"] <= 0:
        raise ConfigError("routed_scaling_factor", "must be > 0")
    if c["num_experts"] == 1:  # a dense model: the MoE keys that shape the model must stay at their defaults
        for key in ("shared_experts", "first_num_dense_layers", "routed_bias"):
            if c[key]:
                raise ConfigError(key, "needs num_experts > 1 (a mixture of experts)")
    elif c["first_num_dense_layers"] >= c["base_num_decoder_layers"]:
        raise ConfigError("first_num_dense_layers", f"{c['first_num_dense_layers']} leaves no MoE layer of "
                          f"base_num_decoder_layers={c['base_num_decoder_layers']}")


def prompt_token_ids(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


def _validate_prompt_ids(text: str, vocab_size: int) -> None:
    try:
        ids = prompt_token_ids(text)
    except ValueError:
        raise ConfigError("prompt_ids", f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError("prompt_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def _validate_rules(rules: Any) -> None:
    key = "logical_axis_rules"
    if not isinstance(rules, list):
        raise ConfigError(key, "must be a list of [logical_name, mesh_axis | [mesh_axes] | null]")
    for rule in rules:
        if not (isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(key, f"bad rule {rule!r}; expected [logical_name, mesh_axes]")
        target = rule[1]
        axes = [] if target is None else [target] if isinstance(target, str) else target
        if not isinstance(axes, list) or any(a not in MESH_AXES for a in axes):
            raise ConfigError(key, f"rule {rule!r}: mesh axes must be among {', '.join(MESH_AXES)}")


def no_effect_warnings(c: Mapping[str, Any]) -> list[str]:
    """Settings that cannot take effect in this run, each as `<key>: ...`: not errors (a shared config may
    carry them), but a user who set them expects something that will not happen."""
    warnings = []
    if c["eval_interval"] > 0:  # data.make_iterators makes eval batches only from eval_files or a split
        if c["dataset_type"] == "synthetic":
            warnings.append(f"eval_interval: {c['eval_interval']} has no effect: dataset_type=synthetic has no "
                            "eval data")
        elif not c["eval_files"] and c["eval_split_fraction"] == 0:
            warnings.append(f"eval_interval: {c['eval_interval']} has no effect: no eval data (set eval_files or "
                            "eval_split_fraction)")
    if c["profiler"] and c["profiler_start_step"] > c["steps"]:
        warnings.append(f"profiler_start_step: {c['profiler_start_step']} is after the last step (steps="
                        f"{c['steps']}): profiler={c['profiler']} traces nothing")
    if c["capacity_factor"] > 0 and c["num_experts"] == 1:
        warnings.append(f"capacity_factor: {c['capacity_factor']} has no effect: num_experts=1 (a dense model)")
    return warnings


# ---------------------------------------------------------------------------------------------
# Derived values


def _derive_static(c: dict[str, Any]) -> dict[str, Any]:
    if c["learning_rate_schedule_steps"] == -1:
        c["learning_rate_schedule_steps"] = c["steps"]
    c["moe_mlp_dim"] = c["base_mlp_dim"] if c["base_moe_mlp_dim"] == -1 else c["base_moe_mlp_dim"]
    spec = registry.spec_for(c)  # the model's family counts its parameters
    c["num_params"] = spec.count_params(c, False)
    c["num_active_params"] = spec.count_params(c, True)
    return c
