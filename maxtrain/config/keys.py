"""The config's vocabulary: which keys are the model's, which name files, which take a fixed set of values
or a bounded range, and the one error type a config problem raises. base.yml holds each key's default
and meaning; this module holds what base.yml cannot say."""

from __future__ import annotations

import re

from maxtrain.models import quantization
from maxtrain.runtime.errors import ConfigError  # noqa: F401 (its home is runtime.errors; imported from here too)


def parallelism_key(group: str, axis: str) -> str:
    """The key that sizes mesh `axis` in `group` (ici or dcn): MaxText's names, `pipeline` for stage."""
    return f"{group}_{'pipeline' if axis == 'stage' else axis}_parallelism"


DTYPES = ("float32", "bfloat16")
MODEL_KEYS = (
    "vocab_size", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim",
    "base_mlp_dim", "base_num_decoder_layers", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
    "rope_high_freq_factor", "rope_original_max_position_embeddings", "normalization_layer_epsilon",
    "logits_via_embedding", "qkv_bias", "use_qk_norm", "num_experts", "num_experts_per_tok", "base_moe_mlp_dim",
    "shared_experts", "first_num_dense_layers", "routed_score_func", "norm_topk_prob", "routed_scaling_factor",
    "routed_bias", "rope_type", "rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_truncate",
    "attention_out_bias", "query_pre_attn_scalar", "sliding_window_size", "global_layer_interval", "local_rope_theta",
    "attention_sinks", "attn_logit_softcapping", "final_logit_softcapping", "scale_embedding", "rms_norm_plus_one",
    "use_post_attn_norm", "use_post_ffw_norm", "mlp_activation", "mlp_activation_limit", "mlp_bias",
    "router_logit_bias", "attention_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "rope_yarn_mscale", "rope_yarn_mscale_all_dim", "n_routing_groups", "topk_routing_group",
    "mtp_num_layers", "interleave_moe_layer_step", "nope_layer_interval", "chunk_attn_window_size", "use_qk_l2_norm", "temperature_tuning",
    "temperature_tuning_scale", "temperature_tuning_floor_scale",
)
# Keys that name files or directories: each may be a local path or a URL (maxtrain.runtime.storage).
PATH_KEYS = ("prompt_file", "base_output_directory", "train_files", "eval_files", "tokenizer_path", "load_full_state_path",
             "load_parameters_path", "prepared_dir")
# Settings a model carries with it (a preset, an HF config.json, a checkpoint's description: HF's
# router_aux_loss_coef, its context length), which a fine-tune may change: never part of the model's shape.
MODEL_TRAINING_KEYS = ("load_balance_loss_weight", "mtp_loss_scaling_factor", "max_position_embeddings")
PRESET_KEYS = (*MODEL_KEYS, *MODEL_TRAINING_KEYS)
# Keys whose value must be one of a fixed set. remat policies are listed by maxtrain.parallel.remat.
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", *DTYPES),
    "weight_dtype": DTYPES,
    "mu_dtype": DTYPES,
    "lr_schedule_type": ("cosine", "wsd", "linear", "constant"),
    "wsd_decay_style": ("linear", "cosine"),
    "dataset_type": ("synthetic", "prepared", "text", "parquet", "array_record"),
    "tokenizer_type": ("byte", "sentencepiece", "huggingface"),
    "attention": ("auto", "dot_product", "blockwise", "jax_nn", "splash", "tokamax_splash"),
    "context_parallel_strategy": ("all_gather", "ring"),
    "distributed_init": ("auto", "true", "false"),
    "nan_policy": ("skip", "stop", "rollback"),
    "data_source_exhausted": ("repeat", "drop"),
    "profiler": ("", "xplane"),
    "routed_score_func": ("softmax", "sigmoid"),
    "rope_type": ("llama3", "linear", "yarn"),
    "mlp_activation": ("silu", "gelu_tanh", "clamped_swiglu"),
    "attention_type": ("gqa", "mla"),
    "moe_grouped_matmul": ("auto", "tokamax", "megablox", "ragged_dot", "blocked"),
    "quantization": ("", *quantization.MODES),
}
POSITIVE_INTS = (
    "steps", "log_period", "vocab_size", "base_emb_dim", "base_num_query_heads",
    "base_num_kv_heads", "head_dim", "base_mlp_dim", "base_num_decoder_layers",
    "max_target_length", "gradient_accumulation_steps", "eval_steps", "compile_topology_num_slices",
    "distributed_heartbeat_timeout_seconds", "max_new_tokens", "profiler_start_step", "profiler_steps",
    "num_experts", "num_experts_per_tok", "ici_pipeline_parallelism", "dcn_pipeline_parallelism",
    "generate_batch_size", "grain_shuffle_buffer_size",
)
INT_MAX = 2**31 - 1  # steps and sizes reach jax as int32
METRICS_BACKENDS = ("tensorboard", "jsonl", "wandb")
# Keys that were replaced: what to write instead.
RENAMED = {"learning_rate_schedule": "renamed lr_schedule_type (MaxText's name): cosine | wsd | linear | constant",
           "enable_tensorboard": "replaced by metrics_backends (default tensorboard,jsonl; metrics_backends=jsonl "
                                 "writes no tensorboard events)"}

# Values config.load derives from the keys alone and adds to the config (those that need the devices:
# maxtrain.config.resolve.DERIVED).
DERIVED_AT_LOAD = ("run_name_derived", "moe_mlp_dim", "num_params", "num_active_params")


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


