"""HuggingFace <-> maxtrain parameter checkpoints for the Llama family (Llama, Mistral without sliding
window, Qwen2).

    python -m maxtrain.convert hf_to_maxtrain --hf_dir DIR --out DIR [--config x.yml] [key=value ...]
    python -m maxtrain.convert maxtrain_to_hf --checkpoint DIR --out DIR [--dtype bfloat16]

Layouts. torch's Linear stores [out, in]; maxtrain stores [in, out] with heads split out:
q_proj [H*K, D] -> wq [D, H, K]; k_proj, v_proj [N*K, D] -> wk, wv [D, N, K]; o_proj [D, H*K] -> wo [H, K, D];
gate_proj, up_proj [F, D] -> wi_gate, wi_up [D, F]; down_proj [D, F] -> wo [F, D]; lm_head [V, D] -> output [D, V].
RoPE: HF's Llama code rotates the two halves of each head (`rotate_half`), and HF checkpoints made from
Meta's interleaved-pair originals had their q/k rows permuted to suit it. maxtrain's `rope` uses the same
half-split convention, so q/k copy across unpermuted (a checkpoint in Meta's own layout would need that
permutation first: convert it to HF with transformers' script). RoPE types: default, and llama3 (Llama
3.1's frequency scaling, maxtrain's rope_scaling_* keys).

Beyond the weights: import keeps the HF config, tokenizer and generation files under <out>/hf/ and points
the written maxtrain.yml at the tokenizer; export takes them back (from an imported directory, or from the
one a training run started from, or --hf_source), so token ids and context length survive the round trip.

Safety and memory: safetensors only (never pickle). Import reads tensors one at a time from memory maps
into the single output copy; export restores one parameter (or one unrolled layer) at a time and writes
one shard at a time. Everything is checked before anything is written, and the output appears under its
final name only when complete.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np
import yaml

from maxtrain import checkpoint as ckpt_lib
from maxtrain import config as config_lib

SUPPORTED = ("llama", "mistral", "qwen2")


class ConvertError(RuntimeError):
    """Input that cannot be converted; the CLI prints it as one line and exits 2."""


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
            weight_map = _read_json(index).get("weight_map")
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


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConvertError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return data


# ---------------------------------------------------------------------------------------------
# hf_to_maxtrain


def _as_override(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# Files that travel with the weights: kept under <out>/hf/ at import, written beside the weights at export.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                 "tokenizer_config.json", "special_tokens_map.json")


def hf_to_maxtrain(hf_dir: str, out: str, config_path: str | None = None, overrides: tuple[str, ...] = ()) -> Path:
    hf_path, out_path = Path(hf_dir), Path(out).absolute()
    _check_out(out_path)
    hf = _read_json(hf_path / "config.json")
    hf_keys = model_keys_from_hf(hf)
    base = config_lib.load([config_path or str(config_lib.BASE_YML), *overrides])
    if config_path:  # the named config must describe this very model
        for key, value in hf_keys.items():
            if base[key] != value:
                raise ConvertError(f"{key}: {config_path} says {base[key]!r}, {hf_path}/config.json implies {value!r}")
    c = config_lib.load([config_path or str(config_lib.BASE_YML), *overrides,
                         *(f"{k}={_as_override(v)}" for k, v in hf_keys.items())])
    tokenizer = tokenizer_settings(hf_path, hf, out_path / "hf")

    reader = SafetensorsDir(hf_path)
    whole, layer = tensor_table(hf_keys)
    expected = {t.hf_name: t.hf_shape for t in whole}
    expected |= {layer_name(i, t): t.hf_shape for i in range(c.base_num_decoder_layers) for t in layer}
    for name, shape in expected.items():
        if name not in reader.shapes:
            raise ConvertError(f"{name}: missing from {hf_path}")
        if reader.shapes[name] != shape:
            raise ConvertError(f"{name}: shape {list(reader.shapes[name])} in {hf_path}, "
                               f"the config implies {list(shape)}")
    ignored = {"lm_head.weight"} if c.logits_via_embedding else set()  # tied: a copy of the embedding
    extra = sorted(n for n in reader.shapes if n not in expected and n not in ignored and "rotary_emb" not in n)
    if extra:
        raise ConvertError(f"{extra[0]}: unexpected tensor in {hf_path} ({len(extra)} in all); "
                           f"the model is not a plain {hf['model_type']}")

    params = read_hf_params(reader, c, whole, layer)
    with _staged(out_path) as tmp:
        ckpt_lib.save_parameters(tmp, params, c)
        (tmp / "hf").mkdir()
        for name in HF_SIDE_FILES:
            if (hf_path / name).is_file():
                shutil.copy(hf_path / name, tmp / "hf" / name)
        settings = {k: c[k] for k in config_lib.MODEL_KEYS} | {"scan_layers": c.scan_layers,
                                                               "weight_dtype": c.weight_dtype} | tokenizer
        if config_path:
            settings = {"base_config": str(Path(config_path).absolute())} | settings
        settings["load_parameters_path"] = str(out_path)
        header = (f"# Written by `python -m maxtrain.convert hf_to_maxtrain` from {hf_path.absolute()}.\n"
                  f"# Train from these weights: python -m maxtrain.train {out_path}/maxtrain.yml key=value ...\n")
        (tmp / "maxtrain.yml").write_text(header + yaml.safe_dump(settings, sort_keys=False))
    return out_path


def _host_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An empty array with 64-byte-aligned data: jax.device_put aliases such an array on CPU instead of
    copying it, so a finished parameter costs no second copy."""
    dtype = np.dtype(dtype)
    raw = np.empty(math.prod(shape) * dtype.itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def read_hf_params(reader: SafetensorsDir, c: config_lib.Config, whole: list[Tensor], layer: list[Tensor]):
    """maxtrain's parameter tree, built one HF tensor at a time from memory maps into CPU jax arrays
    (which Orbax writes without another host copy): the peak is the model once, in weight_dtype."""
    dtype = jax.numpy.dtype(c.weight_dtype)
    cpu = jax.local_devices(backend="cpu")[0]
    n_layers = c.base_num_decoder_layers

    def load(t: Tensor, names: list[str], stack: bool):
        """One parameter from its HF tensor, or from one per layer stacked on a leading `layers` axis."""
        first = t.to_maxtrain(reader.get(names[0]))
        out = _host_array((len(names), *first.shape) if stack else first.shape, dtype)
        if stack:  # layer by layer into the stacked array
            for i, name in enumerate(names):
                out[i] = first if i == 0 else t.to_maxtrain(reader.get(name))
        else:
            out[...] = first
        return jax.device_put(out, cpu)  # aliases `out`: no copy

    params: dict[str, Any] = {}
    for t in whole:
        _put(params, t.path, load(t, [t.hf_name], stack=False))
    for t in layer:
        names = [layer_name(i, t) for i in range(n_layers)]
        if c.scan_layers:
            _put(params, ("layers", *t.path), load(t, names, stack=True))
        else:
            for i, name in enumerate(names):
                _put(params, (f"layers_{i}", *t.path), load(t, [name], stack=False))
    return params


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def tokenizer_settings(hf_path: Path, hf: dict, where: Path) -> dict[str, Any]:
    """maxtrain tokenizer keys for the HF tokenizer shipped with the model (copied to `where`)."""
    if (hf_path / "tokenizer.json").is_file():
        import tokenizers
        try:
            tok = tokenizers.Tokenizer.from_file(str(hf_path / "tokenizer.json"))
        except Exception:  # the Rust side raises a bare Exception for unparseable files
            raise ConvertError(f"{hf_path / 'tokenizer.json'}: cannot load as a HuggingFace tokenizer") from None

        def token(key):  # eos_token_id may be a list (Llama 3 Instruct): the first is the document end
            ids = hf.get(key)
            ids = ids[0] if isinstance(ids, list) and ids else ids
            return tok.id_to_token(ids) if isinstance(ids, int) else None
        bos, eos = token("bos_token_id"), token("eos_token_id")
        tc_path = hf_path / "tokenizer_config.json"
        tc = _read_json(tc_path) if tc_path.is_file() else {}
        add_bos = tc["add_bos_token"] if isinstance(tc.get("add_bos_token"), bool) else (
            bos is not None and tc.get("bos_token", bos) is not None)  # Qwen2: bos_token null, none added
        return {"tokenizer_type": "huggingface", "tokenizer_path": str(where / "tokenizer.json"),
                "hf_bos_token": bos or "", "hf_eos_token": eos or "", "add_bos": add_bos}
    if (hf_path / "tokenizer.model").is_file():
        return {"tokenizer_type": "sentencepiece", "tokenizer_path": str(where / "tokenizer.model")}
    return {}


# ---------------------------------------------------------------------------------------------
# maxtrain_to_hf


class CheckpointParams:
    """The parameters of a maxtrain checkpoint step directory, restored one subtree at a time as host
    numpy arrays: export never holds the whole model (an unscanned layer, or one stacked parameter)."""

    def __init__(self, checkpoint: str):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self.step_dir = ckpt_lib.step_directory(checkpoint, "--checkpoint")
        self.signature = ckpt_lib.read_model(self.step_dir)
        missing = [k for k in (*config_lib.MODEL_KEYS, "scan_layers") if k not in self.signature]
        if missing:
            raise ConvertError(f"{checkpoint}: model description lacks {', '.join(missing)} (older maxtrain?)")
        self._checkpointer = ocp.PyTreeCheckpointer()
        try:
            self.metadata = self._checkpointer.metadata(self.step_dir / "state").item_metadata.tree["params"]
        except Exception as e:  # Orbax raises many types for unreadable data
            raise ckpt_lib.restore_failed("--checkpoint", self.step_dir, e) from None

    def read(self, *path: str):
        nested = _get(self.metadata, path)
        for key in reversed(path):
            nested = {key: nested}
        target = {"params": nested}
        restore_args = jax.tree.map(lambda _: self._ocp.RestoreArgs(restore_type=np.ndarray), target)
        try:
            restored = self._checkpointer.restore(self.step_dir / "state", args=self._ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True))
        except Exception as e:
            raise ckpt_lib.restore_failed("--checkpoint", self.step_dir, e) from None
        return _get(restored["params"], path)


def find_hf_source(step_dir: Path) -> Path | None:
    """The HF files an imported model came with (<import>/hf/): in an imported directory itself, or in the
    one a training run started from (its <run>/config.yml's load_parameters_path)."""
    if (step_dir / "hf" / "config.json").is_file():
        return step_dir / "hf"
    run_config = step_dir.parent.parent / "config.yml"
    try:
        origin = (yaml.safe_load(run_config.read_text()) or {}).get("load_parameters_path")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if origin and (Path(origin) / "hf" / "config.json").is_file():
        return Path(origin) / "hf"
    return None


def maxtrain_to_hf(checkpoint: str, out: str, dtype: str | None = None, max_positions: int | None = None,
                   max_shard_bytes: int = 2 << 30, hf_source: str | None = None) -> Path:
    out_path = Path(out).absolute()
    _check_out(out_path)
    ckpt = CheckpointParams(checkpoint)
    m = ckpt.signature
    if m["base_emb_dim"] % m["base_num_query_heads"]:  # transformers' configs refuse this
        raise ConvertError(f"base_emb_dim={m['base_emb_dim']} is not divisible by base_num_query_heads="
                           f"{m['base_num_query_heads']}: transformers cannot load such a Llama")
    source_dir = Path(hf_source) if hf_source else find_hf_source(ckpt.step_dir)
    source = _read_json(source_dir / "config.json") if source_dir else None
    if source:
        theirs = model_keys_from_hf(source)
        differ = [k for k, v in theirs.items() if k in m and m[k] != v]
        if differ:
            raise ConvertError(f"--hf_source {source_dir}: {differ[0]} differs (HF config {theirs[differ[0]]!r}, "
                               f"checkpoint {m[differ[0]]!r})")
    dtype = dtype or np.dtype(ckpt.metadata["embedding"].dtype).name
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    whole, layer = tensor_table(m)
    n_layers = m["base_num_decoder_layers"]

    def tensors():  # (HF name, HF array), one at a time
        for t in whole:
            yield t.hf_name, t.to_hf(ckpt.read(*t.path))
        if m["scan_layers"]:
            for t in layer:
                stacked = ckpt.read("layers", *t.path)
                for i in range(n_layers):
                    yield layer_name(i, t), t.to_hf(stacked[i])
        else:
            for i in range(n_layers):
                params_i = ckpt.read(f"layers_{i}")
                for t in layer:
                    yield layer_name(i, t), t.to_hf(_get(params_i, t.path))

    from safetensors.numpy import save_file
    with _staged(out_path) as tmp:
        shard_names, current, size = [], {}, 0

        def flush():
            nonlocal current, size
            shard_names.append(list(current))
            save_file(current, tmp / f"shard-{len(shard_names)}.safetensors", metadata={"format": "pt"})
            current, size = {}, 0

        for name, x in tensors():
            current[name] = np.ascontiguousarray(x, dtype=np_dtype)
            size += current[name].nbytes
            if size >= max_shard_bytes:
                flush()
        if current or not shard_names:
            flush()
        _name_shards(tmp, shard_names)
        for name in HF_SIDE_FILES[1:]:  # tokenizer and generation settings; config.json is written below
            if source_dir and (source_dir / name).is_file():
                shutil.copy(source_dir / name, tmp / name)
        hf = hf_config_for(m, dtype, source, max_positions)
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out_path


def _name_shards(tmp: Path, shard_names: list[list[str]]) -> None:
    """HF's file names: model.safetensors, or model-0000i-of-0000n.safetensors plus an index."""
    n = len(shard_names)
    if n == 1:
        (tmp / "shard-1.safetensors").rename(tmp / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shard_names, 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        (tmp / f"shard-{i}.safetensors").rename(tmp / final)
        weight_map.update({name: final for name in names})
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Output handling and CLI


def _check_out(out_path: Path) -> None:
    if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
        raise ConvertError(f"--out: {out_path} already exists and is not empty")


@contextmanager
def _staged(out_path: Path):
    """Write into a temporary sibling directory; rename it to `out_path` only when complete."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.partial-", dir=out_path.parent))
    try:
        yield tmp
        if out_path.exists():
            out_path.rmdir()  # empty (checked before)
        tmp.rename(out_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxtrain.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("hf_to_maxtrain", help="HF directory (config.json + safetensors) -> maxtrain checkpoint")
    imp.add_argument("--hf_dir", required=True)
    imp.add_argument("--out", required=True)
    imp.add_argument("--config", help="maxtrain config that must match the HF model (layout, weight dtype)")
    imp.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. scan_layers=false")
    exp = sub.add_parser("maxtrain_to_hf", help="maxtrain checkpoint step directory -> HF directory")
    exp.add_argument("--checkpoint", required=True, help="<run>/checkpoints/<step> or a converted directory")
    exp.add_argument("--out", required=True)
    exp.add_argument("--dtype", choices=config_lib.DTYPES, help="default: the checkpoint's parameter dtype")
    exp.add_argument("--hf_source", help="HF directory whose other settings and tokenizer files to carry over "
                     "(default: found from an imported checkpoint or a run that started from one)")
    exp.add_argument("--max_position_embeddings", type=int, help="default: the HF source's, else 4096")
    exp.add_argument("--max_shard_mb", type=int, default=2048, help="safetensors file size limit")
    args = parser.parse_args(argv)
    try:
        if args.command == "hf_to_maxtrain":
            out = hf_to_maxtrain(args.hf_dir, args.out, args.config, tuple(args.overrides))
            print(f"wrote {out} (load it with load_parameters_path={out}; config: {out}/maxtrain.yml)")
        else:
            out = maxtrain_to_hf(args.checkpoint, args.out, args.dtype, args.max_position_embeddings,
                                 args.max_shard_mb << 20, args.hf_source)
            print(f"wrote {out} (transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (ConvertError, ckpt_lib.CheckpointError) as e:
        print(f"convert error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
