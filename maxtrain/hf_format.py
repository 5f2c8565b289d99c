"""The HuggingFace side of conversion: how a Llama-family checkpoint is laid out (tensor names, shapes and
their maxtrain counterparts), what its config.json means in maxtrain's model keys and back, a safetensors
reader, and the tokenizer settings that go with it. maxtrain.convert does the conversions.

Layouts. torch's Linear stores [out, in]; maxtrain stores [in, out] with heads split out:
q_proj [H*K, D] -> wq [D, H, K]; k_proj, v_proj [N*K, D] -> wk, wv [D, N, K]; o_proj [D, H*K] -> wo [H, K, D];
gate_proj, up_proj [F, D] -> wi_gate, wi_up [D, F]; down_proj [D, F] -> wo [F, D]; lm_head [V, D] -> output [D, V].
RoPE: HF's Llama code rotates the two halves of each head (`rotate_half`), and HF checkpoints made from
Meta's interleaved-pair originals had their q/k rows permuted to suit it. maxtrain's `rope` uses the same
half-split convention, so q/k copy across unpermuted (a checkpoint in Meta's own layout would need that
permutation first: convert it to HF with transformers' script). RoPE types: default, and llama3 (Llama
3.1's frequency scaling, maxtrain's rope_scaling_* keys).
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

SUPPORTED = ("llama", "mistral", "qwen2")


class ConvertError(UserError, RuntimeError):
    """Input that cannot be converted; the CLI prints it as one line and exits 2."""
    kind = "convert"


@dataclass(frozen=True)
class Tensor:
    path: tuple[str, ...]  # maxtrain parameter path (inside one layer for per-layer tensors)
    hf_name: str           # HF name (after "model.layers.<i>." for per-layer tensors)
    hf_shape: tuple[int, ...]
    to_maxtrain: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def tensor_table(m: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
    """(whole-model tensors, per-layer tensors) for maxtrain model keys `m`."""
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
        Tensor(("mlp", "wi_gate"), "mlp.gate_proj.weight", (f, d), T, T),
        Tensor(("mlp", "wi_up"), "mlp.up_proj.weight", (f, d), T, T),
        Tensor(("mlp", "wo"), "mlp.down_proj.weight", (d, f), T, T),
        Tensor(("attention_norm", "scale"), "input_layernorm.weight", (d,), same, same),
        Tensor(("mlp_norm", "scale"), "post_attention_layernorm.weight", (d,), same, same),
    ]
    if m["qkv_bias"]:
        layer += [Tensor(("attention", "bq"), "self_attn.q_proj.bias", (h * k,), *bias(h)),
                  Tensor(("attention", "bk"), "self_attn.k_proj.bias", (n * k,), *bias(n)),
                  Tensor(("attention", "bv"), "self_attn.v_proj.bias", (n * k,), *bias(n))]
    whole = [Tensor(("embedding",), "model.embed_tokens.weight", (v, d), same, same),
             Tensor(("final_norm", "scale"), "model.norm.weight", (d,), same, same)]
    if not m["logits_via_embedding"]:
        whole.append(Tensor(("output",), "lm_head.weight", (v, d), T, T))
    return whole, layer


def layer_name(i: int, t: Tensor) -> str:
    return f"model.layers.{i}.{t.hf_name}"


# ---------------------------------------------------------------------------------------------
# HF config.json <-> maxtrain model keys


def _number(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConvertError(f"config.json: {key}={value!r} is not a number")
    return float(value)


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The window of any layer that slides: Mistral's sliding_window; Qwen2's only where use_sliding_window
    is set and a layer (from max_window_layers on, or per layer_types) actually uses it."""
    if hf.get("model_type") == "qwen2":
        if not hf.get("use_sliding_window"):
            return None
        types = hf.get("layer_types") or ["sliding_attention" if i >= (hf.get("max_window_layers") or 0)
                                          else "full_attention" for i in range(hf["num_hidden_layers"])]
        if "sliding_attention" not in types:
            return None
    return hf.get("sliding_window")


def model_keys_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """maxtrain model keys for an HF config.json, or a ConvertError naming what is unsupported."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool) or hf[key] <= 0:
            raise ConvertError(f"config.json: {key} missing or not a positive integer")
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ConvertError(f"config.json: model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
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
        "rope_theta": _number(rope, "rope_theta", _number(hf, "rope_theta", 10000.0)),
        "normalization_layer_epsilon": _number(hf, "rms_norm_eps", 1e-6),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": kind == "qwen2",
        **scaling,
    }


def hf_config_for(m: dict[str, Any], dtype: str, source: dict[str, Any] | None, max_positions: int | None):
    """config.json for transformers. With the HF config the model was imported from (`source`), its other
    settings (model_type, token ids, context length) carry over; without one: Qwen2 when the model has q/k/v
    biases, else Llama, with no special token ids and a 4096 context."""
    qwen = m["qkv_bias"]
    if source:
        hf = dict(source)
    else:
        hf = {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
              "model_type": "qwen2" if qwen else "llama", "hidden_act": "silu", "max_position_embeddings": 4096,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        hf |= {"use_sliding_window": False, "sliding_window": None} if qwen else {"attention_bias": False,
                                                                                   "mlp_bias": False}
    hf |= {"vocab_size": m["vocab_size"], "hidden_size": m["base_emb_dim"], "intermediate_size": m["base_mlp_dim"],
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
