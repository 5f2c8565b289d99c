"""The execution plan: how the model's layers run, resolved once from the config (and, through it, the
devices and the mesh). The model says what to compute with logical axis names; it asks the plan for
attention, the embedding lookup, the experts' work, chunks of positions, remat and the scan's unroll,
and never sees the mesh or shard_map.

A plan is frozen and hashable (a field of maxtrain.models.args.ModelArgs). `Plan.from_resolved` takes a
config resolved for the devices (maxtrain.config.resolve); `Plan.single_device` takes a config as loaded,
its auto values as the reference choices (dot_product attention, no chunks, the scan's loop, the blocked
grouped matmul), which is all a unit test on one device needs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax

from maxtrain.ops import attention
from maxtrain.ops.attention import PLAIN, Variant
from maxtrain.parallel import remat
from maxtrain.parallel import chunks, context, embedding, experts, pipeline
from maxtrain.parallel.rules import length_shards


# What a config's auto values mean where no devices are known (Plan.single_device): the plainest kernel, the
# reference grouped matmul, the scan's loop. The platform's choices for them: each key's Key.choose
# (maxtrain/config/groups/layout.py).
REFERENCE = {"attention": "dot_product", "moe_grouped_matmul": "blocked", "scan_unroll": 1}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every field from the config (base.yml holds the defaults): none of its own."""
    attention: str  # a kernel of attention.KERNELS, or one of attention.SPLASH
    mlp_chunk: int  # positions per chunk of a dense MLP; 0 = the whole sequence at once
    moe_chunk: int  # the same for an MoE layer's experts
    moe_grouped_matmul: str  # tokamax | megablox | ragged_dot | blocked (maxtrain.ops.grouped_matmul)
    remat_policy: str  # a name in remat.POLICIES
    scan_unroll: int  # layers per iteration of the scanned loop
    context_load_balance: bool  # under context parallelism the batch is in attention.zigzag_order
    context_strategy: str = "all_gather"  # under context parallelism: all_gather | ring (parallel.context)
    schedule: pipeline.Schedule = pipeline.Schedule()  # the pipeline over stages (none: 1 stage)

    @classmethod
    def from_resolved(cls, c) -> "Plan":
        """The plan of a config resolved for the devices: every value already chosen."""
        return cls(attention=c.attention, mlp_chunk=c.mlp_chunk_size, moe_chunk=c.moe_chunk_size,
                   moe_grouped_matmul=c.moe_grouped_matmul, remat_policy=c.remat_policy, scan_unroll=c.scan_unroll,
                   context_load_balance=c.context_parallel_load_balance, context_strategy=c.context_parallel_strategy,
                   schedule=pipeline.Schedule(c.mesh_shape["stage"], c.num_pipeline_repeats,
                                              c.num_pipeline_microbatches))

    @classmethod
    def single_device(cls, c) -> "Plan":
        """The plan of a config as loaded (no devices known): explicit values as given, auto ones the
        reference choices."""
        chunk = max(c.mlp_chunk_size, 0)
        return cls(attention=REFERENCE["attention"] if c.attention == "auto" else c.attention,
                   mlp_chunk=chunk, moe_chunk=chunk,
                   moe_grouped_matmul=(REFERENCE["moe_grouped_matmul"] if c.moe_grouped_matmul == "auto"
                                       else c.moe_grouped_matmul),
                   remat_policy=c.remat_policy, scan_unroll=max(c.scan_unroll, REFERENCE["scan_unroll"]),
                   context_load_balance=c.context_parallel_load_balance, context_strategy=c.context_parallel_strategy)

    # ---- what a layer asks

    def attend(self, q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL,
               variant: Variant = PLAIN, sinks_H=None):
        """Causal, same-document attention [B,L,H,K] by the planned kernel, as `variant` says (a window,
        a scale, a soft cap) and with `sinks_H` if any; under context parallelism (the sequence split over
        devices) every kernel but splash gives way to context_parallel, and under the ring strategy splash
        does too (its all-gather is what the ring replaces). A chunked window reaches every
        kernel as the window plus each chunk a document of its own (positions count from each document's
        start, so chunks do too)."""
        if variant.chunked:
            segment_ids_BxL = attention.chunk_segments(segment_ids_BxL, positions_BxL, variant.window)
        split = length_shards() > 1
        if self.attention in attention.SPLASH and not (split and self.context_strategy == "ring"):
            return context.splash(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, remat.CONTEXT,
                                  self.context_load_balance, variant, sinks_H, attention.SPLASH[self.attention])
        if split:
            return context.context_parallel(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL,
                                            variant, sinks_H, self.context_load_balance, self.context_strategy)
        return attention.KERNELS[self.attention](q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, variant, sinks_H)

    def embed(self, embedding_VxD, tokens_BxL, dtype):
        return embedding.lookup(embedding_VxD, tokens_BxL, dtype)

    def expert_mlp(self, x_BxLxD, experts_BxLxK, weights_BxLxK, weights, cap: int | None, biases=None,
                   activation=experts.silu_glu, scale_input: bool = False):
        """sum_k weights[k] * SwiGLU_{experts[k]}(x) (scale_input: SwiGLU_{experts[k]}(weights[k] * x)), the
        experts' work split over the mesh (maxtrain.parallel.experts)."""
        return experts.expert_mlp(x_BxLxD, experts_BxLxK, weights_BxLxK, weights, cap, self.moe_grouped_matmul,
                                  self.moe_chunk, self.remat_policy, biases, activation, scale_input)

    def mlp(self, fn: Callable, x_BxLxD):
        """fn(x) for a position-wise fn; with mlp_chunk, `mlp_chunk` of each device's positions at a time,
        each chunk rematerialized under the layer's policy, so the [B,L,F] intermediates (and their
        gradients) exist one chunk at a time."""
        share = x_BxLxD.shape[1] // length_shards()  # each device's positions
        chunk = self.mlp_chunk
        if not chunk or share % chunk or share == chunk:
            return fn(x_BxLxD)
        if self.remat_policy != "none":
            fn = jax.checkpoint(fn, policy=remat.POLICIES[self.remat_policy])
        return chunks.merge_chunks(jax.lax.map(fn, chunks.split_chunks(x_BxLxD, chunk)))

    def positions_order(self, length: int):
        """The places of a sequence's positions in the batch's layout (zigzag_order under load-balanced
        context parallelism), or None where the batch is in sequence order."""
        shards = length_shards()
        return attention.zigzag_order(length, shards) if self.context_load_balance and shards > 1 else None

    def pipelines(self, stack: int, stacks: int) -> bool:
        """Whether stack number `stack` of `stacks` runs through the pipeline: the last one does."""
        return self.schedule.active and stack == stacks - 1

    def layers_axis(self, pipelined: bool) -> str:
        """The logical name of a scanned stack's layers dimension."""
        return pipeline.LAYERS_AXIS if pipelined else "layers"

    def pipeline(self, layer_fn: Callable, params, x_BxLxD, positions_BxL, segment_ids_BxL):
        """The stack `params` (leaves [layers, ...], pipeline.storage_order) run by `layer_fn(layer params,
        x, positions, segment ids) -> (x, records)` over the stages: (x, each layer's records)."""
        policy = None if self.remat_policy == "none" else remat.POLICIES[self.remat_policy]
        return pipeline.run(layer_fn, params, x_BxLxD, positions_BxL, segment_ids_BxL, self.schedule, policy)

    def remat(self, layer: type[nn.Module], scanned: bool):
        """The layer class rematerialized under the policy (unchanged under none)."""
        if self.remat_policy == "none":
            return layer
        # unrolled, a layer's index (DecoderLayer's 4th argument after self) stays a Python int
        return nn.remat(layer, policy=remat.POLICIES[self.remat_policy], prevent_cse=not scanned,
                        static_argnums=() if scanned else (4,))

    def unroll(self, layers: int) -> int:
        """Layers per iteration of a scanned stack of `layers`."""
        return min(self.scan_unroll, layers)
