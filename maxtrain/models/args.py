"""The decoder's arguments: the model keys a layer reads, in the units it uses, and the execution plan it
runs under (how, not what: kernels, chunks, remat)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from maxtrain.models import quantization, stacks as stacks_lib
from maxtrain.models.parts import GQA, MLA, GatedMLP, MoE, Norm, Vocabulary
from maxtrain.models.rope import Rope
from maxtrain.parallel.plan import Plan

@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The decoder: its width, depth and vocabulary, and the parts each layer is made of (each part's spec
    holds what the family chose for it, and counts its parameters and FLOPs)."""
    vocab: Vocabulary
    embed: int
    layers: int
    norm: Norm
    attention: GQA | MLA
    mlp: GatedMLP  # the dense layers' MLP
    moe: MoE | None  # the MoE layers' (maxtrain.models.stacks says which); None: a dense model
    rope: Rope  # every layer's, or the global layers' where some slide (the attention's window holds theirs)
    mtp_layers: int  # multi-token prediction depths (maxtrain.models.mtp); 0 = none
    dtype: Any
    weight_dtype: Any
    scan_layers: bool
    logits_dot_in_fp32: bool
    quantized_mlp: bool  # the MLPs' matmuls as jnp.einsum, which Qwix intercepts (maxtrain.models.quantization)
    capacity_factor: float  # an MoE layer's expert takes at most this x its fair share of a sequence; <= 0: all
    plan: Plan  # how the layers run: kernels, chunks, remat, the scan's unroll (maxtrain.parallel.plan)

    @classmethod
    def from_config(cls, c) -> "ModelArgs":
        return cls(
            vocab=Vocabulary.from_config(c), embed=c.base_emb_dim, layers=c.base_num_decoder_layers,
            norm=Norm.from_config(c), attention=attention_of(c), mlp=GatedMLP.from_config(c), moe=MoE.from_config(c),
            rope=Rope.from_config(c), mtp_layers=c.mtp_num_layers,
            dtype=jnp.dtype(compute_dtype(c)), weight_dtype=jnp.dtype(c.weight_dtype), scan_layers=c.scan_layers,
            logits_dot_in_fp32=c.logits_dot_in_fp32, quantized_mlp="mlp" in quantization.targets(c),
            capacity_factor=c.capacity_factor,
            plan=Plan.from_resolved(c) if "mesh_shape" in c else Plan.single_device(c))

    @property
    def mla(self) -> bool:
        return isinstance(self.attention, MLA)

    def stacks(self) -> list[stacks_lib.Stack]:
        """The layer stacks (maxtrain.models.stacks names them)."""
        if self.moe is None:
            return stacks_lib.stacks(self.layers, 1, 0)
        return stacks_lib.stacks(self.layers, self.moe.num_experts, self.moe.first_dense_layers, self.moe.interleave)


def attention_of(c) -> GQA | MLA:
    """The attention part the config names (attention_type)."""
    return MLA.from_config(c) if c["attention_type"] == "mla" else GQA.from_config(c)


def compute_dtype(c) -> str:
    """The config's compute dtype; dtype=auto before the devices are known (a loaded config, as unit tests
    build models from): bfloat16, the accelerators' choice (resolve picks the platform's)."""
    return "bfloat16" if c.dtype == "auto" else c.dtype
