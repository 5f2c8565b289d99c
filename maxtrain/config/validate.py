"""Checks of a merged config, each a ConfigError naming the key, before anything compiles; and the settings
that are valid but cannot take effect (no_effect_warnings)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from maxtrain.config.keys import (CHOICES, parallelism_key, METRICS_BACKENDS, PATH_KEYS, POSITIVE_INTS, RUN_NAME,
                                  UPPER_BOUNDS, ConfigError)
from maxtrain.config.data_sources import validate_sources
from maxtrain.ops.attention import SPLASH
from maxtrain.parallel.mesh import MESH_AXES
from maxtrain.models import quantization, registry, stacks as stacks_lib
from maxtrain.runtime import base_yml, storage



def validate(c: dict[str, Any]) -> None:
    """Every check that needs only the config (those that need the devices: maxtrain.config.resolve)."""
    from maxtrain.parallel.remat import POLICY_NAMES  # the remat module owns the list of policies

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
    if c["warmup_steps"] < -1:
        raise ConfigError("warmup_steps", f"must be -1 (= warmup_steps_fraction of the schedule) or >= 0, got "
                          f"{c['warmup_steps']}")
    for key in ("cosine_learning_rate_final_fraction", "wsd_decay_steps_fraction"):
        if not 0 <= c[key] <= 1:
            raise ConfigError(key, "must be in [0, 1]")
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
    if c["attention"] in SPLASH and c["max_target_length"] % 128:
        raise ConfigError("attention", f"{c['attention']} needs max_target_length divisible by 128, got "
                                       f"{c['max_target_length']}")
    if c["rope_theta"] <= 0:
        raise ConfigError("rope_theta", "must be > 0")
    if c["rope_scaling_factor"] < 1:
        raise ConfigError("rope_scaling_factor", "must be >= 1 (1 = no scaling)")
    if c["rope_scaling_factor"] > 1 and not 0 < c["rope_low_freq_factor"] <= c["rope_high_freq_factor"]:
        raise ConfigError("rope_high_freq_factor", "must be at least rope_low_freq_factor, which must be > 0 (equal: "
                          "no band between the scaled and the kept frequencies, as Llama 4 Scout's)")
    if c["rope_original_max_position_embeddings"] <= 0:
        raise ConfigError("rope_original_max_position_embeddings", "must be a positive integer")
    _validate_attention_variants(c)
    if c["learning_rate_schedule_steps"] == 0 or c["learning_rate_schedule_steps"] < -1:
        raise ConfigError("learning_rate_schedule_steps", "must be -1 (= steps) or positive")
    if c["max_nonfinite_steps"] < 0:
        raise ConfigError("max_nonfinite_steps", "must be >= 0")
    if c["loss_spike_factor"] != 0 and c["loss_spike_factor"] <= 1:
        raise ConfigError("loss_spike_factor", "must be 0 (no spike test) or > 1")
    for key in ("checkpoint_period", "max_num_checkpoints_to_keep"):
        if c[key] < (1 if key == "checkpoint_period" else 0):
            raise ConfigError(key, "must be a positive integer" if key == "checkpoint_period" else "must be >= 0")
    _validate_local_tier(c)
    if not 0 <= c["eval_split_fraction"] < 1:
        raise ConfigError("eval_split_fraction", "must be in [0, 1)")
    if c["eval_interval"] < 0:
        raise ConfigError("eval_interval", "must be >= 0")
    for key in ("grain_worker_count", "prepare_workers"):
        if c[key] < -1 or (key == "prepare_workers" and c[key] == 0):
            raise ConfigError(key, "must be -1 (auto) or " + ("positive" if key == "prepare_workers" else ">= 0"))
    if c["num_epochs"] == 0 or c["num_epochs"] < -1:
        raise ConfigError("num_epochs", "must be positive or -1 (repeat)")
    validate_sources(c)
    if c["dataset_type"] != "synthetic" and not c["train_files"] and not c["data_sources"]:
        raise ConfigError("train_files", f"dataset_type={c['dataset_type']} needs train_files (comma-separated globs)")
    if c["dataset_type"] == "prepared" and not c["data_sources"]:
        for key in ("train_files", "eval_files"):
            if "," in c[key] or any(ch in c[key] for ch in "*?["):
                raise ConfigError(key, f"{c[key]!r}: dataset_type=prepared reads one directory, the prepared_dir "
                                  "that python -m maxtrain.prepare wrote")
    for key in PATH_KEYS:  # URLs: a scheme that cannot be used is one line naming the key
        for value in c[key].split(",") if key.endswith("_files") else [c[key]]:
            storage.check(value.strip(), key)
    if c["load_full_state_path"] and c["load_parameters_path"]:
        raise ConfigError("load_parameters_path", "set either load_full_state_path or load_parameters_path, not both")
    if not RUN_NAME.fullmatch(c["run_name"]):
        raise ConfigError("run_name", f"{c['run_name']!r} is not a plain name (letters, digits, '.', '_', '-'; "
                          "not starting with '.')")
    for group in ("ici", "dcn"):
        sizes = {a: c[parallelism_key(group, a)] for a in MESH_AXES}
        for axis, size in sizes.items():
            if size == 0 or size < -1:
                raise ConfigError(parallelism_key(group, axis), "must be positive or -1 (fill)")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(f"{group}_*_parallelism", "at most one axis per group may be -1")
    _validate_moe(c)
    _validate_mla(c)
    _validate_mtp(c)
    pipeline_settings(c)
    quantization.validate(c, ConfigError)
    _validate_rules(c["logical_axis_rules"])
    _validate_prompt_ids(c["prompt_ids"], c["vocab_size"])
    if c["top_k"] > c["vocab_size"]:
        raise ConfigError("top_k", f"{c['top_k']} exceeds vocab_size={c['vocab_size']}")
    _validate_sampling(c)
    _validate_family(c)


def _validate_local_tier(c) -> None:
    if c["failure_interval_hours"] < 0:
        raise ConfigError("failure_interval_hours", "must be >= 0 (0: 50,000 chip-hours / chips)")
    local, period = c["local_checkpoint_directory"], c["local_checkpoint_period"]
    if period < 0:
        raise ConfigError("local_checkpoint_period", "must be >= 0")
    if not local:
        if period:
            raise ConfigError("local_checkpoint_period", "needs local_checkpoint_directory (a RAM disk or local "
                              "SSD on every host, e.g. /mnt/ramdisk/ckpt)")
        return
    if "://" in local:
        raise ConfigError("local_checkpoint_directory", f"{local}: must be a path on each host's own disk (the "
                          "persistent tier, base_output_directory, is the one for gs://)")
    if not period:
        raise ConfigError("local_checkpoint_directory", "needs local_checkpoint_period (save locally every this "
                          "many steps, fewer than checkpoint_period)")
    if not c["enable_checkpointing"]:
        raise ConfigError("local_checkpoint_directory", "needs enable_checkpointing=true (the local tier is the "
                          "second of two)")


def _validate_attention_variants(c: dict[str, Any]) -> None:
    for key in ("sliding_window_size", "global_layer_interval", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "rope_yarn_beta_slow"):
        if c[key] < 0:
            raise ConfigError(key, f"must be >= 0, got {c[key]}")
    if c["global_layer_interval"] and not c["sliding_window_size"]:
        raise ConfigError("global_layer_interval", "needs sliding_window_size > 0 (without a window every layer "
                          "sees every key)")
    if c["global_layer_interval"] > c["base_num_decoder_layers"]:
        raise ConfigError("global_layer_interval", f"{c['global_layer_interval']} exceeds base_num_decoder_layers="
                          f"{c['base_num_decoder_layers']}: no layer would be global")
    if c["local_rope_theta"] != -1 and c["local_rope_theta"] <= 0:
        raise ConfigError("local_rope_theta", "must be > 0, or -1 (sliding layers use rope_theta)")
    if c["rope_yarn_beta_fast"] <= c["rope_yarn_beta_slow"]:
        raise ConfigError("rope_yarn_beta_fast", f"must exceed rope_yarn_beta_slow={c['rope_yarn_beta_slow']}")
    if c["global_layer_interval"] and c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"] > 1:
        raise ConfigError("global_layer_interval", "a pattern of sliding and global layers cannot be pipelined yet "
                          "(ici/dcn_pipeline_parallelism=1)")
    if c["mlp_activation_limit"] <= 0:
        raise ConfigError("mlp_activation_limit", "must be > 0")
    _validate_interleave(c)


def _validate_interleave(c: dict[str, Any]) -> None:
    """MoE layers every Nth layer, dense ones between (maxtrain.models.stacks: a scanned step of N layers)."""
    step = c["interleave_moe_layer_step"]
    if step < 1:
        raise ConfigError("interleave_moe_layer_step", f"must be >= 1, got {step}")
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
    if c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"] > 1:
        raise ConfigError("interleave_moe_layer_step", "interleaved MoE and dense layers cannot be pipelined yet "
                          "(ici/dcn_pipeline_parallelism=1)")


def _validate_family(c: dict[str, Any]) -> None:
    """A family's own keys at base.yml's values in another family's config, and the family's own checks."""
    spec = registry.spec_for(c)
    for other in registry.families():
        key = next(iter(base_yml.changed(c, other.own_keys)), None) if other is not spec else None
        if key:
            raise ConfigError(key, f"only {other.name} models read it (maxtrain/models/{other.name}.py), and this "
                              f"one is {spec.name}'s ({other.matches_hint} makes a model {other.name}'s)")
    if spec.checks:
        spec.checks(c)


# What multi-head latent attention does not do (yet): each of these keys must keep its plain value.
MLA_EXCLUDES = (("sliding_window_size", 0), ("attention_sinks", False), ("use_qk_norm", False), ("qkv_bias", False),
                ("attention_out_bias", False), ("attn_logit_softcapping", 0.0))


def _validate_mla(c: dict[str, Any]) -> None:
    if c["rope_yarn_mscale"] < 0 or c["rope_yarn_mscale_all_dim"] < 0:
        raise ConfigError("rope_yarn_mscale" if c["rope_yarn_mscale"] < 0 else "rope_yarn_mscale_all_dim",
                          "must be >= 0 (0 = not set)")
    if c["attention_type"] != "mla":
        return
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if c[key] <= 0:
            raise ConfigError(key, f"must be a positive integer with attention_type=mla, got {c[key]}")
    if c["q_lora_rank"] < 0:
        raise ConfigError("q_lora_rank", f"must be >= 0 (0 = a full query projection), got {c['q_lora_rank']}")
    if c["qk_rope_head_dim"] % 2:
        raise ConfigError("qk_rope_head_dim", f"{c['qk_rope_head_dim']} must be even (RoPE rotates pairs)")
    if c["base_num_kv_heads"] != c["base_num_query_heads"]:
        raise ConfigError("base_num_kv_heads", f"{c['base_num_kv_heads']}: with attention_type=mla every query head "
                          f"has its own keys and values (set it to base_num_query_heads={c['base_num_query_heads']})")
    for key, plain in MLA_EXCLUDES:
        if c[key] != plain:
            raise ConfigError(key, f"{c[key]!r} is not supported with attention_type=mla (needs {plain!r})")


MAX_MTP_DEPTHS = 8  # each depth is a layer of its own in the step: 63 compiled for over 5 minutes in 5 GiB


def _validate_mtp(c: dict[str, Any]) -> None:
    if c["mtp_num_layers"] < 0 or c["mtp_num_layers"] >= c["max_target_length"]:
        raise ConfigError("mtp_num_layers", f"must be in [0, max_target_length={c['max_target_length']}), got "
                          f"{c['mtp_num_layers']}")
    if c["mtp_num_layers"] > MAX_MTP_DEPTHS:
        raise ConfigError("mtp_num_layers", f"{c['mtp_num_layers']}: at most {MAX_MTP_DEPTHS} (DeepSeek-V3 trains "
                          "with 1; each depth is a layer of its own, unrolled in the step: compile time and memory "
                          "grow with it)")
    if c["mtp_loss_scaling_factor"] < 0:
        raise ConfigError("mtp_loss_scaling_factor", "must be >= 0")
    if c["mtp_num_layers"] and c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"] > 1:
        raise ConfigError("mtp_num_layers", "multi-token prediction cannot be pipelined yet "
                          "(ici/dcn_pipeline_parallelism=1)")


def _validate_sampling(c: dict[str, Any]) -> None:
    if 0 < c["temperature"] < 1e-6:  # logits / temperature in float32: below this, greedy with extra steps
        raise ConfigError("temperature", f"must be 0 (greedy) or at least 1e-6, got {c['temperature']}")
    if not 0 < c["top_p"] <= 1:
        raise ConfigError("top_p", f"must be in (0, 1] (1 = off), got {c['top_p']}")
    if c["sample_interval"] < 0:
        raise ConfigError("sample_interval", "must be >= 0 (0 = never)")
    prompts = c["sample_prompts"]
    if not all(isinstance(p, str) and p for p in prompts):
        raise ConfigError("sample_prompts", f"must be a list of non-empty strings, e.g. '[\"ROMEO:\"]', got {prompts!r}")
    if c["sample_interval"] and not prompts:
        raise ConfigError("sample_prompts", "sample_interval needs prompts to continue, e.g. "
                          "sample_prompts='[\"ROMEO:\"]'")


def _validate_moe(c: dict[str, Any]) -> None:
    if c["num_experts_per_tok"] > c["num_experts"]:
        raise ConfigError("num_experts_per_tok", f"{c['num_experts_per_tok']} exceeds num_experts={c['num_experts']}")
    if c["base_moe_mlp_dim"] == 0 or c["base_moe_mlp_dim"] < -1:
        raise ConfigError("base_moe_mlp_dim", "must be positive or -1 (= base_mlp_dim)")
    if c["routed_scaling_factor"] <= 0:
        raise ConfigError("routed_scaling_factor", "must be > 0")
    if c["num_experts"] == 1:  # a dense model: the MoE keys that shape the model must stay at their defaults
        for key in ("shared_experts", "first_num_dense_layers", "routed_bias", "n_routing_groups"):
            if c[key] and not (key == "n_routing_groups" and c[key] == -1):
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


def pipeline_settings(c: Mapping[str, Any]) -> dict[str, int]:
    """The pipeline's schedule: the pipeline keys with their -1s filled (the stages are known at load: no
    pipeline axis fills; the config keeps the keys as given, so a run's config.yml resumes on other stages),
    after the checks of docs/parallelism.md "Pipeline parallelism". The pipeline runs the model's last stack (a
    dense model's layers; an MoE model's MoE layers: its leading dense layers run before it, on every
    device, as the embedding does)."""
    stages = c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"]
    keys = ("num_pipeline_microbatches", "num_layers_per_pipeline_stage", "num_pipeline_repeats")
    for key in keys:
        if c[key] == 0 or c[key] < -1:
            raise ConfigError(key, "must be positive or -1 (auto)")
    last = stacks_lib.for_keys(c)[-1]
    if stages == 1:  # set anyway: a no-effect warning (a pipelined run's config resumed on one stage)
        return {"num_pipeline_microbatches": 1, "num_layers_per_pipeline_stage": last.count, "num_pipeline_repeats": 1}
    if not c["scan_layers"]:
        raise ConfigError("scan_layers", "false cannot run a pipeline: its stages run a scanned stack's layers")
    what = f"the pipeline's {last.count} layers ({last.name})"
    if last.count % stages:
        key = "ici_pipeline_parallelism" if c["ici_pipeline_parallelism"] > 1 else "dcn_pipeline_parallelism"
        raise ConfigError(key, f"{what} do not split into {stages} stages (ici x dcn)")
    share = last.count // stages
    per, repeats = c["num_layers_per_pipeline_stage"], c["num_pipeline_repeats"]
    if per != -1 and share % per:
        raise ConfigError("num_layers_per_pipeline_stage", f"{per} does not divide each stage's {share} layers "
                          f"({what} over {stages} stages)")
    if repeats != -1 and share % repeats:
        raise ConfigError("num_pipeline_repeats", f"{repeats} does not divide each stage's {share} layers "
                          f"({what} over {stages} stages)")
    if per != -1 and repeats != -1 and per * repeats != share:
        raise ConfigError("num_pipeline_repeats", f"{repeats} x num_layers_per_pipeline_stage {per} != each "
                          f"stage's {share} layers ({what} over {stages} stages)")
    if per == -1:
        per = share // (1 if repeats == -1 else repeats)
    micro = stages if c["num_pipeline_microbatches"] == -1 else c["num_pipeline_microbatches"]
    if micro % stages:
        raise ConfigError("num_pipeline_microbatches", f"{micro} is not a multiple of the {stages} stages: a "
                          "micro-batch must be back from the last stage before the first stage takes it again")
    return {"num_pipeline_microbatches": micro, "num_layers_per_pipeline_stage": per,
            "num_pipeline_repeats": share // per}


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
        if c["dataset_type"] == "synthetic" and not c["data_sources"]:
            warnings.append(f"eval_interval: {c['eval_interval']} has no effect: dataset_type=synthetic has no "
                            "eval data")
        elif not c["eval_files"] and not c["eval_sources"] and c["eval_split_fraction"] == 0:
            warnings.append(f"eval_interval: {c['eval_interval']} has no effect: no eval data (set eval_files or "
                            "eval_split_fraction)")
    for n, stage in enumerate(c["data_stages"]):
        if stage["start_step"] >= c["steps"]:
            warnings.append(f"data_stages[{n}]: start_step {stage['start_step']} is not before the last step (steps="
                            f"{c['steps']}): its weights are not used in this run")
    if c["profiler"] and c["profiler_start_step"] > c["steps"]:
        warnings.append(f"profiler_start_step: {c['profiler_start_step']} is after the last step (steps="
                        f"{c['steps']}): profiler={c['profiler']} traces nothing")
    if c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"] == 1:
        for key in ("num_pipeline_microbatches", "num_layers_per_pipeline_stage", "num_pipeline_repeats"):
            if c[key] != -1:
                warnings.append(f"{key}: {c[key]} has no effect: no pipeline (ici_pipeline_parallelism x "
                                "dcn_pipeline_parallelism = 1)")
    if c["capacity_factor"] > 0 and c["num_experts"] == 1:
        warnings.append(f"capacity_factor: {c['capacity_factor']} has no effect: num_experts=1 (a dense model)")
    local = c["local_checkpoint_period"]
    if c["local_checkpoint_directory"] and local and local % c["checkpoint_period"] == 0:
        warnings.append(f"local_checkpoint_period: {local} has no effect: every local step is a persistent one "
                        f"(checkpoint_period={c['checkpoint_period']}); save locally more often")
    return warnings
