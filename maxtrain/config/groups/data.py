"""The data keys (group `data`: what the model is trained on, in which order) and their checks; a mixture's
(data_sources, data_stages, data_source_exhausted, eval_sources) name the key down to the source and stage:
`data_stages[1].weights.web`."""

from __future__ import annotations

import math
from typing import Any

from maxtrain.runtime.declaration import Key, declare
from maxtrain.config.keys import RUN_NAME, ConfigError
from maxtrain.runtime import storage

DATASET_TYPES = ("synthetic", "prepared", "text", "parquet", "array_record")


SOURCE_KEYS = {"files": str, "weight": float, "dataset_type": str, "text_field": str}


def _check_weight(where: str, w: Any) -> None:
    """A finite number >= 0 (YAML's .nan and .inf are floats too)."""
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
        raise ConfigError(where, f"must be a finite number >= 0, got {w!r}")


def _sources(c: dict[str, Any], key: str, weighted: bool) -> None:
    """data_sources / eval_sources: name -> {files, (weight,) dataset_type, text_field}."""
    if not isinstance(c[key], dict):
        raise ConfigError(key, "must be a mapping of name: {files: ...}")
    allowed = [k for k in SOURCE_KEYS if weighted or k != "weight"]
    for name, spec in c[key].items():
        where = f"{key}.{name}"
        if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
            raise ConfigError(where, "a source's name is a plain word (letters, digits, '.', '_', '-'): it names "
                              "its metrics")
        if not isinstance(spec, dict):
            example = f"{{files: \"data/*.jsonl\"{', weight: 0.5' if weighted else ''}}}"
            raise ConfigError(where, f"must be a mapping like {example}")
        for k, v in spec.items():
            if k not in allowed:
                raise ConfigError(f"{where}.{k}", f"unknown; a source takes {', '.join(allowed)}")
            kind = SOURCE_KEYS[k]
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else isinstance(v, kind)):
                raise ConfigError(f"{where}.{k}", f"expected {'a number' if kind is float else 'a string'}, got {v!r}")
        for k in ("files", "weight") if weighted else ("files",):
            if k not in spec or (k == "files" and not spec[k].strip()):
                raise ConfigError(f"{where}.{k}", "missing" if k not in spec else "is empty")
        if weighted:
            _check_weight(f"{where}.weight", spec["weight"])
        if spec.get("dataset_type", "text") not in DATASET_TYPES[1:]:
            raise ConfigError(f"{where}.dataset_type", f"{spec['dataset_type']!r} is not one of "
                              f"{', '.join(DATASET_TYPES[1:])}")
        for value in spec["files"].split(","):
            storage.check(value.strip(), f"{where}.files")


def _sources_and_stages(c: dict[str, Any]) -> None:
    """data_sources, data_stages, eval_sources and the keys they replace."""
    _sources(c, "data_sources", weighted=True)
    _sources(c, "eval_sources", weighted=False)
    if c["eval_sources"] and c["eval_files"]:
        raise ConfigError("eval_files", "set either eval_files or eval_sources (each evaluated on its own), not both")
    sources = c["data_sources"]
    if not sources:
        for key in ("data_stages", "data_source_exhausted"):
            if c[key] != {"data_stages": [], "data_source_exhausted": "repeat"}[key]:
                raise ConfigError(key, "applies to a mixture: set data_sources")
        return
    for key, why in (("train_files", "data_sources replaces it (a mixture of one is a source of weight 1)"),
                     ("eval_files", "use eval_sources with data_sources"),
                     ("num_epochs", "with data_sources each source repeats or is dropped when used up "
                                    "(data_source_exhausted); end the run with steps")):
        if c[key] != {"train_files": "", "eval_files": "", "num_epochs": -1}[key]:
            raise ConfigError(key, f"{c[key]!r}: {why}")
    if sum(s["weight"] for s in sources.values()) <= 0:
        raise ConfigError("data_sources", "every weight is 0: give at least one source a positive weight")
    stages = c["data_stages"]
    if not isinstance(stages, list):
        raise ConfigError("data_stages", "must be a list of {start_step: N, weights: {name: w, ...}}")
    last = 0
    for n, stage in enumerate(stages):
        where = f"data_stages[{n}]"
        if not isinstance(stage, dict) or set(stage) != {"start_step", "weights"}:
            raise ConfigError(where, "must be {start_step: N, weights: {name: w, ...}}")
        start, weights = stage["start_step"], stage["weights"]
        if not isinstance(start, int) or isinstance(start, bool) or start <= last:
            raise ConfigError(f"{where}.start_step", f"{start!r}: must be an integer after "
                              + (f"the previous stage's ({last})" if n else "0") + ": stages in order of their steps")
        last = start
        if not isinstance(weights, dict):
            raise ConfigError(f"{where}.weights", "must be a mapping of source name: weight")
        unknown = [k for k in weights if k not in sources]
        if unknown:
            raise ConfigError(f"{where}.weights", f"names {unknown[0]!r}, not a source of data_sources "
                              f"({', '.join(sources)})")
        missing = [k for k in sources if k not in weights]
        if missing:
            raise ConfigError(f"{where}.weights", f"gives no weight to {', '.join(missing)}: name every source "
                              "(0 leaves one out)")
        for k, w in weights.items():
            _check_weight(f"{where}.weights.{k}", w)
        if sum(weights.values()) <= 0:
            raise ConfigError(f"{where}.weights", "every weight is 0: give at least one source a positive weight")


def _train_files(c: dict[str, Any]) -> None:
    if c["dataset_type"] != "synthetic" and not c["train_files"] and not c["data_sources"]:
        raise ConfigError("train_files", f"dataset_type={c['dataset_type']} needs train_files (comma-separated globs)")
    if c["dataset_type"] == "prepared" and not c["data_sources"]:
        for key in ("train_files", "eval_files"):
            if "," in c[key] or any(ch in c[key] for ch in "*?["):
                raise ConfigError(key, f"{c[key]!r}: dataset_type=prepared reads one directory, the prepared_dir "
                                  "that python -m maxtrain.prepare wrote")


def _late_stages(c) -> list[str]:
    return [f"data_stages[{n}]: start_step {stage['start_step']} is not before the last step (steps={c['steps']}): "
            "its weights are not used in this run" for n, stage in enumerate(c["data_stages"])
            if stage["start_step"] >= c["steps"]]


def data(name: str, **kw) -> Key:
    return Key(name, "data", **kw)


declare(
    # blockwise attention unrolls a block per 256 positions when traced
    data("max_target_length", at_least=1, limit=(2**21, "positions")),
    data("dataset_type", choices=DATASET_TYPES),
    data("train_files", path="inputs", check=_train_files),
    data("eval_split_fraction", at_least=0, below=1),
    data("data_sources", check=_sources_and_stages),
    data("data_stages", no_effect=_late_stages),
    data("data_source_exhausted", choices=("repeat", "drop")),
    data("text_field"),
    data("tokenizer_type", choices=("byte", "sentencepiece", "huggingface")),
    data("tokenizer_path", path="input"),
    data("hf_bos_token"),
    data("hf_eos_token"),
    data("add_bos"),
    data("add_eos"),
    data("packing"),
    data("num_epochs", at_least=1, auto=-1, why="repeat"),
    data("data_shuffle_seed", at_least=0),
    data("grain_shuffle_buffer_size", at_least=1),
)
