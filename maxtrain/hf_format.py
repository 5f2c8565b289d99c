"""The HuggingFace side of conversion: how a Llama-family checkpoint is laid out (tensor names, shapes and
their maxtrain counterparts), what its config.json means in maxtrain's model keys and back, a safetensors
reader, and the tokenizer settings that go with it. maxtrain.convert does the conversions. Dense: Llama,
Mistral, Qwen2; mixture of experts: Mixtral and Qwen3-MoE.

Layouts. torch's Linear stores [out, in]; maxtrain stores [in, out] with heads split out:
q_proj [H*K, D] -> wq [D, H, K]; k_proj, v_proj [N*K, D] -> wk, wv [D, N, K]; o_proj [D, H*K] -> wo [H, K, D];
gate_proj, up_proj [F, D] -> wi_gate, wi_up [D, F]; down_proj [D, F] -> wo [F, D]; lm_head [V, D] -> output [D, V].
RoPE: HF's Llama code rotates the two halves of each head (`rotate_half`), and HF checkpoints made from
Meta's interleaved-pair originals had their q/k rows permuted to suit it. maxtrain's `rope` uses the same
half-split convention, so q/k copy across unpermuted (a checkpoint in Meta's own layout would need that
permutation first: convert it to HF with transformers' script). RoPE types: default, and llama3 (Llama
3.1's frequency scaling, maxtrain's rope_scaling_* keys).

Experts. Files (what save_pretrained writes, transformers 5 included, and the Hub's checkpoints) hold one
tensor per expert: Mixtral block_sparse_moe.experts.<e>.w1 / w3 [F, D] (gate, up) and w2 [D, F] (down),
router block_sparse_moe.gate [E, D]; Qwen3-MoE mlp.experts.<e>.gate_proj / up_proj / down_proj, router
mlp.gate. maxtrain stacks them: router [D, E], wi_gate, wi_up [E, D, F], wo [E, F, D]. transformers 5 fuses
them in memory (mlp.experts.gate_up_proj [E, 2F, D], gate rows first; mlp.experts.down_proj [E, D, F];
router mlp.gate, Mixtral's too) and loads files in that layout as well: import reads both, export writes
the per-expert one. Routing is softmax, top-k, renormalised (Mixtral always, Qwen3-MoE per norm_topk_prob).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

from maxtrain import tokenizer as tokenizer_lib
from maxtrain.errors import UserError

DENSE = ("llama", "mistral", "qwen2")
MOE = ("mixtral", "qwen3_moe")
SUPPORTED = DENSE + MOE
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


class ConvertError(UserError, RuntimeError):
    """Input that cannot be converted; the CLI prints it as one line and exits 2."""
    kind = "convert"


@dataclass(frozen=True)
class Tensor:
    path: tuple[str, ...]  # maxtrain parameter path (inside one layer for per-layer tensors)
    hf_name: str           # HF name (after "model.layers.<i>." for per-layer tensors); "{e}" marks the expert
    hf_shape: tuple[int, ...]  # with experts: one expert's
    to_maxtrain: Callable[[np.ndarray], np.ndarray]  # with experts: one expert's
    to_hf: Callable[[np.ndarray], np.ndarray] | None  # None: read only (transformers' fused expert layout)
    experts: int = 0       # > 0: one HF tensor per expert, stacked on maxtrain's leading experts axis


def tensor_table(m: dict[str, Any], fused_experts: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    """(whole-model tensors, per-layer tensors) for maxtrain model keys `m`. An MoE model's experts in the
    per-expert file layout (Mixtral's names, or Qwen3-MoE's with q/k norms), or with `fused_experts` in
    transformers' fused layout (import only)."""
    d, h, n, k, f, v = (m["base_emb_dim"], m["base_num_query_heads"], m["base_num_kv_heads"], m["head_dim"],
                        m["base_mlp_dim"], m["vocab_size"])
    same = lambda x: x  # noqa: E731
    T = lambda x: x.T  # noqa: E731

    def heads_out(count):  # [count*K, D] <-> [D, count, K]
        return (lambda x: x.T.reshape(d, count, k)), (lambda w: w.reshape(d, count * k).T)

    def bias(count):  # [count*K] <-> [count, K]
        return (lambda x: x.reshape(count, k)), (lambda w: w.reshape(count * k))

    layer = [
        Tensor(("attention", "wq"), "self_attn.q_proj.weight", (h * k, d), *heads_out(h)),
        Tensor(("attention", "wk"), "self_attn.k_proj.weight", (n * k, d), *heads_out(n)),
        Tensor(("attention", "wv"), "self_attn.v_proj.weight", (n * k, d), *heads_out(n)),
        Tensor(("attention", "wo"), "self_attn.o_proj.weight", (d, h * k),
               lambda x: x.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T),
        Tensor(("attention_norm", "scale"), "input_layernorm.weight", (d,), same, same),
        Tensor(("mlp_norm", "scale"), "post_attention_layernorm.weight", (d,), same, same),
    ]
    if m["num_experts"] == 1:
        layer += [Tensor(("mlp", "wi_gate"), "mlp.gate_proj.weight", (f, d), T, T),
                  Tensor(("mlp", "wi_up"), "mlp.up_proj.weight", (f, d), T, T),
                  Tensor(("mlp", "wo"), "mlp.down_proj.weight", (d, f), T, T)]
    else:
        layer += _expert_tensors(m, fused_experts)
    if m["use_qk_norm"]:  # Qwen3: RMSNorm over each head's q and k
        layer += [Tensor(("attention", "q_norm", "scale"), "self_attn.q_norm.weight", (k,), same, same),
                  Tensor(("attention", "k_norm", "scale"), "self_attn.k_norm.weight", (k,), same, same)]
    if m["qkv_bias"]:
        layer += [Tensor(("attention", "bq"), "self_attn.q_proj.bias", (h * k,), *bias(h)),
                  Tensor(("attention", "bk"), "self_attn.k_proj.bias", (n * k,), *bias(n)),
                  Tensor(("attention", "bv"), "self_attn.v_proj.bias", (n * k,), *bias(n))]
    rows, cut = _vocab_padding(v)
    whole = [Tensor(("embedding",), "model.embed_tokens.weight", (v, d), rows, cut),
             Tensor(("final_norm", "scale"), "model.norm.weight", (d,), same, same)]
    if not m["logits_via_embedding"]:
        whole.append(Tensor(("output",), "lm_head.weight", (v, d), lambda x: rows(x).T, lambda w: cut(w.T)))
    return whole, layer


def _vocab_padding(v: int):
    """[V, D] -> maxtrain's [padded V, D] (zero rows: config.padded_vocab) and back to HF's true V."""
    from maxtrain.config import padded_vocab
    pad = padded_vocab(v) - v
    if not pad:
        return (lambda x: x), (lambda w: w)
    return (lambda x: np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])), (lambda w: w[:v])


def _expert_tensors(m: dict[str, Any], fused: bool) -> list[Tensor]:
    d, e, f = m["base_emb_dim"], m["num_experts"], moe_width(m)
    T = lambda x: x.T  # noqa: E731
    swap = lambda x: x.transpose(0, 2, 1)  # noqa: E731  [E, out, in] <-> [E, in, out]
    if fused:  # transformers 5's in-memory layout, which it also loads from files
        return [Tensor(("mlp", "router"), "mlp.gate.weight", (e, d), T, T),
                Tensor(("mlp", "wi_gate"), "mlp.experts.gate_up_proj", (e, 2 * f, d), lambda x: swap(x[:, :f]), None),
                Tensor(("mlp", "wi_up"), "mlp.experts.gate_up_proj", (e, 2 * f, d), lambda x: swap(x[:, f:]), None),
                Tensor(("mlp", "wo"), "mlp.experts.down_proj", (e, d, f), swap, None)]
    if m["use_qk_norm"]:  # Qwen3-MoE
        router, gate, up, down = ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                                  "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")
    else:  # Mixtral
        router, gate, up, down = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                                  "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")
    return [Tensor(("mlp", "router"), router, (e, d), T, T),
            Tensor(("mlp", "wi_gate"), gate, (f, d), T, T, experts=e),
            Tensor(("mlp", "wi_up"), up, (f, d), T, T, experts=e),
            Tensor(("mlp", "wo"), down, (d, f), T, T, experts=e)]


FUSED_EXPERTS_NAME = "model.layers.0.mlp.experts.gate_up_proj"  # present only in the fused layout


def moe_width(m: dict[str, Any]) -> int:
    """Each expert's SwiGLU width (base_moe_mlp_dim; -1 = base_mlp_dim)."""
    return m["base_mlp_dim"] if m["base_moe_mlp_dim"] == -1 else m["base_moe_mlp_dim"]


def layer_name(i: int, t: Tensor) -> str:
    return f"model.layers.{i}.{t.hf_name}"


def hf_names(t: Tensor, layer: int | None = None) -> list[str]:
    """The HF tensors behind `t` (of layer `layer` for a per-layer one): one, or one per expert in order."""
    name = t.hf_name if layer is None else layer_name(layer, t)
    return [name.format(e=e) for e in range(t.experts)] if t.experts else [name]


# ---------------------------------------------------------------------------------------------
# HF config.json <-> maxtrain model keys

_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads")
_COMMON = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
# What transformers (5.x) assumes for each key a config.json leaves out, per family: the defaults of
# its <Family>Config (rope_theta: the class's default_theta). None as transformers has it: "derived"
# (num_key_value_heads = num_attention_heads, head_dim = hidden_size // num_attention_heads) or "none".
# tests/test_convert_defaults.py holds this table to transformers' own.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _COMMON | dict(zip(_SHAPE, (32000, 4096, 11008, 32, 32, None))) | {
        "head_dim": None, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": _COMMON | dict(zip(_SHAPE, (32000, 4096, 14336, 32, 32, 8))) | {
        "head_dim": None, "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": _COMMON | dict(zip(_SHAPE, (151936, 4096, 22016, 32, 32, 32))) | {
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
        "bos_token_id": None, "eos_token_id": None},
    "mixtral": _COMMON | dict(zip(_SHAPE, (32000, 4096, 14336, 32, 32, 8))) | {
        "rope_theta": 1e6, "rms_norm_eps": 1e-5, "head_dim": None, "sliding_window": None,
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
        "bos_token_id": 1, "eos_token_id": 2},
    "qwen3_moe": _COMMON | dict(zip(_SHAPE, (151936, 2048, 6144, 24, 32, 4))) | {
        "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096, "decoder_sparse_step": 1,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001, "mlp_only_layers": None, "bos_token_id": None, "eos_token_id": None},
}


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """An HF config.json with transformers' defaults for the keys it leaves out (a supported family's)."""
    return {**HF_DEFAULTS.get(hf.get("model_type"), {}), **hf}


def _number(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConvertError(f"config.json: {key}={value!r} is not a number")
    return float(value)


def _positive_int(hf: dict[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConvertError(f"config.json: {key} missing or not a positive integer")
    return value


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The window of any layer that slides: Mistral's and Mixtral's sliding_window; Qwen3-MoE's where
    use_sliding_window is set; Qwen2's only where use_sliding_window is set and a layer (from
    max_window_layers on, or per layer_types) actually uses it."""
    if hf.get("model_type") == "qwen3_moe":  # transformers 5 applies it to every layer, older ones to some
        return hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if hf.get("model_type") == "qwen2":
        if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
            return None
        types = hf.get("layer_types") or ["sliding_attention" if i >= hf["max_window_layers"]
                                          else "full_attention" for i in range(hf["num_hidden_layers"])]
        if "sliding_attention" not in types:
            return None
    return hf.get("sliding_window")


def model_keys_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """maxtrain model keys for an HF config.json (keys it leaves out have transformers' defaults), or a
    ConvertError naming what is unsupported."""
    kind = hf.get("model_type")
    if kind == "qwen2_moe":
        raise ConvertError("config.json: model_type 'qwen2_moe' is not supported (its shared expert has a sigmoid "
                           f"gate, which maxtrain lacks; supported: {', '.join(SUPPORTED)})")
    if kind not in SUPPORTED:
        raise ConvertError(f"config.json: model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    hf, defaults = with_defaults(hf), HF_DEFAULTS[kind]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        _positive_int(hf, key)
    if hf.get("hidden_act") not in ("silu", "swish"):
        raise ConvertError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConvertError(f"config.json: {key}=true is not supported (maxtrain has q/k/v biases only, "
                               f"as Qwen2)")
    window = _sliding_window(hf)
    if window is not None:
        raise ConvertError(f"config.json: sliding_window={window} is not supported (maxtrain attends over the "
                           f"full context; Mistral v0.2 and later have none)")
    # transformers >= 5 writes rope_parameters; older files have rope_theta and rope_scaling.
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConvertError(f"config.json: rope type {rope_type!r} is not supported (supported: default, llama3)")
    if _number({**hf, **rope}, "partial_rotary_factor", 1.0) != 1.0:
        raise ConvertError("config.json: partial_rotary_factor is not supported (maxtrain rotates whole heads)")
    scaling: dict[str, Any] = {"rope_scaling_factor": 1.0}  # the other three matter only with a factor
    if rope_type == "llama3":
        names = {"rope_scaling_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
                 "rope_high_freq_factor": "high_freq_factor"}
        scaling = {ours: _number(rope, theirs, math.nan) for ours, theirs in names.items()}
        original = rope.get("original_max_position_embeddings")
        if any(math.isnan(v) for v in scaling.values()) or not isinstance(original, int):
            raise ConvertError(f"config.json: llama3 rope parameters incomplete: {rope}")
        scaling["rope_original_max_position_embeddings"] = original
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "base_emb_dim": hf["hidden_size"],
        "base_num_query_heads": heads,
        "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "base_mlp_dim": hf["intermediate_size"],
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "rope_theta": _number(rope, "rope_theta", _number(hf, "rope_theta", defaults["rope_theta"])),
        "normalization_layer_epsilon": _number(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings")),
        "qkv_bias": kind == "qwen2",
        **scaling,
        **(_moe_keys(hf, kind) if kind in MOE else {"use_qk_norm": False, "num_experts": 1}),
    }


def _moe_keys(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    """The mixture-of-experts keys of a Mixtral or Qwen3-MoE config.json (router_jitter_noise and
    output_router_logits concern HF's training and outputs only, and are ignored)."""
    # transformers 5 writes num_local_experts for both; Qwen3-MoE files from the Hub say num_experts.
    experts_key = "num_local_experts" if kind == "mixtral" or "num_local_experts" in hf else "num_experts"
    experts, top_k = _positive_int(hf, experts_key), _positive_int(hf, "num_experts_per_tok")
    if experts < 2:
        raise ConvertError(f"config.json: {experts_key}={experts} is not supported (a mixture needs 2 experts or more)")
    if top_k > experts:
        raise ConvertError(f"config.json: num_experts_per_tok={top_k} exceeds {experts_key}={experts}")
    keys = {"num_experts": experts, "num_experts_per_tok": top_k, "shared_experts": 0, "first_num_dense_layers": 0,
            "routed_score_func": "softmax", "routed_bias": False, "routed_scaling_factor": 1.0,
            "load_balance_loss_weight": _number(hf, "router_aux_loss_coef",
                                                HF_DEFAULTS[kind]["router_aux_loss_coef"])}
    if kind == "mixtral":  # every layer sparse; softmax over all experts, top-k, renormalised
        return keys | {"use_qk_norm": False, "base_moe_mlp_dim": -1, "norm_topk_prob": True}
    step = hf.get("decoder_sparse_step")
    if step != 1:
        raise ConvertError(f"config.json: decoder_sparse_step={step!r} is not supported (maxtrain's Qwen3-MoE "
                           f"layers are all sparse: 1)")
    if hf.get("mlp_only_layers"):
        raise ConvertError(f"config.json: mlp_only_layers={hf['mlp_only_layers']!r} is not supported (maxtrain's "
                           f"Qwen3-MoE layers are all sparse: [])")
    norm_topk = hf.get("norm_topk_prob")
    if not isinstance(norm_topk, bool):
        raise ConvertError(f"config.json: norm_topk_prob={norm_topk!r} is not true or false")
    return keys | {"use_qk_norm": True, "base_moe_mlp_dim": _positive_int(hf, "moe_intermediate_size"),
                   "norm_topk_prob": norm_topk}


def hf_kind(m: dict[str, Any]) -> str:
    """The HF model_type that export writes for maxtrain model keys `m`, or a ConvertError naming the key
    that none of them can express."""
    if m["num_experts"] == 1:
        if m["use_qk_norm"]:
            raise ConvertError("use_qk_norm=true: a dense model with q/k norms (Qwen3) has no HF export here "
                               "(supported: Llama, Qwen2, Mixtral, Qwen3-MoE)")
        return "qwen2" if m["qkv_bias"] else "llama"
    for key, plain in (("shared_experts", 0), ("first_num_dense_layers", 0), ("routed_score_func", "softmax"),
                       ("routed_bias", False), ("routed_scaling_factor", 1.0), ("qkv_bias", False)):
        if m[key] != plain:
            raise ConvertError(f"{key}={m[key]!r}: neither Mixtral nor Qwen3-MoE has this (HF export needs "
                               f"{plain!r})")
    if m["use_qk_norm"]:
        return "qwen3_moe"
    if not m["norm_topk_prob"]:
        raise ConvertError("norm_topk_prob=false: Mixtral always renormalises its top-k weights (Qwen3-MoE, "
                           "which need not, has q/k norms: use_qk_norm=true)")
    return "mixtral"


def hf_config_for(m: dict[str, Any], dtype: str, source: dict[str, Any] | None, max_positions: int | None):
    """config.json for transformers. With the HF config the model was imported from (`source`), its other
    settings (model_type, token ids, context length) carry over; without one, per hf_kind: a mixture of
    experts is Qwen3-MoE with q/k norms, else Mixtral; a dense model Qwen2 with q/k/v biases, else Llama;
    with no special token ids and a 4096 context."""
    kind = hf_kind(m)
    if source:
        hf = dict(source)
    else:
        hf = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "hidden_act": "silu",
              "max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        hf |= {"qwen2": {"use_sliding_window": False, "sliding_window": None},
               "llama": {"attention_bias": False, "mlp_bias": False},
               "mixtral": {"sliding_window": None},
               "qwen3_moe": {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                             "decoder_sparse_step": 1, "mlp_only_layers": []}}[kind]
    if kind == "mixtral":
        hf["num_local_experts"] = m["num_experts"]
    elif kind == "qwen3_moe":  # transformers 5 reads either name (and writes the second); older ones the first
        hf |= {name: m["num_experts"] for name in ("num_experts", "num_local_experts")
               if name == "num_experts" or name in hf}
        hf |= {"moe_intermediate_size": moe_width(m), "norm_topk_prob": m["norm_topk_prob"]}
    if kind in MOE:
        hf |= {"num_experts_per_tok": m["num_experts_per_tok"], "router_aux_loss_coef": m["load_balance_loss_weight"]}
    hf |= {"vocab_size": m["vocab_size"], "hidden_size": m["base_emb_dim"],
           # Mixtral's experts are intermediate_size wide (its base_mlp_dim, if another, shapes nothing)
           "intermediate_size": moe_width(m) if kind == "mixtral" else m["base_mlp_dim"],
           "num_hidden_layers": m["base_num_decoder_layers"], "num_attention_heads": m["base_num_query_heads"],
           "num_key_value_heads": m["base_num_kv_heads"], "head_dim": m["head_dim"],
           "rms_norm_eps": m["normalization_layer_epsilon"], "tie_word_embeddings": m["logits_via_embedding"],
           "dtype": dtype, "torch_dtype": dtype}
    if max_positions:
        hf["max_position_embeddings"] = max_positions
    rope = {"rope_type": "default", "rope_theta": m["rope_theta"]}
    if m["rope_scaling_factor"] != 1.0:
        rope |= {"rope_type": "llama3", "factor": m["rope_scaling_factor"],
                 "low_freq_factor": m["rope_low_freq_factor"], "high_freq_factor": m["rope_high_freq_factor"],
                 "original_max_position_embeddings": m["rope_original_max_position_embeddings"]}
    # Both spellings: transformers >= 5 reads rope_parameters, older releases rope_theta + rope_scaling.
    hf |= {"rope_parameters": rope, "rope_theta": m["rope_theta"],
           "rope_scaling": rope if rope["rope_type"] != "default" else None}
    return hf


# ---------------------------------------------------------------------------------------------
# Reading safetensors


# safetensors dtype names -> numpy (bfloat16 through ml_dtypes, which JAX ships).
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class SafetensorsDir:
    """The tensors of an HF model directory (one file or a sharded index), read lazily by name.

    The format is an 8-byte header length, a JSON header {name: {dtype, shape, data_offsets}} and the raw
    bytes; each tensor is a read-only memory map into its file, so reading copies nothing until converted.
    (safetensors' own numpy reader has no bfloat16, hence these few lines.)"""

    def __init__(self, hf_dir: Path):
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConvertError(f"{index}: has no weight_map object")
            files = sorted({hf_dir / str(f) for f in weight_map.values()})
        elif (hf_dir / "model.safetensors").is_file():  # HF's name; ignore e.g. consolidated.safetensors
            files = [hf_dir / "model.safetensors"]
        else:
            files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            pickled = sorted(p.name for p in [*hf_dir.glob("*.bin"), *hf_dir.glob("*.pt"), *hf_dir.glob("*.pth")])
            hint = f" ({', '.join(pickled)}: pickle files, which maxtrain never loads)" if pickled else ""
            raise ConvertError(f"{hf_dir}: no *.safetensors files{hint}")
        self.entries: dict[str, tuple[Path, int, Any, tuple[int, ...]]] = {}  # name -> (file, offset, dtype, shape)
        for path in files:
            for name, entry in self._read_header(path).items():
                if name in self.entries:
                    raise ConvertError(f"{name}: in both {self.entries[name][0].name} and {path.name}")
                self.entries[name] = entry
        self.shapes = {name: entry[3] for name, entry in self.entries.items()}

    @staticmethod
    def _read_header(path: Path) -> dict[str, tuple[Path, int, Any, tuple[int, ...]]]:
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 2 <= n <= size - 8:
                    raise ValueError("bad header length")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            entries = {}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in SAFETENSORS_DTYPES:
                    raise ConvertError(f"{path}: tensor {name} has dtype {info['dtype']}; expected one of "
                                       f"{', '.join(SAFETENSORS_DTYPES)}")
                dtype, shape = np.dtype(SAFETENSORS_DTYPES[info["dtype"]]), tuple(info["shape"])
                begin, end = info["data_offsets"]
                if end - begin != dtype.itemsize * math.prod(shape) or 8 + n + end > size:
                    raise ValueError(f"tensor {name} does not fit the file")
                entries[name] = (path, 8 + n + begin, dtype, shape)
            return entries
        except FileNotFoundError:
            raise ConvertError(f"{path}: listed in model.safetensors.index.json but missing") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConvertError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None

    def get(self, name: str) -> np.ndarray:
        path, offset, dtype, shape = self.entries[name]
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConvertError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return data


# Files that travel with the weights: kept under <out>/hf/ at import, written beside the weights at export.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                 "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_settings(hf_path: Path, hf: dict, where: Path) -> dict[str, Any]:
    """maxtrain tokenizer keys for the HF tokenizer shipped with the model (copied to `where`)."""
    hf = with_defaults(hf)  # Llama's token ids default to 1 and 2
    if (hf_path / "tokenizer.json").is_file():
        tok = tokenizer_lib.HuggingFaceTokenizer(str(hf_path / "tokenizer.json"), False, False, "", "")

        def token(key):  # eos_token_id may be a list (Llama 3 Instruct): the first is the document end
            ids = hf.get(key)
            ids = ids[0] if isinstance(ids, list) and ids else ids
            return tok.id_to_token(ids) if isinstance(ids, int) else None
        bos, eos = token("bos_token_id"), token("eos_token_id")
        tc_path = hf_path / "tokenizer_config.json"
        tc = read_json(tc_path) if tc_path.is_file() else {}
        add_bos = tc["add_bos_token"] if isinstance(tc.get("add_bos_token"), bool) else (
            bos is not None and tc.get("bos_token", bos) is not None)  # Qwen2: bos_token null, none added
        return {"tokenizer_type": "huggingface", "tokenizer_path": str(where / "tokenizer.json"),
                "hf_bos_token": bos or "", "hf_eos_token": eos or "", "add_bos": add_bos}
    if (hf_path / "tokenizer.model").is_file():
        return {"tokenizer_type": "sentencepiece", "tokenizer_path": str(where / "tokenizer.model")}
    return {}
