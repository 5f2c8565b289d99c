"""One HF tensor and the maxtrain parameter it holds: its name, its shape and the two layout changes
between them. Each part names its own tensors (GQA.hf_tensors, GatedMLP.hf_tensors, MoE.hf_tensors);
maxtrain.models.hf_tensors assembles a model's table from them and the families' hooks.

Layouts. torch's Linear stores [out, in]; maxtrain stores [in, out] with heads split out:
q_proj [H*K, D] -> wq [D, H, K]; k_proj, v_proj [N*K, D] -> wk, wv [D, N, K]; o_proj [D, H*K] -> wo [H, K, D];
gate_proj, up_proj [F, D] -> wi_gate, wi_up [D, F]; down_proj [D, F] -> wo [F, D]; lm_head [V, D] -> output [D, V].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Tensor:
    path: tuple[str, ...]  # maxtrain parameter path (inside one layer for per-layer tensors)
    hf_name: str           # HF name (after "model.layers.<i>." for per-layer tensors); "{e}" marks the expert
    hf_shape: tuple[int, ...]  # with experts: one expert's
    to_maxtrain: Callable[[np.ndarray], np.ndarray]  # with experts: one expert's
    to_hf: Callable[[np.ndarray], np.ndarray] | None  # None: read only (transformers' fused expert layout)
    experts: int = 0       # > 0: one HF tensor per expert, stacked on maxtrain's leading experts axis
    # export: more maxtrain parameters (paths as `path`) that to_hf takes after this one, for an HF tensor
    # that holds several (gpt-oss's gate_up_proj); the others' Tensors have to_hf None
    joins: tuple[tuple[str, ...], ...] = ()


def same(x):
    return x


def transposed(x):
    """torch's Linear [out, in] <-> maxtrain's [in, out] (either way)."""
    return x.T


def layer_name(i: int, t: Tensor) -> str:
    return f"model.layers.{i}.{t.hf_name}"


def hf_names(t: Tensor, layer: int | None = None) -> list[str]:
    """The HF tensors behind `t` (of layer `layer` for a per-layer one): one, or one per expert in order."""
    name = t.hf_name if layer is None else layer_name(layer, t)
    return [name.format(e=e) for e in range(t.experts)] if t.experts else [name]
