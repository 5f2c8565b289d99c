"""HuggingFace <-> maxtrain for the registered families: the decoder layout they all share, and the
entry points maxtrain.convert calls, which ask the model's family (maxtrain.models.registry) for the
rest. maxtrain.checkpoint.hf_format has the file-level machinery (Tensor, safetensors, tokenizer settings).

Layouts. torch's Linear stores [out, in]; maxtrain stores [in, out] with heads split out:
q_proj [H*K, D] -> wq [D, H, K]; k_proj, v_proj [N*K, D] -> wk, wv [D, N, K]; o_proj [D, H*K] -> wo [H, K, D];
gate_proj, up_proj [F, D] -> wi_gate, wi_up [D, F]; down_proj [D, F] -> wo [F, D]; lm_head [V, D] -> output [D, V].
RoPE: HF's Llama code rotates the two halves of each head (`rotate_half`), and HF checkpoints made from
Meta's interleaved-pair originals had their q/k rows permuted to suit it. maxtrain's `rope` uses the same
half-split convention, so q/k copy across unpermuted (a checkpoint in Meta's own layout would need that
permutation first: convert it to HF with transformers' script). RoPE types: default, llama3 (Llama 3.1's
frequency scaling), linear (Gemma 3's global layers) and yarn (gpt-oss): rope_type and the rope_* keys.
A family's own settings (windows, sinks, norms, activations) go through its HFMapping hooks.

Experts. Files (what save_pretrained writes, transformers 5 included, and the Hub's checkpoints) hold one
tensor per expert (names: the family's). maxtrain stacks them: router [D, E], wi_gate, wi_up [E, D, F],
wo [E, F, D]. transformers 5 fuses them in memory (mlp.experts.gate_up_proj [E, 2F, D], gate rows first;
mlp.experts.down_proj [E, D, F]; router mlp.gate) and loads files in that layout as well: import reads
both, export writes the per-expert one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from maxtrain.config.keys import padded_vocab
from maxtrain.checkpoint.hf_format import Tensor, layer_name
from maxtrain.runtime.errors import ConvertError
from maxtrain.models import registry, stacks as stacks_lib
from maxtrain.config.keys import moe_width
from maxtrain.models.registry import Keys

# Families HF has and maxtrain does not: why not.
UNSUPPORTED = {"qwen2_moe": "its shared expert has a sigmoid gate, which maxtrain lacks"}
FUSED_EXPERTS_NAME = ".mlp.experts.gate_up_proj"  # the end of a name only the fused layout has (gpt-oss aside)

# What transformers (5.x) assumes for each key a config.json leaves out, shared by the families' tables
# (each family's HFType.defaults: the defaults of its <Family>Config; rope_theta: the class's
# default_theta). None as transformers has it: "derived" (num_key_value_heads = num_attention_heads,
# head_dim = hidden_size // num_attention_heads) or "none". tests/test_convert_defaults.py holds each
# family's table to transformers' own.
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads")
COMMON = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def supported() -> tuple[str, ...]:
    return tuple(registry.hf_types())


def hf_defaults() -> dict[str, dict[str, Any]]:
    """Each supported model_type's table of transformers' defaults."""
    return {kind: t.defaults for kind, t in registry.hf_types().items()}


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """An HF config.json with transformers' defaults for the keys it leaves out (a supported family's)."""
    kind = registry.hf_types().get(hf.get("model_type")) if isinstance(hf.get("model_type"), str) else None
    return {**(kind.defaults if kind else {}), **hf}


def number(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConvertError(f"config.json: {key}={value!r} is not a number")
    return float(value)


def positive_int(hf: dict[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConvertError(f"config.json: {key} missing or not a positive integer")
    return value


def layered_sliding_window(hf: dict[str, Any]) -> int | None:
    """Qwen2's and Qwen3's rule: the window only where use_sliding_window is set and a layer (from
    max_window_layers on, or per layer_types) actually uses it."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None
    types = hf.get("layer_types") or ["sliding_attention" if i >= hf["max_window_layers"]
                                      else "full_attention" for i in range(hf["num_hidden_layers"])]
    return hf.get("sliding_window") if "sliding_attention" in types else None


# ---------------------------------------------------------------------------------------------
# config.json <-> maxtrain model keys


# Model keys of the attention and block variants, at the values that leave the plain decoder. A family
# whose HF model has a variant sets its key in `HFMapping.keys`; export refuses a model whose family's
# HF types cannot carry a variant it has (HFMapping.expresses).
PLAIN_VARIANTS = {
    "sliding_window_size": 0, "global_layer_interval": 0, "local_rope_theta": -1.0, "attention_sinks": False,
    "attn_logit_softcapping": 0.0, "final_logit_softcapping": 0.0, "query_pre_attn_scalar": 0.0,
    "attention_out_bias": False, "scale_embedding": False, "rms_norm_plus_one": False, "use_post_attn_norm": False,
    "use_post_ffw_norm": False, "mlp_activation": "silu", "mlp_bias": False, "router_logit_bias": False,
}


def plain_checks(hf: dict[str, Any]) -> None:
    """What the Llama-like families' config.json must say (a family with its own checks replaces these)."""
    if hf.get("hidden_act") not in ("silu", "swish"):
        raise ConvertError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConvertError(f"config.json: {key}=true is not supported (maxtrain has q/k/v biases only, "
                               f"as Qwen2)")


def rope_keys(rope: dict[str, Any], theta: float) -> dict[str, Any]:
    """maxtrain's RoPE keys for HF rope parameters `rope` (rope_type and its settings), base `theta`."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", "yarn"):
        raise ConvertError(f"config.json: rope type {rope_type!r} is not supported (supported: default, llama3, "
                           f"linear, yarn)")
    if number(rope, "partial_rotary_factor", 1.0) != 1.0:
        raise ConvertError("config.json: partial_rotary_factor is not supported (maxtrain rotates whole heads)")
    keys: dict[str, Any] = {"rope_theta": theta, "rope_scaling_factor": 1.0, "rope_type": "llama3"}
    if rope_type == "default":  # the other keys matter only with a factor
        return keys
    factor = number(rope, "factor", math.nan)
    if math.isnan(factor) or factor < 1:
        raise ConvertError(f"config.json: {rope_type} rope parameters need a factor >= 1: {rope}")
    keys |= {"rope_type": rope_type, "rope_scaling_factor": factor}
    if rope_type == "linear":
        return keys
    original = rope.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ConvertError(f"config.json: {rope_type} rope parameters need original_max_position_embeddings: {rope}")
    keys["rope_original_max_position_embeddings"] = original
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None:
            raise ConvertError(f"config.json: yarn attention_factor={rope['attention_factor']!r} is not supported (cos "
                               f"and sin scale by 0.1 ln(factor) + 1, or as mscale and mscale_all_dim say)")
        return keys | {"rope_yarn_beta_fast": number(rope, "beta_fast", 32.0) or 32.0,
                       "rope_yarn_beta_slow": number(rope, "beta_slow", 1.0) or 1.0,
                       "rope_yarn_truncate": bool(rope.get("truncate", True)),
                       "rope_yarn_mscale": number(rope, "mscale", 0.0),
                       "rope_yarn_mscale_all_dim": number(rope, "mscale_all_dim", 0.0)}
    names = {"rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor": "high_freq_factor"}
    scaling = {ours: number(rope, theirs, math.nan) for ours, theirs in names.items()}
    if any(math.isnan(v) for v in scaling.values()):
        raise ConvertError(f"config.json: llama3 rope parameters incomplete: {rope}")
    return keys | scaling


def flat_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The one set of rope parameters of a config.json: transformers >= 5 writes rope_parameters, older
    files rope_theta and rope_scaling."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


# ---------------------------------------------------------------------------------------------
# config.json <-> maxtrain model keys


def model_keys_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """maxtrain model keys for an HF config.json (keys it leaves out have transformers' defaults), or a
    ConvertError naming what is unsupported."""
    kind = hf.get("model_type")
    if isinstance(kind, str) and kind in UNSUPPORTED:
        raise ConvertError(f"config.json: model_type {kind!r} is not supported ({UNSUPPORTED[kind]}; "
                           f"supported: {', '.join(supported())})")
    spec = registry.by_hf_type(kind)
    if spec is None:
        raise ConvertError(f"config.json: model_type {kind!r} is not supported (supported: {', '.join(supported())})")
    hf, defaults = with_defaults(hf), spec.hf.types[kind].defaults
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        positive_int(hf, key)
    (spec.hf.checks or plain_checks)(hf)
    window = spec.hf.sliding_window(hf)
    if window is not None and not spec.hf.windowed:
        raise ConvertError(f"config.json: sliding_window={window} is not supported (maxtrain's {kind} attends over "
                           f"the full context: a window on some layers only is not expressed)")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ConvertError(f"config.json: sliding_window={window!r} is not a positive integer")
    rope = (spec.hf.rope or flat_rope)(hf)
    heads = hf["num_attention_heads"]
    keys = {
        "vocab_size": hf["vocab_size"],
        "base_emb_dim": hf["hidden_size"],
        "base_num_query_heads": heads,
        "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "base_mlp_dim": hf["intermediate_size"],
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "normalization_layer_epsilon": number(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings")),
        "qkv_bias": False,
        **PLAIN_VARIANTS,
        "sliding_window_size": window or 0,
        **rope_keys(rope, number(rope, "rope_theta", number(hf, "rope_theta", defaults["rope_theta"]))),
    }
    return keys | spec.hf.keys(hf, kind)


def unexpressed(m: Keys, spec) -> str | None:
    """The first variant key of model keys `m` that the family's HF types cannot carry, if any."""
    return next((k for k, plain in PLAIN_VARIANTS.items() if m[k] != plain and k not in spec.hf.expresses), None)


def hf_kind(m: Keys) -> str:
    """The HF model_type that export writes for maxtrain model keys `m`, or a ConvertError naming the key
    that none of them can express."""
    spec = registry.spec_for(m)
    key = unexpressed(m, spec) if spec.hf else None
    if key:
        raise ConvertError(f"{key}={m[key]!r}: no HF model of this family ({', '.join(spec.hf.types)}) has it (HF "
                           f"export needs {PLAIN_VARIANTS[key]!r})")
    return spec.hf_kind(m)


def hf_config_for(m: Keys, dtype: str, source: dict[str, Any] | None, max_positions: int | None):
    """config.json for transformers. With the HF config the model was imported from (`source`), its other
    settings (model_type, token ids, context length) carry over; without one, the model_type hf_kind
    picks, with no special token ids and a 4096 context."""
    spec = registry.spec_for(m)
    kind = spec.hf_kind(m)
    if source:
        hf = dict(source)
    else:
        hf = {"architectures": [spec.hf.types[kind].architecture], "model_type": kind, "hidden_act": "silu",
              "max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        hf |= spec.hf.types[kind].fresh
    hf |= {"vocab_size": m["vocab_size"], "hidden_size": m["base_emb_dim"], "intermediate_size": m["base_mlp_dim"],
           "num_hidden_layers": m["base_num_decoder_layers"], "num_attention_heads": m["base_num_query_heads"],
           "num_key_value_heads": m["base_num_kv_heads"], "head_dim": m["head_dim"],
           "rms_norm_eps": m["normalization_layer_epsilon"], "tie_word_embeddings": m["logits_via_embedding"],
           "dtype": dtype, "torch_dtype": dtype}
    if max_positions:
        hf["max_position_embeddings"] = max_positions
    rope = rope_parameters(m)
    # Both spellings: transformers >= 5 reads rope_parameters, older releases rope_theta + rope_scaling.
    hf |= {"rope_parameters": rope, "rope_theta": m["rope_theta"],
           "rope_scaling": rope if rope["rope_type"] != "default" else None}
    if m["sliding_window_size"]:
        hf["sliding_window"] = m["sliding_window_size"]
    return hf | spec.hf.config(m, kind, hf)


def rope_parameters(m: Keys, theta: float | None = None) -> dict[str, Any]:
    """HF rope parameters for maxtrain model keys `m` (with `theta`: that base, unscaled)."""
    if theta is not None or m["rope_scaling_factor"] == 1.0:
        return {"rope_type": "default", "rope_theta": m["rope_theta"] if theta is None else theta}
    rope = {"rope_type": m["rope_type"], "rope_theta": m["rope_theta"], "factor": m["rope_scaling_factor"]}
    if m["rope_type"] == "llama3":
        rope |= {"low_freq_factor": m["rope_low_freq_factor"], "high_freq_factor": m["rope_high_freq_factor"]}
    if m["rope_type"] == "yarn":
        rope |= {"beta_fast": m["rope_yarn_beta_fast"], "beta_slow": m["rope_yarn_beta_slow"],
                 "truncate": m["rope_yarn_truncate"]}
        rope |= {name: m[f"rope_yarn_{name}"] for name in ("mscale", "mscale_all_dim") if m[f"rope_yarn_{name}"]}
    if m["rope_type"] != "linear":
        rope["original_max_position_embeddings"] = m["rope_original_max_position_embeddings"]
    return rope


# ---------------------------------------------------------------------------------------------
# Tensors


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


def moe_keys(hf: dict[str, Any], kind: str, experts_key: str) -> dict[str, Any]:
    """The mixture-of-experts keys Mixtral and Qwen3-MoE share (router_jitter_noise and
    output_router_logits concern HF's training and outputs only, and are ignored)."""
    experts, top_k = positive_int(hf, experts_key), positive_int(hf, "num_experts_per_tok")
    if experts < 2:
        raise ConvertError(f"config.json: {experts_key}={experts} is not supported (a mixture needs 2 experts or more)")
    if top_k > experts:
        raise ConvertError(f"config.json: num_experts_per_tok={top_k} exceeds {experts_key}={experts}")
    defaults = registry.hf_types()[kind].defaults
    return {"num_experts": experts, "num_experts_per_tok": top_k, "shared_experts": 0, "first_num_dense_layers": 0,
            "routed_score_func": "softmax", "routed_bias": False, "routed_scaling_factor": 1.0,
            "load_balance_loss_weight": number(hf, "router_aux_loss_coef", defaults["router_aux_loss_coef"])}
