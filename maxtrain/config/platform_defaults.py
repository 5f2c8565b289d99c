"""Platform defaults: the values `dtype=auto`, `attention=auto`, `loss_chunk_size` / `mlp_chunk_size=-1`
and `grain_worker_count=-1` take once the devices are known, so that the plain command is the fast, lean one
on TPU, GPU and CPU. Each rule is stated in base.yml beside its key (the measurements behind them:
benchmarks/README.md); an explicit value always wins."""

from __future__ import annotations

import os
from typing import Any

from maxtrain.models import quantization, registry
from maxtrain.config.keys import ConfigError
from maxtrain.models.parts import padded_vocab
from maxtrain.ops.attention import SPLASH
from maxtrain.parallel import rules


def choose(resolving: dict[str, Any], platform: str) -> dict[str, Any]:
    """The auto values of a config whose mesh is resolved (maxtrain.config.resolve), and moe_chunk_size, as
    {key: value}."""
    c = dict(resolving)
    if c["dtype"] == "auto":
        c["dtype"] = dtype_for(platform, c["base_emb_dim"])
    if c["attention"] == "auto":
        quantized = "attention" in quantization.targets(c)
        share = c["max_target_length"] // rules.sequence_shards(c["logical_axis_rules"], c["mesh_shape"])
        c["attention"] = attention_for(platform, share, quantized)
    auto_matmul = {"tpu": "tokamax", "gpu": "ragged_dot"}.get(platform, "blocked")  # see maxtrain.ops.grouped_matmul
    if c["moe_grouped_matmul"] == "auto":
        c["moe_grouped_matmul"] = auto_matmul
    elif c["moe_grouped_matmul"] == "megablox" and platform != "tpu" and c["num_experts"] > 1:
        raise ConfigError("moe_grouped_matmul", f"megablox is a TPU kernel (Pallas Mosaic); on {platform} use "
                          f"tokamax, blocked or ragged_dot (auto = {auto_matmul})")
    if c["scan_unroll"] == -1:
        c["scan_unroll"] = scan_unroll_for(platform, c["remat_policy"], c["base_num_decoder_layers"])
    auto_chunks(c)
    chosen = {k: c[k] for k in ("dtype", "attention", "moe_grouped_matmul", "scan_unroll", "loss_chunk_size",
                                "mlp_chunk_size", "moe_chunk_size")}
    if c["grain_worker_count"] == -1 and (c["dataset_type"] in STREAMED or c["data_sources"]):  # (streamed files)
        chosen["grain_worker_count"] = data_workers_for(platform, os.cpu_count() or 1)
    return chosen


STREAMED = ("text", "parquet", "array_record")


def data_workers_for(platform: str, cpus: int) -> int:
    """grain_worker_count=-1: processes reading and tokenizing streamed files beside the step. On CPU the step
    needs the cores (2 workers here: 1.5x the pipeline's own rate, taken from the step's cores); beside an
    accelerator, one per 8 cores up to 8 (the HF and sentencepiece tokenizers use a thread's spare cores
    themselves; the workers spread the reading and parsing)."""
    return 0 if platform == "cpu" else max(1, min(8, cpus // 8))


NARROW = 256  # widths below this are small enough that bfloat16 loses on CPU


def dtype_for(platform: str, width: int) -> str:
    """dtype=auto. bfloat16 halves the memory traffic of every activation, which is the step on TPU and GPU
    and for a model of some width on CPU; for a narrow one on CPU the matmuls are small and XLA:CPU's
    converts to and from bfloat16 around each of them cost more than bfloat16 saves."""
    return "float32" if platform == "cpu" and width < NARROW else "bfloat16"


def scan_unroll_for(platform: str, remat_policy: str, layers: int) -> int:
    """scan_unroll=-1. Under remat_policy=none the scanned loop writes every layer's activations into
    stacked [layers, ...] buffers, which XLA:CPU zero-fills and copies each step; unrolled, each layer's
    stay in their own, which is faster for a shallow model; under remat unrolling was no faster, and it
    costs compile time, as it would for a deep model (benchmarks/README.md has the figures)."""
    return layers if platform == "cpu" and remat_policy == "none" and layers <= 8 else 1


def attention_for(platform: str, length_per_device: int, quantized_projections: bool = False) -> str:
    """attention=auto: each platform's fast kernel (splash needs each device's positions in blocks of 128;
    beside quantized projections, jax_nn's einsums would be quantized too: see maxtrain.models.quantization)."""
    if platform == "tpu":
        return "splash" if length_per_device % 128 == 0 else "blockwise"
    return "jax_nn" if platform == "gpu" and not quantized_projections else "blockwise"


MiB = 2**20
AUTO_CHUNKS = {  # key: (chunk, bytes per device above which it is on)
    "loss_chunk_size": (512, 512 * MiB),   # the float32 logits [rows, length, vocab shard]
    # one layer's [rows, length, mlp shard] in the compute dtype: long contexts (benchmarks/README.md)
    "mlp_chunk_size": (2048, 128 * MiB),
}


def summary(c) -> str:
    """The settings the platform defaults resolved, for a run's first line."""
    dense_mlp = c.num_experts == 1 or c.first_num_dense_layers > 0
    chunks = {"loss": c.loss_chunk_size, "mlp": c.mlp_chunk_size if dense_mlp else 0,
              "moe": c.moe_chunk_size if c.num_experts > 1 else 0}
    text = "".join(f" | {name} chunk {size}" for name, size in chunks.items() if size)
    moe = f" | experts {c.moe_grouped_matmul}" if c.num_experts > 1 else ""
    quantized = f" | {c.quantization} matmuls ({c.quantization_targets})" if c.quantization else ""
    unrolled = f" | {c.scan_unroll} layers per loop iteration" if c.scan_layers and c.scan_unroll > 1 else ""
    pipeline = f" | {c.plan.schedule.describe()}" if c.plan.schedule.active else ""
    return f"{c.dtype} | attention {attention_summary(c)}{window_summary(c)}{text}{moe}{quantized}{unrolled}{pipeline}"


def attention_summary(c) -> str:
    """The kernel, and under context parallelism how a device's queries reach the other devices' keys."""
    shards = rules.sequence_shards(c.logical_axis_rules, c.mesh_shape)
    if shards == 1:
        return c.attention
    if c.context_parallel_strategy == "ring":  # every kernel gives way to the ring (maxtrain.parallel.ring)
        return f"ring over {shards} devices"
    # splash runs on each device against the gathered keys; the other kernels give way to context_parallel's
    return f"{c.attention + ', ' if c.attention in SPLASH else ''}all_gather over {shards} devices"


def window_summary(c) -> str:
    """' (window W on S of N layers, sinks)' and the like: what the attention does besides the causal mask."""
    layers, every, window = c.base_num_decoder_layers, c.global_layer_interval, c.sliding_window_size
    parts = []
    if window:
        sliding = layers - (layers // every if every else 0)
        parts.append(f"window {window} on {sliding} of {layers} layers")
    spec = registry.spec_for(c)
    if spec.summary:  # a family's own layers (Llama 4's chunks and NoPE)
        parts.append(spec.summary(c))
    parts += ["sinks"] * bool(c.attention_sinks) + ["soft cap"] * bool(c.attn_logit_softcapping)
    return f" ({', '.join(parts)})" if parts else ""


def auto_chunks(c: dict[str, Any]) -> None:
    """loss_chunk_size / mlp_chunk_size = -1: chunk where the unchunked tensor would be large per device
    (moe_chunk_size: mlp_chunk_size's value for an MoE layer)."""
    def shards(logical: str, size: int | None = None) -> int:  # with a size: as the resolver splits it
        return rules.shards(c["logical_axis_rules"], logical, c["mesh_shape"], size)
    rows = c["global_batch_size"] / shards("batch") / c["gradient_accumulation_steps"]
    # each device's positions (chunks split those)
    length = c["max_target_length"] // rules.sequence_shards(c["logical_axis_rules"], c["mesh_shape"])
    itemsize = 2 if c["dtype"] == "bfloat16" else 4
    vocab = padded_vocab(c["vocab_size"])
    sizes = {"loss_chunk_size": rows * length * vocab / shards("vocab", vocab) * 4,
             "mlp_chunk_size": rows * length * c["base_mlp_dim"] / shards("mlp", c["base_mlp_dim"]) * itemsize}
    c["moe_chunk_size"] = c["mlp_chunk_size"]  # one key for both layers; their auto rules differ
    for key, (chunk, limit) in AUTO_CHUNKS.items():
        if c[key] == -1:
            divisor = max(d for d in range(1, min(chunk, length) + 1) if length % d == 0)
            c[key] = divisor if sizes[key] > limit and divisor < length else 0
    if c["moe_chunk_size"] == -1:
        c["moe_chunk_size"] = moe_chunk(c, rows, length, itemsize, shards)


def moe_chunk(c, rows, length, itemsize, shards) -> int:
    """An MoE layer's auto chunk. Under expert parallelism a device receives every peer's assignments to
    its experts, [rows x length x top-k on its experts x peers, expert width] per layer: chunks keep that
    under the MLP's limit. Without an expert axis, no chunks: the gathered weights of all experts and their
    gradients dominate, and the chunk loop's gradient carry costs what the chunks save (Mixtral 8x7B's
    plans on v5p-128, with and without chunks: benchmarks/README.md)."""
    peers = shards("experts")
    if peers == 1:
        return 0
    per_peer = min(c["num_experts_per_tok"], c["num_experts"] // peers)
    per_position = rows * per_peer * peers * c["moe_mlp_dim"] / shards("moe_mlp") * itemsize
    limit = AUTO_CHUNKS["mlp_chunk_size"][1]
    chunk = max((d for d in range(1, length + 1) if length % d == 0 and d * per_position <= limit), default=1)
    return chunk if chunk < length else 0
