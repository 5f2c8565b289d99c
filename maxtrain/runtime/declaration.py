"""A config key's declaration (`Key`): what base.yml cannot say about it. Here, below the config and the models,
so that a model family's module can declare its own keys (maxtrain/models/llama4.py); maxtrain.config.schema
gathers every declaration and checks a config against them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from maxtrain.runtime import storage
from maxtrain.runtime.errors import ConfigError

# What a key belongs to. The derived run name hashes the groups that define what is trained (DEFINING); the
# others say how long, how often, where, on which mesh or how fast, or belong to another entry point.
GROUPS = {
    "model": "the model's shape: a preset sets these, a checkpoint records them",
    "model_training": "settings a model carries (a preset, an HF config.json) that a fine-tune may change",
    "training": "the optimizer and its schedule, the loss, the step's numerics, where the weights start from",
    "data": "what the model is trained on, and in which order",
    "eval": "what is evaluated, and how often",
    "layout": "how the step lies on the devices: the mesh, sharding, remat, kernels, chunks",
    "run": "how long, how often, where: outputs, checkpoints, evaluation, metrics, processes",
    "generate": "python -m maxtrain.generate and the samples a run prints",
}
DEFINING = ("model", "model_training", "training", "data")


@dataclass(frozen=True)
class Key:
    name: str
    group: str
    choices: tuple | Callable[[], tuple] | None = None  # the values it takes (a callable: listed by their owner)
    at_least: float | None = None  # the range it takes, inclusive / exclusive bounds
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    why: str = ""  # what the range (or auto) means, shown with a value outside it
    # an upper bound far above any real model's value, where jax's int32 or a traced Python loop ends: (bound, why)
    limit: tuple[int, str] | None = None
    auto: Any = None  # a value outside the range meaning "chosen for you" (-1 = auto, fill, = steps, ...)
    # the platform default of `auto`: (the config as resolved so far, platform) -> its value
    choose: Callable[[dict, str], Any] | None = None
    check: Callable[[dict], None] | None = None  # what the rest of the config must satisfy (a ConfigError)
    # the same, once the mesh is known and the auto values chosen: (config, platform) (config.resolve)
    check_resolved: Callable[[dict, str], None] | None = None
    # why the value given cannot take effect in this run, if so (a line, or lines, each starting with the key)
    no_effect: Callable[[Mapping], str | list[str] | None] | None = None
    in_run_name: bool | None = None  # None: as its group says (DEFINING)
    # a file the run reads ("input": a relative one is also looked for beside the config file that sets it;
    # "inputs": comma-separated globs of such) or a place it writes ("output"); local or a URL (runtime.storage)
    path: str = ""
    family: str = ""  # a model family's own key: every other family's config leaves it at base.yml's value

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"key {self.name}: group {self.group!r} is not one of {', '.join(GROUPS)}")

    @property
    def hashed(self) -> bool:
        """Whether the derived run name hashes it (maxtrain.config.run_name)."""
        return self.group in DEFINING if self.in_run_name is None else self.in_run_name

    def allowed(self) -> tuple:
        return self.choices() if callable(self.choices) else (self.choices or ())

    def validate(self, c: dict[str, Any]) -> None:
        """The declared values or range (the key's own `check` runs once every key's range holds)."""
        value = c[self.name]
        if self.choices is not None and value not in self.allowed():
            shown = ", ".join(a or '""' for a in self.allowed())
            raise ConfigError(self.name, f"{value!r} is not one of {shown}")
        if value != self.auto or self.auto is None:
            self._in_range(value)
        for one in (value.split(",") if self.path == "inputs" else [value]) if self.path else ():
            storage.check(one.strip(), self.name)  # a URL whose scheme cannot be used: one line naming the key

    def _in_range(self, value) -> None:
        if self.limit and value > self.limit[0]:
            raise ConfigError(self.name, f"{value!r} is out of range: at most {self.limit[0]} ({self.limit[1]})")
        if ((self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above) and
                (self.at_most is None or value <= self.at_most) and (self.below is None or value < self.below)):
            return
        why = f" ({self.why})" if self.why else ""
        auto = f" or {self.auto}{why}" if self.auto is not None else why
        raise ConfigError(self.name, f"must be {self.range_text()}{auto}, got {value}")

    def range_text(self) -> str:
        """'a positive integer', '>= 0', 'in [0, 1)' and the like."""
        low = (f"[{self.at_least}" if self.at_least is not None else f"({self.above}" if self.above is not None
               else None)
        high = f"{self.at_most}]" if self.at_most is not None else f"{self.below})" if self.below is not None else None
        if low and high:
            return f"in {low}, {high}"
        if high:
            return f"{'<=' if self.at_most is not None else '<'} {high[:-1]}"
        if self.at_least == 1 and type(self.at_least) is int:
            return "a positive integer" if self.auto is None else "positive"
        return f"{'>=' if self.at_least is not None else '>'} {low[1:]}"


DECLARED: dict[str, Key] = {}  # every key declared so far (maxtrain.config.schema.declared: all of them)


def declare(*keys: Key) -> tuple[Key, ...]:
    """Registers `keys` (at import of the module that declares them)."""
    for key in keys:
        if key.name in DECLARED:
            raise ValueError(f"key {key.name} declared twice")
        DECLARED[key.name] = key
    return keys
