"""base.yml's values, for the layers below the config that must know what a key left at its default means (a
model family's plain settings, which its HF classes take as given). base.yml stays the one place a default is
written; the config layer reads it with its own checks (maxtrain.config.load)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

BASE_YML = Path(__file__).resolve().parent.parent / "configs" / "base.yml"


@functools.cache
def _values() -> dict[str, Any]:
    return yaml.load(BASE_YML.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def default(key: str) -> Any:
    """base.yml's value of `key`."""
    return _values()[key]


def defaults_of(keys: Iterable[str]) -> dict[str, Any]:
    """base.yml's values of `keys`."""
    return {k: _values()[k] for k in keys}


def changed(m: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """Those of `keys` that model keys `m` set to something other than base.yml's value."""
    return [k for k in keys if m[k] != _values()[k]]


def names() -> tuple[str, ...]:
    """Every key of base.yml, in its order."""
    return tuple(_values())
