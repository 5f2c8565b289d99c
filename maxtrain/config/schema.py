"""Every key's declaration gathered, and the checks of a config that read them.

base.yml holds each key's default (its type is the default's) and the meaning users read; a key's `Key`
(maxtrain.runtime.declaration) holds the rest: the group it belongs to, the values or the range it takes, its
checks, its platform default. A key of group G is declared in maxtrain/config/groups/G.py (model and
model_training: model.py), a model family's own keys in the family's module (maxtrain/models/llama4.py);
tests/test_config_keys.py checks that every key of base.yml has exactly one declaration and every declaration a
line in base.yml.

Adding a key: its line in base.yml and its `Key(...)`; the code that uses it reads `c.<name>`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from maxtrain.runtime import base_yml
from maxtrain.runtime.declaration import DECLARED, GROUPS, Key, declare

__all__ = ["GROUPS", "Key", "declare", "declared", "in_group", "model_keys", "preset_keys", "path_keys", "validate",
           "no_effect_warnings"]


def declared() -> dict[str, Key]:
    """Every declared key: the general ones and every model family's."""
    if not _loaded:
        _load()
    return DECLARED


_loaded = False


def _load() -> None:
    global _loaded
    _loaded = True  # first: a module that asks while it loads does not recurse
    import maxtrain.config.groups as package
    from maxtrain.models import registry
    for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
        importlib.import_module(f"{package.__name__}.{module}")
    registry.families()  # imports every family module


def in_group(*groups: str) -> tuple[str, ...]:
    """The names of the keys of `groups`, in base.yml's order."""
    keys = declared()
    return tuple(k for k in base_yml.names() if keys[k].group in groups)


def model_keys() -> tuple[str, ...]:
    """The model's shape: what a checkpoint's model description holds."""
    return in_group("model")


def preset_keys() -> tuple[str, ...]:
    """What a model preset (configs/models/*.yml) may set."""
    return in_group("model", "model_training")


def path_keys(*kinds: str) -> tuple[str, ...]:
    """The keys that name files or directories (of `kinds`: "input", "inputs", "output"; all where none)."""
    kinds = kinds or ("input", "inputs", "output")
    return tuple(k for k in base_yml.names() if declared()[k].path in kinds)


def validate(c: dict[str, Any]) -> None:
    """Every key's values or range, then every key's checks (those that need the devices: config.resolve), each a
    ConfigError naming the key, before anything compiles."""
    keys = [declared()[name] for name in base_yml.names()]
    for key in keys:
        key.validate(c)
    for key in keys:
        if key.check:
            key.check(c)


def no_effect_warnings(c: Mapping[str, Any]) -> list[str]:
    """Settings that cannot take effect in this run, each as `<key>: ...`: not errors (a shared config may
    carry them), but a user who set them expects something that will not happen."""
    warnings = []
    for name in base_yml.names():
        said = declared()[name].no_effect(c) if declared()[name].no_effect else None
        warnings += [said] if isinstance(said, str) else said or []
    return warnings
