"""The run's first line after the devices: the settings the platform defaults chose (each key's rule is its
`Key.choose`, maxtrain/config/groups/), and what the attention does besides the causal mask."""

from __future__ import annotations

from maxtrain.models import registry
from maxtrain.ops.attention import SPLASH
from maxtrain.parallel import rules


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
