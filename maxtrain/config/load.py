"""Layered YAML config: base.yml defaults <- base_config chain <- model preset <- key=value overrides.

configs/base.yml holds every key's default, and each key's type is the type of its default; the rest of a key's
declaration (its values, range and checks) is its `Key` (maxtrain.config.schema). Everything a user can get
wrong is checked at load, before anything compiles, and reported as a ConfigError that names the key. Values that
follow from the config and the devices (parameter count; mesh shape, global batch) are derived once, in `_derive_static` and `maxtrain.config.resolve`.
"""

from __future__ import annotations

import difflib
import glob
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from maxtrain.config import run_name as run_name_lib, yaml_file
from maxtrain.config.keys import DERIVED_AT_LOAD, FLOAT32_MAX, INT_MAX, RENAMED, ConfigError
from maxtrain.config.schema import declared, path_keys, preset_keys, validate
from maxtrain.models import registry
from maxtrain.models.parts import moe_width
from maxtrain.runtime.base_yml import BASE_YML

CONFIG_DIR = BASE_YML.parent  # the shipped configs: base.yml, the presets in models/, examples


class Config(Mapping):
    """Frozen, attribute-access view of the merged config."""

    def __init__(self, values: Mapping[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("Config is frozen; use config.replace(...)")

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def replace(self, **changes) -> "Config":
        return Config({**self._values, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def to_yaml(self) -> str:
        """The declared keys only (no derived values), so the file loads again as a config."""
        declared = _read_yaml(BASE_YML)
        return yaml_file.safe_dump({k: v for k, v in self._values.items() if k in declared}, sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Reading and merging


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError("config", f"{path} is not a YAML text file") from None
    try:
        data = yaml_file.safe_load(text)
    except yaml_file.DuplicateKey as e:
        raise ConfigError(str(e.key), f"set twice in {path} (lines {e.lines[0]} and {e.lines[1]})") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError("config", f"{path}{where} is not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of key: value")
    return data


def config_chain(path: Path) -> list[tuple[Path, dict[str, Any]]]:
    """[(file, its values without base_config)] from `path` up its base_config chain to the root, base.yml
    left out (its values are the defaults, not a file's choice). A base_config is read beside the file that
    names it, or else is one the package ships (`base_config: base.yml` in a user's own folder)."""
    chain: list[tuple[Path, dict[str, Any]]] = []
    path = path.resolve()
    while path != BASE_YML.resolve():
        if any(path == seen for seen, _ in chain):
            raise ConfigError("base_config", f"cycle through {path}")
        data = _beside(_read_yaml(path), path.parent)
        parent = data.pop("base_config", None)
        chain.append((path, data))
        if parent is None:
            break
        if not isinstance(parent, str):
            raise ConfigError("base_config", f"in {path} must be a path string")
        beside = path.parent / parent
        path = (beside if beside.exists() else config_path(parent)).resolve()
    return chain


def _read_chain(path: Path) -> dict[str, Any]:
    """Values of `path` over those of its base_config chain (root first); a key left unset stays so (vocab_size
    then follows the tokenizer)."""
    values: dict[str, Any] = {}
    for _, data in reversed(config_chain(path)):
        values.update(data)
    return values


def _beside(values: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Keys that name files a run reads: a relative one that matches nothing from the working directory is read
    beside the config file that set it (on the command line: beside the config file named), so a config and its
    data travel together (the shipped configs/shakespeare.yml and its data/tinyshakespeare.txt, from any folder)."""
    inputs = set(path_keys("input", "inputs"))

    def one(pattern: str) -> str:
        p = pattern.strip()
        if not p or "://" in p or Path(p).is_absolute() or glob.glob(p) or not glob.glob(str(folder / p)):
            return pattern
        return str(folder / p)

    def paths(value):
        return ",".join(one(p) for p in value.split(",")) if isinstance(value, str) else value
    out = {k: paths(v) if k in inputs else v for k, v in values.items()}
    for key in ("data_sources", "eval_sources"):  # each source's files
        if isinstance(out.get(key), dict):
            out[key] = {name: {**spec, "files": paths(spec["files"])} if isinstance(spec, dict) and "files" in spec
                        else spec for name, spec in out[key].items()}
    return out


def _parse_override(arg: str, defaults: Mapping[str, Any]) -> tuple[str, Any]:
    key, sep, text = arg.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(arg, "expected key=value")
    _check_known(key, defaults)
    default = defaults[key]
    if isinstance(default, bool):
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return key, True
        if low in ("false", "0", "no"):
            return key, False
        raise ConfigError(key, f"expected true or false, got {text!r}")
    if isinstance(default, int):
        try:
            return key, int(text)
        except ValueError:
            raise ConfigError(key, f"expected an integer, got {text!r}") from None
    if isinstance(default, float):
        try:
            return key, float(text)
        except ValueError:
            raise ConfigError(key, f"expected a number, got {text!r}") from None
    if isinstance(default, str):
        return key, text
    kind = "mapping" if isinstance(default, dict) else "list"
    try:  # lists and mappings: YAML flow syntax, e.g. logical_axis_rules='[["batch","data"]]'
        return key, yaml_file.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(key, f"expected a YAML {kind}, got {text!r}") from None


def _check_known(key: str, defaults: Mapping[str, Any]) -> None:
    if key in defaults:
        return
    if key in RENAMED:
        raise ConfigError(key, RENAMED[key])
    close = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ConfigError(key, f"unknown key{hint}")


def _check_type(key: str, value: Any, default: Any) -> Any:
    kind = type(default)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and abs(value) > INT_MAX:
            raise ConfigError(key, f"{value} is out of range (at most {INT_MAX})")
    elif kind is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) and 1.0e3 (no sign) as strings
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            value = float(value) if ok else value
        except OverflowError:  # an int beyond any float
            raise ConfigError(key, f"must be a finite number, got {value}") from None
        if ok and not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value}")
        if ok and abs(value) > FLOAT32_MAX and not declared()[key].limit:  # those name their own range
            raise ConfigError(key, f"{value!r} is out of range (at most {FLOAT32_MAX:.4g} in magnitude: float32)")
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(key, f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def config_path(arg: str) -> Path:
    """The config file as given or, where no such file exists, the one the package ships: `base.yml` and
    `configs/base.yml` work from any directory once maxtrain is installed."""
    given = Path(arg)
    for shipped in (CONFIG_DIR / arg, CONFIG_DIR / arg.removeprefix("configs/")):
        if not given.exists() and shipped.is_file():
            return shipped
    return given


def defaults() -> dict[str, Any]:
    """Every key's default, from base.yml."""
    return _read_yaml(BASE_YML)


def load(argv: Sequence[str]) -> Config:
    """argv = [config.yml, key=value, ...] -> validated Config (devices not yet known)."""
    if not argv or "=" in argv[0]:
        raise ConfigError("config", "first argument must be a YAML config file")
    defaults = _read_yaml(BASE_YML)
    files = _read_chain(config_path(argv[0]))
    for key in files:
        _check_known(key, defaults)
    overrides = _beside(dict(_parse_override(arg, defaults) for arg in argv[1:]),
                        config_path(argv[0]).resolve().parent)

    model_name = overrides.get("model_name", files.get("model_name", defaults["model_name"]))
    preset = {} if model_name == "default" else _read_preset(model_name)

    values = {**defaults, **files, **preset, **overrides}
    for key, value in values.items():
        values[key] = _check_type(key, value, defaults[key])
    replaced = [f"{k}={preset[k]} over the file's {files[k]}" for k in preset
                if k in files and files[k] != preset[k] and k not in overrides]
    if replaced:  # said once: a preset's model keys win over the config file's (and key=value over both)
        print(f"note: model_name={model_name} sets {', '.join(replaced)} (a preset's keys win over the config "
              "file's; key=value wins over both)", flush=True)
    if "vocab_size" not in {**files, **preset, **overrides} and (values["dataset_type"] != "synthetic" or
                                                                 values["data_sources"]):
        values["vocab_size"] = _tokenizer_vocab(values)  # unset: the tokenizer's (the model pads it)
    values["run_name_derived"] = not values["run_name"]  # none given: named after what defines the run
    values["run_name"] = values["run_name"] or run_name_lib.derive(argv[0], values, defaults)
    validate(values)
    return Config(_derive_static(values))


def _tokenizer_vocab(values: dict[str, Any]) -> int:
    from maxtrain.data.tokenizer import make_tokenizer  # (the tokenizer file's own count)
    return make_tokenizer(Config(values), check_vocab=False).vocab_size


def _read_preset(name: str) -> dict[str, Any]:
    known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yml"))
    if name not in known:  # a name, never a path: `../base` would read base.yml as a preset
        raise ConfigError("model_name", f"no preset {name!r}; known: default, {', '.join(known)}")
    path = CONFIG_DIR / "models" / f"{name}.yml"
    preset = _read_yaml(path)
    allowed = preset_keys()
    for key in preset:
        if key not in allowed:
            raise ConfigError(key, f"model preset {path.name} may only set model keys")
    return preset


# ---------------------------------------------------------------------------------------------
# Derived values


def _derive_static(c: dict[str, Any]) -> dict[str, Any]:
    if c["learning_rate_schedule_steps"] == -1:
        c["learning_rate_schedule_steps"] = c["steps"]
    spec = registry.spec_for(c)  # the model's family counts its parameters
    derived = {"moe_mlp_dim": moe_width(c), "num_params": spec.count_params(c, False),
               "num_active_params": spec.count_params(c, True)}
    assert {"run_name_derived", *derived} == set(DERIVED_AT_LOAD)
    return {**c, **derived}
