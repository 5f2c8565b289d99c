"""The workloads benchmarks/compare.py runs: the CPU rows' shapes and MaxText's keys for them, and the
ahead-of-time rows (what is measured; compare.py says how)."""

SMALL = ["base_num_decoder_layers=4", "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4",
         "head_dim=64", "base_mlp_dim=1024", "max_target_length=256", "vocab_size=32000",
         "dtype=bfloat16", "weight_dtype=float32", "remat_policy=full", "scan_layers=true",
         "logits_dot_in_fp32=false"]  # as MaxText's runs: the logits matmul in the compute dtype
MEDIUM = ["base_num_decoder_layers=8", "base_emb_dim=512", "base_num_query_heads=8", "base_num_kv_heads=8",
          "head_dim=64", "base_mlp_dim=2048", "max_target_length=512", "vocab_size=32000",
          "dtype=bfloat16", "weight_dtype=float32", "remat_policy=full", "scan_layers=true",
          "logits_dot_in_fp32=false"]
# Issue #26's tiny shape (character-level Shakespeare's: ~1.2M parameters, 12 x 64 tokens, vocab 384).
# remat full as the other rows: MaxText 0.2.4 reads remat_policy=none as nn.remat with no policy, which
# is full remat too.
TINY = ["base_num_decoder_layers=4", "base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=4",
        "head_dim=32", "base_mlp_dim=512", "max_target_length=64", "vocab_size=384", "dtype=bfloat16",
        "weight_dtype=float32", "remat_policy=full", "scan_layers=true", "logits_dot_in_fp32=false"]
# The small shape as a Mixtral-style MoE: 8 experts of the small MLP's width, top-2, the top-2 weights
# renormalised (Mixtral's softmax over the chosen two), the same balancing-loss weight on both sides.
MOE = SMALL + ["model_family=mixtral", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=1024",
               "load_balance_loss_weight=0.01", "norm_topk_prob=true"]
# Long context: the small model on 2048-token sequences, each split over 4 devices (context parallelism,
# load-balanced on both sides, keys and values all-gathered: both frameworks' defaults), 2 sequences.
CONTEXT = [x for x in SMALL if not x.startswith("max_target_length")] + ["max_target_length=2048",
                                                                         "ici_context_parallelism=4"]
# Pipeline: the small model's 4 layers over 2 stages (2 each, GPipe) x fsdp 2, 8 micro-batches of 2
# sequences (MaxText splits each micro-batch over data x fsdp, so 2 rows at least: global batch 16).
PIPELINE = SMALL + ["ici_pipeline_parallelism=2", "num_pipeline_microbatches=8"]
# name, overrides, fake devices, global batch, MaxText s/step, MaxText tokens/s (None: the issue quotes none)
ROWS = [
    ("tiny", TINY, 1, 12, None, None),
    ("tiny fsdp=2", TINY, 2, 12, None, None),
    ("small", SMALL, 1, 4, 0.84, 1230),
    ("small float32", SMALL + ["dtype=float32"], 1, 4, 1.12, 914),
    ("small remat minimal", SMALL + ["remat_policy=minimal"], 1, 4, 0.84, 1228),
    ("small fsdp=4", SMALL, 4, 4, 0.96, 1070),
    ("medium", MEDIUM, 1, 4, 6.22, 331),
    ("medium remat minimal", MEDIUM + ["remat_policy=minimal"], 1, 4, 5.53, 371),
    ("moe 8x top-2", MOE, 1, 4, None, None),
    ("context=4 2048", CONTEXT, 4, 2, None, None),
    ("pipeline=2 fsdp=2", PIPELINE, 4, 16, None, None),
]
# MaxText's own keys for the same work (its model keys are the ones above): the llama2 block, synthetic
# data, plain dot-product attention, nothing written.
MAXTEXT_ARGS = ["hardware=cpu", "skip_jax_distributed_system=true", "model_name=default", "decoder_block=llama2",
                "attention=dot_product", "dataset_type=synthetic", "enable_checkpointing=false",
                "async_checkpointing=false", "enable_tensorboard=false", "jax_cache_dir=", "ici_fsdp_parallelism=-1"]
# A row's MaxText keys where they differ from maxtrain's (key=value, over the row's and MAXTEXT_ARGS'; a key
# with no value is dropped). The MoE row: MaxText's Mixtral block (its decoder_block for maxtrain's
# model_family), whose router already takes the softmax over the top-2 logits (so no norm_topk_prob).
# MaxText's Mixtral default is dropless sparse_matmul with the megablox kernel, a Pallas kernel that off TPU
# runs in interpret mode; megablox=false keeps the dropless sparse path on jax.lax.ragged_dot, which XLA:CPU
# runs (as a dense matmul per expert). That is MaxText's own dropless MoE on CPU. sparse_matmul=false without a capacity factor is dropless too (every expert on every token, as
# einsums) and on CPU the faster of the two: idle 2-core EPYC, runs minutes apart, 1.77-1.89 s/step against
# ragged_dot's 2.2-2.5 (megablox interpreted: slower still); the ratio against it: 1.56-1.87x (2026-11-23).
# The pipeline row: MaxText's stage holds 1 layer per visit by default (a circular schedule); 2 make it
# GPipe's, as maxtrain's -1.
MAXTEXT_ROW_KEYS = {
    "pipeline=2 fsdp=2": ["num_layers_per_pipeline_stage=2"],
    "moe 8x top-2": ["decoder_block=mixtral", "model_family", "norm_topk_prob", "sparse_matmul=true", "megablox=false",
                     "capacity_factor=-1"],
}
SLICES_70B = ["model_name=llama3.1-70b", "compile_topology_num_slices=2", "ici_fsdp_parallelism=64",
              "per_device_batch_size=2", "max_target_length=4096"]
PIPELINE_70B = SLICES_70B + ["dcn_pipeline_parallelism=2", "num_pipeline_microbatches=4"]
DEEPSEEK = ["max_target_length=1024", "weight_dtype=bfloat16", "mu_dtype=bfloat16"]
LLAMA3_8B_V5P_8 = ["model_name=llama3-8b", "compile_topology=v5p-8", "per_device_batch_size=1", "max_target_length=2048"]
LLAMA3_70B_V5P_64 = ["model_name=llama3.1-70b", "compile_topology=v5p-64", "per_device_batch_size=1",
                     "max_target_length=2048"]
AOT = [
    ("llama2-7b v5p-128", ["model_name=llama2-7b", "max_target_length=4096"], 14.23),
    ("llama3-8b v5p-128", ["model_name=llama3-8b", "max_target_length=8192"], 34.90),
    # MaxText 0.2.4's own compile of its mixtral-8x7b, same settings (issue #23): arguments 8.16 + temporaries 15.54.
    # MaxText's figures come from its own install's libtpu, 0.0.52, the tpu extra's too.
    ("mixtral-8x7b v5p-128", ["model_name=mixtral-8x7b", "max_target_length=4096"], 23.70),
    # The same with the experts over 8 chips (each chip's experts take chunks of positions: the auto rule).
    ("mixtral-8x7b expert=8", ["model_name=mixtral-8x7b", "max_target_length=4096", "ici_expert_parallelism=8",
                               "ici_fsdp_parallelism=8"], 23.70),
    # Quantized training (#24): the same llama2-7b row with int8 and fp8 matmuls (MaxText: its Qwix path).
    ("llama2-7b int8", ["model_name=llama2-7b", "max_target_length=4096", "quantization=int8"], float("nan")),
    ("llama2-7b fp8_full", ["model_name=llama2-7b", "max_target_length=4096", "quantization=fp8_full"],
     float("nan")),
    # Long context (#25): 4 sequences of 131,072 tokens, each over 16 chips; MaxText's figure: its own install.
    ("llama3-8b 131072 context=16", ["model_name=llama3-8b", "max_target_length=131072", "ici_context_parallelism=16",
                                     "ici_fsdp_parallelism=4", "per_device_batch_size=0.0625"], 8.84),
    # Pipeline (#37): llama3.1-70b on 2 slices, the stages across them, 4 micro-batches of 64 sequences.
    # MaxText's figures: its train_compile of the same keys on 0.0.42. Its GPipe plans 97.23 GiB of
    # temporaries alone (over v5p's 95.74: does not fit), so the ratio there is a lower bound.
    ("llama3.1-70b 2 slices GPipe", PIPELINE_70B, 97.23),
    ("llama3.1-70b 2 slices circular x4", PIPELINE_70B + ["num_layers_per_pipeline_stage=10"], 61.65),
    # The reference: no pipeline, fsdp across the slices instead.
    ("llama3.1-70b 2 slices dcn fsdp=2", SLICES_70B + ["dcn_fsdp_parallelism=2"], 47.68),
    # Sliding windows (#39): Gemma 3 27B, 5 sliding layers (window 1024) to 1 global, 8192 tokens; MaxText's
    # figure: its train_compile of the same keys on 0.0.42 (splash with its local mask, fsdp=64).
    ("gemma3-27b v5p-128", ["model_name=gemma3-27b", "max_target_length=8192"], 61.99),
    # gpt-oss-120b, 8192 tokens: maxtrain with its experts over 8 chips (x fsdp 8); MaxText on its best mesh,
    # fsdp 64 (its expert 4 x fsdp 16 plans 109.64 GiB; expert 8 and 16 do not compile: out of HBM).
    ("gpt-oss-120b expert=8", ["model_name=gpt-oss-120b", "max_target_length=8192", "ici_expert_parallelism=8",
                               "ici_fsdp_parallelism=8"], 77.30),
    ("gpt-oss-120b fsdp=64", ["model_name=gpt-oss-120b", "max_target_length=8192"], 77.30),
    # DeepSeek (#40), MaxText's guide's settings (per-device batch 4, 1024 tokens, bfloat16 weights and Adam
    # moments): DeepSeek-V2-Lite on v5p-64 against MaxText's deepseek2-16b, and DeepSeek-V3 671B against its
    # deepseek3-671b on the smallest slice where MaxText's compile fits (v5p-256; v5p-128: out of HBM). Each side on
    # its best mesh; MaxText's figures: its train_compile here (0.0.42.1), dropless sparse matmul with megablox
    # (its default; the guide's dense sparse_matmul=false plans 109.24 GiB for V3 on v5p-256 fsdp 128). V2-Lite:
    # MaxText's fsdp 32 (expert 4: 8.99, 8: 10.30). V3: MaxText's expert 8 x fsdp 16 (4: 80.43, 16: 83.36, fsdp
    # 128: 91.04; 32 and 128 out of HBM).
    ("deepseek-v2-lite v5p-64 expert=32", DEEPSEEK + ["model_name=deepseek-v2-lite", "compile_topology=v5p-64",
                                                      "ici_expert_parallelism=32", "ici_fsdp_parallelism=-1"], 8.10),
    ("deepseek-v3 v5p-256 expert=128", DEEPSEEK + ["model_name=deepseek-v3", "compile_topology=v5p-256",
                                                   "ici_expert_parallelism=128", "ici_fsdp_parallelism=-1"], 80.08),
    # Host offload (#64): the optimizer state (and the float32 weights) in pinned host memory; MaxText's figures:
    # its own compile with the same keys, --maxtext.
    ("llama3-8b v5p-8", LLAMA3_8B_V5P_8, float("nan")),
    ("llama3-8b v5p-8 optimizer offload", LLAMA3_8B_V5P_8 + ["optimizer_memory_host_offload=true"], float("nan")),
    ("llama3-8b v5p-8 both offloads", LLAMA3_8B_V5P_8 + ["optimizer_memory_host_offload=true",
                                                        "parameter_memory_host_offload=true"], float("nan")),
    ("llama3.1-70b v5p-64", LLAMA3_70B_V5P_64, float("nan")),
    ("llama3.1-70b v5p-64 optimizer offload", LLAMA3_70B_V5P_64 + ["optimizer_memory_host_offload=true"], float("nan")),
    ("llama3.1-70b v5p-64 both offloads", LLAMA3_70B_V5P_64 + ["optimizer_memory_host_offload=true",
                                                              "parameter_memory_host_offload=true"], float("nan")),
]
# MaxText places an 8 x 8 mesh on the 4x4x4 torus only when told it may split a torus dimension.
MAXTEXT_AOT_EXTRA = {"gpt-oss-120b expert=8": ["ici_expert_parallelism=1", "ici_fsdp_parallelism=-1"],
                     "mixtral-8x7b expert=8": ["allow_split_physical_axes=true"],
                     "deepseek-v2-lite v5p-64 expert=32": ["model_name=deepseek2-16b", "attention=flash",
                                                           "sparse_matmul=true",
                                                           "megablox=true", "ici_expert_parallelism=1",
                                                           "ici_fsdp_parallelism=-1"],
                     "deepseek-v3 v5p-256 expert=128": ["model_name=deepseek3-671b", "n_routing_groups=8",
                                                        "topk_routing_group=4", "attention=flash", "sparse_matmul=true",
                                                        "megablox=true", "ici_expert_parallelism=8",
                                                        "ici_fsdp_parallelism=-1", "allow_split_physical_axes=true"],
                     "llama2-7b int8": ["use_qwix_quantization=true"],
                     "llama2-7b fp8_full": ["use_qwix_quantization=true"],
                     # MaxText offloads the weights only with the layers on the scan's axis 0 (it asserts so)
                     "llama3-8b v5p-8 both offloads": ["param_scan_axis=0"],
                     "llama3.1-70b v5p-64 both offloads": ["param_scan_axis=0"],
                     # MaxText's stage runs 1 layer per visit by default (circular); 40 is GPipe's
                     "llama3.1-70b 2 slices GPipe": ["num_layers_per_pipeline_stage=40"]}
# Where the issue's MaxText figure is not a plan that fits: printed instead of the figure.
AOT_ISSUE_NOTE = {"llama3.1-70b 2 slices GPipe": "> 97.23 (temporaries alone: does not fit)"}
# The plain command: the platform defaults choose bfloat16, splash attention and the loss and MLP chunks.
AOT_COMMON = ["compile_topology=v5p-128", "per_device_batch_size=4"]
