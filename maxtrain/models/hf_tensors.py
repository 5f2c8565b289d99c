"""HuggingFace <-> maxtrain tensors: which HF tensor holds each maxtrain parameter (maxtrain.models.hf_layout's
Tensor, with the layouts), for the decoder every family shares: the attention and dense MLP parts name their
own; a family's own tensors come from its HFMapping hooks (attention, an MoE layer's MLP, multi-token
prediction's depths). maxtrain.convert reads and writes them; maxtrain.models.hf maps config.json.

RoPE: HF's Llama code rotates the two halves of each head (`rotate_half`), and HF checkpoints made from
Meta's interleaved-pair originals had their q/k rows permuted to suit it. maxtrain's `rope` uses the same
half-split convention, so q/k copy across unpermuted (a checkpoint in Meta's own layout would need that
permutation first: convert it to HF with transformers' script; DeepSeek's, whose interleaved rows
transformers handles itself, are permuted by its family: maxtrain.models.deepseek).

Experts. Files (what save_pretrained writes, transformers 5 included, and the Hub's checkpoints) hold one
tensor per expert (names: the family's). maxtrain stacks them: router [D, E], wi_gate, wi_up [E, D, F],
wo [E, F, D]. transformers 5 fuses them in memory (mlp.experts.gate_up_proj [E, 2F, D], gate rows first;
mlp.experts.down_proj [E, D, F]; router mlp.gate) and loads files in that layout as well: import reads
both, export writes the per-expert one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from maxtrain.models.args import attention_of
from maxtrain.models.hf_layout import Tensor, layer_name, same
from maxtrain.models.parts import GatedMLP, Vocabulary
from maxtrain.models import registry, stacks as stacks_lib
from maxtrain.models.registry import Keys


FUSED_EXPERTS_NAME = ".mlp.experts.gate_up_proj"  # the end of a name only the fused layout has (gpt-oss aside)


@dataclass(frozen=True)
class LayerTensors:
    """The HF tensors of some layers that share one table: a stack's layers, or one multi-token prediction
    depth (`single`: a module named `name` whose `layer` submodule is HF layer indices[0])."""
    name: str             # the scanned stack's name (unrolled: layers_<i>), or the depth's module name
    indices: list[int]    # HF layer indices (model.layers.<i>.)
    tensors: list[Tensor]
    single: bool = False
    position: str = ""    # an interleaved stack's: the subtree of these layers' position in its period

    @property
    def scanned(self) -> tuple[str, ...]:
        """The path of these layers' stacked parameters when scanned (or the depth's module)."""
        return (self.name, self.position) if self.position else (self.name,)

    def params_path(self, t: Tensor, scanned: bool, i: int | None = None) -> tuple[str, ...]:
        """Where `t` of layer `i` lives in maxtrain's tree (scanned: the stack's, with a leading layers axis)."""
        if self.single or scanned:
            return (*self.scanned, *t.path)
        return (stacks_lib.unrolled(i), *t.path)


def tensor_table(m: Keys, fused_experts: bool = False, joined: bool = False,
                 hf: dict[str, Any] | None = None) -> tuple[list[Tensor], list[LayerTensors]]:
    """(whole-model tensors, each stack's and each multi-token prediction depth's layer tensors) for
    maxtrain model keys `m`; an MoE model's experts in the per-expert file layout, or with `fused_experts`
    in transformers' fused layout (import only). `joined` (export): without the parameters that another's
    tensor carries (Tensor.joins). `hf`: the config.json imported from (None: export's layout)."""
    d, spec = m["base_emb_dim"], registry.spec_for(m)
    common = spec.hf.attention_tensors(m, hf) if spec.hf.attention_tensors else attention_of(m).hf_tensors(d)
    common.append(Tensor(("attention_norm", "scale"), "input_layernorm.weight", (d,), same, same))
    if m["use_post_attn_norm"]:  # Gemma's sandwich: post_attention_layernorm normalizes the attention's output
        common += [Tensor(("post_attention_norm", "scale"), "post_attention_layernorm.weight", (d,), same, same),
                   Tensor(("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", (d,), same, same)]
    else:
        common.append(Tensor(("mlp_norm", "scale"), "post_attention_layernorm.weight", (d,), same, same))
    if m["use_post_ffw_norm"]:
        common.append(Tensor(("post_mlp_norm", "scale"), "post_feedforward_layernorm.weight", (d,), same, same))

    def layer(moe: bool) -> list[Tensor]:  # a dense layer's MLP: the plain gated one, under the family's name
        mlp = (spec.hf.mlp_tensors(m, fused_experts) if moe
               else GatedMLP.from_config(m).hf_tensors(d, name=spec.hf.dense_mlp_name))
        return [t for t in common + mlp if t.to_hf] if joined else common + mlp

    stacks = spec.stacks(m)
    groups = [LayerTensors(s.name, layers, layer(moe), position=sub)
              for s in stacks for sub, moe, layers in s.positions()]
    for k in range(1, m["mtp_num_layers"] + 1):  # only a family whose HF layout has the depths gets here
        inner = [dataclasses.replace(t, path=("layer", *t.path)) for t in layer(stacks[-1].moe)]
        groups.append(LayerTensors(stacks_lib.mtp(k), [m["base_num_decoder_layers"] + k - 1],
                                   inner + spec.hf.mtp_tensors(m), single=True))
    whole = Vocabulary.from_config(m).hf_tensors(d)
    whole.insert(1, Tensor(("final_norm", "scale"), "model.norm.weight", (d,), same, same))
    return whole, groups


def mtp_depths(hf: dict[str, Any], m: Keys, names) -> int:
    """How many multi-token prediction depths an HF checkpoint holds (tensor `names`, model keys `m`): those
    its config.json counts whose own tensors are all there (transformers' save_pretrained writes none)."""
    spec = registry.by_hf_type(hf.get("model_type"))
    if spec is None or spec.hf.mtp_tensors is None:
        return 0
    said, own, depths = hf.get(spec.hf.mtp_key) or 0, spec.hf.mtp_tensors(m), 0
    while depths < said and all(layer_name(m["base_num_decoder_layers"] + depths, t) in names for t in own):
        depths += 1
    return depths


def mtp_copies(m: Keys) -> dict[str, str]:
    """{HF name in a depth: the whole-model tensor it copies} for each of `m`'s depths."""
    spec, layers = registry.spec_for(m), m["base_num_decoder_layers"]
    if not spec.hf or not m["mtp_num_layers"]:
        return {}
    return {f"model.layers.{layers + k}.{name}": whole for k in range(m["mtp_num_layers"])
            for name, whole in spec.hf.mtp_copies.items()}
