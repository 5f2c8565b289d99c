"""The file side of HuggingFace conversion, shared by every family: a safetensors reader, the
files that travel with the weights, and the tokenizer settings that go with them. maxtrain.convert does
the conversions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.runtime.errors import ConvertError


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
    """maxtrain tokenizer keys for the HF tokenizer shipped with the model (copied to `where`); `hf` its
    config.json with transformers' defaults (maxtrain.models.hf.with_defaults: Llama's token ids 1 and 2)."""
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
