"""YAML as yaml.safe_load reads it, except that a key given twice in one mapping is an error; and as
yaml.safe_dump writes it."""

from __future__ import annotations

import copy
import functools
from typing import Any

import yaml

# libyaml's parser where PyYAML was built with it (its wheels are): a start reads base.yml several times, and
# the pure-Python parser takes ~50 ms each time.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # writes the same text as yaml.safe_dump


class UniqueKeyLoader(_SafeLoader):
    """yaml.safe_load's loader, except that a mapping naming a key twice is an error: YAML keeps the last
    value, so a second `steps:` further down a file would silently win."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden by explicit keys
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise DuplicateKey(key, seen[key] + 1, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: construct_mapping refuses it
                continue
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, first: int, second: int):
        super().__init__(f"{key}: set twice (lines {first} and {second})")
        self.key, self.lines = key, (first, second)


def safe_load(text: str) -> Any:
    return copy.deepcopy(_parsed(text))  # a copy: the caller may change what it gets


def safe_dump(data: Any, **options) -> str:
    return yaml.dump(data, Dumper=_SafeDumper, **options)


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> Any:  # by content, so an edited file is read again
    return yaml.load(text, Loader=UniqueKeyLoader)
