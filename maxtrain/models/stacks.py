"""The layer stacks of a decoder and their names: the one place that spells them.

A dense model's layers are one stack, `layers`; a mixture of experts has its leading dense layers
(`dense_layers`, if any) and then its `moe_layers`, or, where MoE layers interleave with dense ones (every Nth
an MoE: Llama 4 Maverick's 2), one stack `layers` of periods of N layers, each position of the period a
subtree of its own (`period_<j>`). Scanned, each stack (or position) is one parameter subtree with a
leading layers axis; unrolled, layer i (counted over the whole model) is `layers_<i>`. The model, the
MoE statistics, quantization's module paths and conversion all take the names from here, and those of
multi-token prediction's depths (`mtp_<k>`, k from 1), which hold one layer each after the stacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DENSE, DENSE_FIRST, MOE = "layers", "dense_layers", "moe_layers"
_UNROLLED = "layers_"
_MTP = "mtp_"  # multi-token prediction's depths (maxtrain.models.mtp): one layer each, after every stack
_PERIOD = "period_"  # a position in an interleaved stack's period


@dataclass(frozen=True)
class Stack:
    name: str   # the scanned stack's name
    first: int  # its first layer's index in the whole model
    count: int  # its layers
    moe: bool   # its MLPs are mixtures of experts (with a period: its period's last layer's)
    period: int = 1  # > 1: the scan steps over `period` layers at a time, the last of them MoE, the others dense

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.count)

    def is_moe(self, layer: int) -> bool:
        """Whether the model's layer `layer` (one of this stack's) is an MoE layer."""
        return self.moe and (layer - self.first) % self.period == self.period - 1

    @property
    def moe_layers(self) -> int:
        return (self.count // self.period) if self.moe else 0

    def positions(self) -> list[tuple[str, bool, list[int]]]:
        """(subtree name, MoE, the model's layers) of each position in the period: one, named "", without one."""
        if self.period == 1:
            return [("", self.moe, list(self.layers))]
        return [(period_position(j), self.moe and j == self.period - 1, list(self.layers)[j::self.period])
                for j in range(self.period)]


def stacks(layers: int, num_experts: int, first_dense_layers: int, interleave: int = 1) -> list[Stack]:
    """`interleave` N > 1: every Nth layer (the Nth, 2Nth, ...) an MoE, the others dense."""
    if num_experts == 1:
        return [Stack(DENSE, 0, layers, False)]
    if interleave > 1:
        return [Stack(DENSE, 0, layers, True, interleave)]
    dense = [Stack(DENSE_FIRST, 0, first_dense_layers, False)] if first_dense_layers else []
    return dense + [Stack(MOE, first_dense_layers, layers - first_dense_layers, True)]


def for_keys(m: Mapping[str, Any]) -> list[Stack]:
    """The stacks of the model that maxtrain model keys `m` describe."""
    return stacks(m["base_num_decoder_layers"], m["num_experts"], m["first_num_dense_layers"],
                  m["interleave_moe_layer_step"])


def unrolled(i: int) -> str:
    """Layer i's name when layers are not scanned."""
    return f"{_UNROLLED}{i}"


def unrolled_index(name: str) -> int | None:
    """i for `layers_<i>`; None for a scanned stack's name (or anything else)."""
    tail = name.removeprefix(_UNROLLED)
    return int(tail) if tail != name and tail.isdigit() else None



def period_position(j: int) -> str:
    """The subtree of position j in an interleaved stack's period."""
    return f"{_PERIOD}{j}"


def mtp(k: int) -> str:
    """Multi-token prediction depth k's name (k from 1)."""
    return f"{_MTP}{k}"


def mtp_depth(name: str) -> int | None:
    """k for `mtp_<k>`; None for anything else."""
    tail = name.removeprefix(_MTP)
    return int(tail) if tail != name and tail.isdigit() else None
