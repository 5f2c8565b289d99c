"""The model's keys (groups `model`, its shape, and `model_training`, what a preset carries that a fine-tune may
change) and their checks. A family's own keys are declared in its module (Llama 4's in maxtrain/models/llama4.py)."""

from __future__ import annotations

from typing import Any

from maxtrain.config.schema import declared
from maxtrain.runtime.declaration import Key, declare
from maxtrain.runtime import base_yml
from maxtrain.runtime.errors import ConfigError


def _stages(c) -> int:
    return c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"]


def _not_pipelined(key: str, what: str):
    """A check: `what` (the key set) cannot run in a pipeline yet."""
    def check(c):
        if c[key] != base_yml.default(key) and _stages(c) > 1:
            raise ConfigError(key, f"{what} cannot be pipelined yet (ici/dcn_pipeline_parallelism=1)")
    return check


def _family(c: dict[str, Any]) -> None:
    """The family named is the one its keys describe; another family's own keys stay at base.yml's values."""
    from maxtrain.models import registry
    named, described = c["model_family"], registry.family_of_keys(c)
    if named != described.name:
        spec = registry.family(named)
        hint = (f" ({described.matches_hint})" if described.matches_hint else
                f" ({named} needs {spec.matches_hint})" if spec.matches_hint and not spec.matches(c) else "")
        raise ConfigError("model_family", f"{named}, but these model keys describe a {described.name} model{hint}: "
                          f"set model_family={described.name}, or change the keys")
    for key in declared().values():
        if key.family and key.family != named and c[key.name] != base_yml.default(key.name):
            raise ConfigError(key.name, f"only {key.family} models read it (maxtrain/models/{key.family}.py), and "
                              f"this one is model_family={named}")


def _kv_heads(c) -> None:
    if c["base_num_query_heads"] % c["base_num_kv_heads"]:
        raise ConfigError("base_num_kv_heads", f"{c['base_num_kv_heads']} must divide "
                          f"base_num_query_heads={c['base_num_query_heads']}")


def _head_dim(c) -> None:
    if c["head_dim"] % 2:
        raise ConfigError("head_dim", f"{c['head_dim']} must be even (RoPE rotates pairs of dimensions)")


def _rope_band(c) -> None:
    if c["rope_scaling_factor"] > 1 and not 0 < c["rope_low_freq_factor"] <= c["rope_high_freq_factor"]:
        raise ConfigError("rope_high_freq_factor", "must be at least rope_low_freq_factor, which must be > 0 (equal: "
                          "no band between the scaled and the kept frequencies, as Llama 4 Scout's)")


def _yarn_betas(c) -> None:
    if c["rope_yarn_beta_fast"] <= c["rope_yarn_beta_slow"]:
        raise ConfigError("rope_yarn_beta_fast", f"must exceed rope_yarn_beta_slow={c['rope_yarn_beta_slow']}")


def _global_layers(c) -> None:
    every = c["global_layer_interval"]
    if every and not c["sliding_window_size"]:
        raise ConfigError("global_layer_interval", "needs sliding_window_size > 0 (without a window every layer "
                          "sees every key)")
    if every > c["base_num_decoder_layers"]:
        raise ConfigError("global_layer_interval", f"{every} exceeds base_num_decoder_layers="
                          f"{c['base_num_decoder_layers']}: no layer would be global")
    _not_pipelined("global_layer_interval", "a pattern of sliding and global layers")(c)


def _interleave(c) -> None:
    """MoE layers every Nth layer, dense ones between (maxtrain.models.stacks: a scanned step of N layers)."""
    step = c["interleave_moe_layer_step"]
    if step == 1:
        return
    if c["num_experts"] == 1:
        raise ConfigError("interleave_moe_layer_step", "needs num_experts > 1 (it interleaves MoE and dense layers)")
    if c["base_num_decoder_layers"] % step:
        raise ConfigError("interleave_moe_layer_step", f"{step} must divide base_num_decoder_layers="
                          f"{c['base_num_decoder_layers']} (the layers scan in steps of {step})")
    for key in ("first_num_dense_layers", "mtp_num_layers"):
        if c[key]:
            raise ConfigError(key, f"must be 0 with interleave_moe_layer_step={step}")
    _not_pipelined("interleave_moe_layer_step", "interleaved MoE and dense layers")(c)


# What multi-head latent attention does not do (yet): each of these keys must keep its plain value.
MLA_EXCLUDES = (("sliding_window_size", 0), ("attention_sinks", False), ("use_qk_norm", False), ("qkv_bias", False),
                ("attention_out_bias", False), ("attn_logit_softcapping", 0.0))


def _mla(c: dict[str, Any]) -> None:
    if c["attention_type"] != "mla":
        return
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if c[key] <= 0:
            raise ConfigError(key, f"must be a positive integer with attention_type=mla, got {c[key]}")
    if c["qk_rope_head_dim"] % 2:
        raise ConfigError("qk_rope_head_dim", f"{c['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    if c["base_num_kv_heads"] != c["base_num_query_heads"]:
        raise ConfigError("base_num_kv_heads", f"{c['base_num_kv_heads']}: with attention_type=mla every query head "
                          f"has its own keys and values (set it to base_num_query_heads={c['base_num_query_heads']})")
    for key, plain in MLA_EXCLUDES:
        if c[key] != plain:
            raise ConfigError(key, f"{c[key]!r} is not supported with attention_type=mla (needs {plain!r})")


def _experts(c: dict[str, Any]) -> None:
    if c["num_experts_per_tok"] > c["num_experts"]:
        raise ConfigError("num_experts_per_tok", f"{c['num_experts_per_tok']} exceeds num_experts={c['num_experts']}")
    if c["num_experts"] == 1:  # a dense model: the MoE keys that shape the model must stay at their defaults
        for key in ("shared_experts", "first_num_dense_layers", "routed_bias", "n_routing_groups"):
            if c[key] != base_yml.default(key):
                raise ConfigError(key, "needs num_experts > 1 (a mixture of experts)")
        return
    if c["first_num_dense_layers"] >= c["base_num_decoder_layers"]:
        raise ConfigError("first_num_dense_layers", f"{c['first_num_dense_layers']} leaves no MoE layer of "
                          f"base_num_decoder_layers={c['base_num_decoder_layers']}")
    groups, top = c["n_routing_groups"], c["topk_routing_group"]
    if (groups == -1) != (top == -1):
        key = "topk_routing_group" if groups != -1 else "n_routing_groups"
        raise ConfigError(key, "n_routing_groups and topk_routing_group are set together (both -1: no groups)")
    if groups == -1:
        return
    if groups <= 0 or c["num_experts"] % groups:
        raise ConfigError("n_routing_groups", f"{groups} must be positive and divide num_experts={c['num_experts']}")
    if not 0 < top <= groups:
        raise ConfigError("topk_routing_group", f"{top} must be in [1, n_routing_groups={groups}]")
    if c["num_experts_per_tok"] > top * (c["num_experts"] // groups):
        raise ConfigError("num_experts_per_tok", f"{c['num_experts_per_tok']} exceeds the {top} groups' "
                          f"{top * (c['num_experts'] // groups)} experts a token may pick from")


MAX_MTP_DEPTHS = 8  # each depth is a layer of its own in the step: 63 compiled for over 5 minutes in 5 GiB


def _mtp(c: dict[str, Any]) -> None:
    if not 0 <= c["mtp_num_layers"] < c["max_target_length"]:
        raise ConfigError("mtp_num_layers", f"must be in [0, max_target_length={c['max_target_length']}), got "
                          f"{c['mtp_num_layers']}")
    _not_pipelined("mtp_num_layers", "multi-token prediction")(c)


def _family_names() -> tuple[str, ...]:
    from maxtrain.models import registry
    return tuple(s.name for s in registry.families())


def model(name: str, **kw) -> Key:
    return Key(name, "model", **kw)


POSITIVE = dict(at_least=1)
AT_LEAST_0 = dict(at_least=0)
declare(
    model("model_family", choices=_family_names, check=_family,
          in_run_name=False),  # the model keys say it: named runs from before the key keep their names
    model("vocab_size", **POSITIVE),
    model("base_emb_dim", **POSITIVE),
    model("base_num_query_heads", **POSITIVE),
    model("base_num_kv_heads", **POSITIVE, check=_kv_heads),
    model("head_dim", **POSITIVE, check=_head_dim),
    model("base_mlp_dim", **POSITIVE),
    model("base_num_decoder_layers", **POSITIVE),
    model("rope_theta", above=0),
    model("rope_scaling_factor", at_least=1, why="1 = no scaling"),
    model("rope_low_freq_factor"),
    model("rope_high_freq_factor", check=_rope_band),
    Key("max_position_embeddings", "model_training", **AT_LEAST_0),
    model("rope_original_max_position_embeddings", **POSITIVE),
    model("rope_type", choices=("llama3", "linear", "yarn")),
    model("rope_yarn_beta_fast", check=_yarn_betas),
    model("rope_yarn_beta_slow", **AT_LEAST_0),
    model("rope_yarn_truncate"),
    model("rope_yarn_mscale", **AT_LEAST_0, why="0 = not set"),
    model("rope_yarn_mscale_all_dim", **AT_LEAST_0, why="0 = not set"),
    model("normalization_layer_epsilon", **AT_LEAST_0),
    model("logits_via_embedding"),
    model("qkv_bias"),
    model("use_qk_norm"),
    model("attention_out_bias"),
    model("query_pre_attn_scalar", **AT_LEAST_0),
    model("sliding_window_size", **AT_LEAST_0),
    model("global_layer_interval", **AT_LEAST_0, check=_global_layers),
    model("local_rope_theta", above=0, auto=-1, why="sliding layers use rope_theta"),
    model("attention_sinks"),
    model("interleave_moe_layer_step", **POSITIVE, check=_interleave),
    model("attn_logit_softcapping", **AT_LEAST_0),
    model("final_logit_softcapping", **AT_LEAST_0),
    model("scale_embedding"),
    model("rms_norm_plus_one"),
    model("use_post_attn_norm"),
    model("use_post_ffw_norm"),
    model("mlp_activation", choices=("silu", "gelu_tanh", "clamped_swiglu")),
    model("mlp_activation_limit", above=0),
    model("mlp_bias"),
    model("router_logit_bias"),
    model("attention_type", choices=("gqa", "mla"), check=_mla),
    model("q_lora_rank", **AT_LEAST_0, why="0 = a full query projection"),
    model("kv_lora_rank"),
    model("qk_nope_head_dim"),
    model("qk_rope_head_dim"),
    model("v_head_dim"),
    # blocked grouped matmuls pad each expert's rows to blocks of up to 512: rows reach jax as int32
    model("num_experts", **POSITIVE, limit=(2**16, "experts"), check=_experts),
    model("num_experts_per_tok", **POSITIVE),
    model("base_moe_mlp_dim", **POSITIVE, auto=-1, why="= base_mlp_dim"),
    model("shared_experts", **AT_LEAST_0),
    model("first_num_dense_layers", **AT_LEAST_0),
    Key("load_balance_loss_weight", "model_training", **AT_LEAST_0),
    model("routed_score_func", choices=("softmax", "sigmoid")),
    model("norm_topk_prob"),
    model("routed_scaling_factor", above=0),
    model("routed_bias"),
    model("n_routing_groups"),
    model("topk_routing_group"),
    model("mtp_num_layers", limit=(MAX_MTP_DEPTHS, "DeepSeek-V3 trains with 1; each depth is a layer of "
                                                 "its own, unrolled in the step: compile time and memory grow with it"),
          check=_mtp),
    Key("mtp_loss_scaling_factor", "model_training", **AT_LEAST_0),
    model("scan_layers"),
)
