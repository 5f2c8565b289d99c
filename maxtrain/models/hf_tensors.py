"""HuggingFace <-> maxtrain tensors: which HF tensor holds each maxtrain parameter, and how each is laid out,
for the decoder every family shares; a family's own tensors come from its HFMapping hooks (attention, an
MoE layer's MLP, multi-token prediction's depths). maxtrain.convert reads and writes them;
maxtrain.models.hf maps config.json.

Layouts. torch's Linear stores [out, in]; maxtrain stores [in, out] with heads split out:
q_proj [H*K, D] -> wq [D, H, K]; k_proj, v_proj [N*K, D] -> wk, wv [D, N, K]; o_proj [D, H*K] -> wo [H, K, D];
gate_proj, up_proj [F, D] -> wi_gate, wi_up [D, F]; down_proj [D, F] -> wo [F, D]; lm_head [V, D] -> output [D, V].
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
from typing import Any, Callable

import numpy as np

from maxtrain.models.args import padded_vocab
from maxtrain.models.moe import moe_width
from maxtrain.models import registry, stacks as stacks_lib
from maxtrain.models.registry import Keys

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


def layer_name(i: int, t: Tensor) -> str:
    return f"model.layers.{i}.{t.hf_name}"


def hf_names(t: Tensor, layer: int | None = None) -> list[str]:
    """The HF tensors behind `t` (of layer `layer` for a per-layer one): one, or one per expert in order."""
    name = t.hf_name if layer is None else layer_name(layer, t)
    return [name.format(e=e) for e in range(t.experts)] if t.experts else [name]


FUSED_EXPERTS_NAME = ".mlp.experts.gate_up_proj"  # the end of a name only the fused layout has (gpt-oss aside)


@dataclass(frozen=True)
class LayerTensors:
    """The HF tensors of some layers that share one table: a stack's layers, or one multi-token prediction
    depth (`single`: a module named `name` whose `layer` submodule is HF layer indices[0])."""
    name: str             # the scanned stack's name (unrolled: layers_<i>), or the depth's module name
    indices: list[int]    # HF layer indices (model.layers.<i>.)
    tensors: list[Tensor]
    single: bool = False

    def params_path(self, t: Tensor, scanned: bool, i: int | None = None) -> tuple[str, ...]:
        """Where `t` of layer `i` lives in maxtrain's tree (scanned: the stack's, with a leading layers axis)."""
        if self.single or scanned:
            return (self.name, *t.path)
        return (stacks_lib.unrolled(i), *t.path)


def tensor_table(m: Keys, fused_experts: bool = False, joined: bool = False,
                 hf: dict[str, Any] | None = None) -> tuple[list[Tensor], list[LayerTensors]]:
    """(whole-model tensors, each stack's and each multi-token prediction depth's layer tensors) for
    maxtrain model keys `m`; an MoE model's experts in the per-expert file layout, or with `fused_experts`
    in transformers' fused layout (import only). `joined` (export): without the parameters that another's
    tensor carries (Tensor.joins). `hf`: the config.json imported from (None: export's layout)."""
    d, v = m["base_emb_dim"], m["vocab_size"]
    same = lambda x: x  # noqa: E731
    spec = registry.spec_for(m)
    common = (spec.hf.attention_tensors or gqa_tensors)(m, hf)
    common.append(Tensor(("attention_norm", "scale"), "input_layernorm.weight", (d,), same, same))
    if m["use_post_attn_norm"]:  # Gemma's sandwich: post_attention_layernorm normalizes the attention's output
        common += [Tensor(("post_attention_norm", "scale"), "post_attention_layernorm.weight", (d,), same, same),
                   Tensor(("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", (d,), same, same)]
    else:
        common.append(Tensor(("mlp_norm", "scale"), "post_attention_layernorm.weight", (d,), same, same))
    if m["use_post_ffw_norm"]:
        common.append(Tensor(("post_mlp_norm", "scale"), "post_feedforward_layernorm.weight", (d,), same, same))

    def layer(moe: bool) -> list[Tensor]:  # a dense layer's MLP is the plain gated one, whatever the family
        mlp = spec.hf.mlp_tensors(m, fused_experts) if moe else swiglu_tensors(m, fused_experts)
        return [t for t in common + mlp if t.to_hf] if joined else common + mlp

    stacks = spec.stacks(m)
    groups = [LayerTensors(s.name, list(s.layers), layer(s.moe)) for s in stacks]
    for k in range(1, m["mtp_num_layers"] + 1):  # only a family whose HF layout has the depths gets here
        inner = [dataclasses.replace(t, path=("layer", *t.path)) for t in layer(stacks[-1].moe)]
        groups.append(LayerTensors(stacks_lib.mtp(k), [m["base_num_decoder_layers"] + k - 1],
                                   inner + spec.hf.mtp_tensors(m), single=True))
    rows, cut = _vocab_padding(v)
    whole = [Tensor(("embedding",), "model.embed_tokens.weight", (v, d), rows, cut),
             Tensor(("final_norm", "scale"), "model.norm.weight", (d,), same, same)]
    if not m["logits_via_embedding"]:
        whole.append(Tensor(("output",), "lm_head.weight", (v, d), lambda x: rows(x).T, lambda w: cut(w.T)))
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


def gqa_tensors(m: Keys, hf: dict[str, Any] | None = None) -> list[Tensor]:
    """Grouped-query attention's projections, and its q/k norms, biases and sinks where the model has them."""
    d, h, n, k = m["base_emb_dim"], m["base_num_query_heads"], m["base_num_kv_heads"], m["head_dim"]
    same = lambda x: x  # noqa: E731

    def heads_out(count):  # [count*K, D] <-> [D, count, K]
        return (lambda x: x.T.reshape(d, count, k)), (lambda w: w.reshape(d, count * k).T)

    def bias(count):  # [count*K] <-> [count, K]
        return (lambda x: x.reshape(count, k)), (lambda w: w.reshape(count * k))

    tensors = [
        Tensor(("attention", "wq"), "self_attn.q_proj.weight", (h * k, d), *heads_out(h)),
        Tensor(("attention", "wk"), "self_attn.k_proj.weight", (n * k, d), *heads_out(n)),
        Tensor(("attention", "wv"), "self_attn.v_proj.weight", (n * k, d), *heads_out(n)),
        Tensor(("attention", "wo"), "self_attn.o_proj.weight", (d, h * k),
               lambda x: x.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T),
    ]
    if m["use_qk_norm"]:  # Qwen3: RMSNorm over each head's q and k
        tensors += [Tensor(("attention", "q_norm", "scale"), "self_attn.q_norm.weight", (k,), same, same),
                    Tensor(("attention", "k_norm", "scale"), "self_attn.k_norm.weight", (k,), same, same)]
    if m["qkv_bias"]:
        tensors += [Tensor(("attention", "bq"), "self_attn.q_proj.bias", (h * k,), *bias(h)),
                    Tensor(("attention", "bk"), "self_attn.k_proj.bias", (n * k,), *bias(n)),
                    Tensor(("attention", "bv"), "self_attn.v_proj.bias", (n * k,), *bias(n))]
    if m["attention_out_bias"]:  # gpt-oss
        tensors.append(Tensor(("attention", "bo"), "self_attn.o_proj.bias", (d,), same, same))
    if m["attention_sinks"]:  # gpt-oss
        tensors.append(Tensor(("attention", "sinks"), "self_attn.sinks", (h,), same, same))
    return tensors


def _vocab_padding(v: int):
    """[V, D] -> maxtrain's [padded V, D] (zero rows: config.padded_vocab) and back to HF's true V."""
    pad = padded_vocab(v) - v
    if not pad:
        return (lambda x: x), (lambda w: w)
    return (lambda x: np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])), (lambda w: w[:v])


def swiglu_tensors(m: Keys, fused: bool) -> list[Tensor]:
    """A dense layer's MLP: mlp.gate_proj, up_proj, down_proj."""
    d, f = m["base_emb_dim"], m["base_mlp_dim"]
    T = lambda x: x.T  # noqa: E731
    return [Tensor(("mlp", "wi_gate"), "mlp.gate_proj.weight", (f, d), T, T),
            Tensor(("mlp", "wi_up"), "mlp.up_proj.weight", (f, d), T, T),
            Tensor(("mlp", "wo"), "mlp.down_proj.weight", (d, f), T, T)]


def expert_tensors(m: Keys, fused: bool, router: str, gate: str, up: str, down: str) -> list[Tensor]:
    """An MoE layer's router and experts: in the file layout under the family's names ("{e}" marks the
    expert), or with `fused` in transformers 5's in-memory layout, which it also loads from files."""
    d, e, f = m["base_emb_dim"], m["num_experts"], moe_width(m)
    T = lambda x: x.T  # noqa: E731
    swap = lambda x: x.transpose(0, 2, 1)  # noqa: E731  [E, out, in] <-> [E, in, out]
    if fused:
        return [Tensor(("mlp", "router"), "mlp.gate.weight", (e, d), T, T),
                Tensor(("mlp", "wi_gate"), "mlp.experts.gate_up_proj", (e, 2 * f, d), lambda x: swap(x[:, :f]), None),
                Tensor(("mlp", "wi_up"), "mlp.experts.gate_up_proj", (e, 2 * f, d), lambda x: swap(x[:, f:]), None),
                Tensor(("mlp", "wo"), "mlp.experts.down_proj", (e, d, f), swap, None)]
    return [Tensor(("mlp", "router"), router, (e, d), T, T),
            Tensor(("mlp", "wi_gate"), gate, (f, d), T, T, experts=e),
            Tensor(("mlp", "wi_up"), up, (f, d), T, T, experts=e),
            Tensor(("mlp", "wo"), down, (d, f), T, T, experts=e)]
