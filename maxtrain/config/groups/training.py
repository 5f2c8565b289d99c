"""The training keys (group `training`): the optimizer and its schedule, the loss, the step's numerics and where
the weights start from."""

from __future__ import annotations

from maxtrain.runtime import base_yml
from maxtrain.runtime.declaration import Key, declare
from maxtrain.models import quantization
from maxtrain.runtime.errors import ConfigError

DTYPES = ("float32", "bfloat16")
NARROW = 256  # widths below this are small enough that bfloat16 loses on CPU


def dtype_for(c, platform: str) -> str:
    """dtype=auto. bfloat16 halves the memory traffic of every activation, which is the step on TPU and GPU
    and for a model of some width on CPU; for a narrow one on CPU the matmuls are small and XLA:CPU's
    converts to and from bfloat16 around each of them cost more than bfloat16 saves."""
    return "float32" if platform == "cpu" and c["base_emb_dim"] < NARROW else "bfloat16"


def _one_start(c) -> None:
    if c["load_full_state_path"] and c["load_parameters_path"]:
        raise ConfigError("load_parameters_path", "set either load_full_state_path or load_parameters_path, not both")


def _dense_capacity(c) -> str | None:
    if c["capacity_factor"] > 0 and c["num_experts"] == 1:
        return f"capacity_factor: {c['capacity_factor']} has no effect: num_experts=1 (a dense model)"
    return None


def _muon_only(key: str):
    def no_effect(c) -> str | None:
        if c["opt_type"] != "muon" and c[key] != base_yml.default(key):
            return f"{key}: {c[key]} has no effect: opt_type={c['opt_type']} (it is Muon's)"
        return None
    return no_effect


def training(name: str, **kw) -> Key:
    return Key(name, "training", **kw)


UNIT = dict(at_least=0, at_most=1)
AT_LEAST_0 = dict(at_least=0)
declare(
    training("init_weights_seed"),
    training("capacity_factor",  # capacity = factor x length x top-k / experts: below 2**31 with the length's bound
             limit=(1000, "<= 0 is dropless; above num_experts / num_experts_per_tok nothing is dropped"),
             no_effect=_dense_capacity),
    training("router_z_loss_weight", **AT_LEAST_0),
    training("routed_bias_update_rate", **AT_LEAST_0),
    training("dtype", choices=("auto", *DTYPES), auto="auto", choose=dtype_for),
    training("weight_dtype", choices=DTYPES),
    training("mu_dtype", choices=DTYPES),
    training("nu_dtype", choices=("auto", *DTYPES), auto="auto", choose=lambda c, platform: c["weight_dtype"]),
    training("logits_dot_in_fp32"),
    training("quantization", choices=("", *quantization.MODES),
             check=lambda c: quantization.validate(c, ConfigError)),
    training("quantization_targets"),
    training("gradient_accumulation_steps", at_least=1),
    training("learning_rate", **AT_LEAST_0),
    training("lr_schedule_type", choices=("cosine", "wsd", "linear", "constant")),
    training("warmup_steps_fraction", **UNIT),
    training("warmup_steps", **AT_LEAST_0, auto=-1, why="= warmup_steps_fraction of the schedule"),
    training("cosine_learning_rate_final_fraction", **UNIT),
    training("wsd_decay_steps_fraction", **UNIT),
    training("wsd_decay_style", choices=("linear", "cosine")),
    training("adam_b1", at_least=0, below=1),
    training("adam_b2", at_least=0, below=1),
    training("adam_eps", **AT_LEAST_0),
    training("adam_eps_root", **AT_LEAST_0),
    training("adam_weight_decay", **AT_LEAST_0),
    training("opt_type", choices=("adamw", "muon")),
    training("muon_beta", at_least=0, below=1, no_effect=_muon_only("muon_beta")),
    training("muon_weight_decay", **AT_LEAST_0, no_effect=_muon_only("muon_weight_decay")),
    training("muon_consistent_rms", **AT_LEAST_0, no_effect=_muon_only("muon_consistent_rms")),
    training("gradient_clipping_threshold", **AT_LEAST_0),
    training("z_loss_multiplier", **AT_LEAST_0),
    training("load_full_state_path", path="input"),
    training("load_parameters_path", path="input", check=_one_start),
)
