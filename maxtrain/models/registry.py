"""Model families: one ModelSpec each, registered by its own module in this package.

A family answers every question whose answer follows from the model's shape: its args and module, its
layer stacks, its parameter count and FLOPs per token, which parameters train and which decay, the
module paths quantization targets, and (where HF has the family) its HF tensor names and config.json.
A config names its family (`model_family`; each preset names its own). Each family's `matches` says which model
keys are its own, the highest `priority` winning where several match (a family that narrows another, as Qwen3
narrows the dense decoder with q/k norms, sets a higher one): the config check holds the named family to its keys,
and a model description written before model_family existed is read by it (family_of_keys).

New family: one module in maxtrain/models/ that calls `register(ModelSpec(...))` at import, plus its
presets in configs/models/ and its tests. The registry imports every module of the package the first
time it is asked, so nothing else names the family.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import jax

from maxtrain.models.stacks import Stack

Keys = Mapping[str, Any]  # maxtrain model keys (a Config, or a checkpoint's model description)


@dataclass(frozen=True)
class HFType:
    """One HF model_type of a family."""
    architecture: str       # config.json's architectures entry (transformers' model class)
    config_class: str       # transformers' config class: whose defaults `defaults` copies (tests check)
    defaults: dict[str, Any]  # what transformers assumes for each key a config.json leaves out
    fresh: dict[str, Any] = field(default_factory=dict)  # config.json keys of a model trained from scratch


@dataclass(frozen=True)
class HFMapping:
    """A family's side of HF import and export (maxtrain.models.hf has the shared decoder layout)."""
    types: dict[str, HFType]
    # model keys that config.json `hf` of model_type `kind` implies beyond the shared ones (or ConvertError)
    keys: Callable[[dict, str], dict[str, Any]]
    # config.json keys for model keys `m` exported as `kind`, beyond the shared ones; `hf` as written so far
    config: Callable[[Keys, str, dict], dict[str, Any]]
    # an MoE layer's MLP tensors: (m, fused_experts) -> [hf_layout.Tensor] (a dense layer's: GatedMLP.hf_tensors)
    mlp_tensors: Callable[[Keys, bool], list] | None = None
    dense_mlp_name: str = "mlp"  # a dense layer's MLP in HF's names (<this>.gate_proj, ...)
    # a layer's attention tensors: (m, the config.json imported from or None) -> [Tensor]; default GQA.hf_tensors
    attention_tensors: Callable[[Keys, dict | None], list] | None = None
    # a multi-token prediction depth's own tensors, beside its layer's (m -> [Tensor]), where the HF layout has
    # depths (as layers after the model's), and the config.json key that counts them
    mtp_tensors: Callable[[Keys], list] | None = None
    mtp_key: str = ""
    # HF tensors of each depth that copy a whole-model one ({name in the depth: the whole-model tensor's}):
    # import skips them, export writes the copies
    mtp_copies: dict[str, str] = field(default_factory=dict)
    # the window of any layer that slides, as transformers reads config.json `hf`; None: none slides
    sliding_window: Callable[[dict], int | None] = lambda hf: hf.get("sliding_window")
    windowed: bool = False  # maxtrain expresses that window (sliding_window_size): else import refuses it
    # what config.json must say beyond the shared checks (a ConvertError if not); default: hf.plain_checks
    checks: Callable[[dict], None] | None = None
    # the rope parameters of config.json's (global) layers; default: hf.flat_rope
    rope: Callable[[dict], dict] | None = None
    # variant keys (hf.VARIANT_KEYS) this family's HF types carry; export refuses any other set
    expresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    matches: Callable[[Keys], bool]
    args: Callable[[Any], Any]     # config -> the module's args (maxtrain.models.args.ModelArgs)
    build: Callable[[Any], Any]    # config -> the flax module
    stacks: Callable[[Keys], list[Stack]]
    count_params: Callable[[Keys, bool], int]  # (m, active): active = the parameters one token uses
    # (m, sequence length, causal, active) -> matmul FLOPs of one token's forward pass
    flops_per_token: Callable[[Keys, int, bool, bool], float]
    quantization_paths: Callable[[Any], dict[str, str]]  # config -> {target: module-path regex}
    # HF model_type that export writes for model keys m, or a ConvertError saying why none can be
    hf_kind: Callable[[Keys], str]
    not_decayed: tuple[str, ...] = ()  # parameter names weight decay leaves alone
    not_trained: tuple[str, ...] = ()  # parameter names the optimizer never moves (their own rule does)
    hf: HFMapping | None = None
    priority: int = 0
    matches_hint: str = ""  # what makes model keys this family's, where `matches` is not plain from its name
    summary: Callable[[Keys], str] | None = None  # the run's first line: what its attention does besides the mask

    def decayed(self, params) -> Any:
        """True for each parameter that weight decay applies to."""
        return _by_name(params, lambda name: name not in self.not_decayed)

    def trained(self, params) -> Any:
        """True for each parameter that the optimizer updates."""
        return _by_name(params, lambda name: name not in self.not_trained)


def _by_name(params, keep: Callable[[str | None], bool]):
    return jax.tree_util.tree_map_with_path(lambda path, _: keep(getattr(path[-1], "key", None)), params)


_FAMILIES: dict[str, ModelSpec] = {}
_loaded = False


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in _FAMILIES:
        raise ValueError(f"model family {spec.name!r} registered twice")
    taken = {t for other in _FAMILIES.values() if other.hf for t in other.hf.types}
    if spec.hf and taken & set(spec.hf.types):
        raise ValueError(f"model family {spec.name!r}: HF model_type {sorted(taken & set(spec.hf.types))[0]!r} "
                         "is another family's")
    _FAMILIES[spec.name] = spec
    return spec


def _load() -> None:
    """Imports every module of maxtrain.models once: each family module registers itself."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # first, so a family module that asks the registry while it loads does not recurse
    import maxtrain.models as package
    try:
        for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
            importlib.import_module(f"{package.__name__}.{module}")
    except BaseException:
        _loaded = False  # a failed import leaves no half-filled registry behind: the next lookup tries again
        raise


def families() -> list[ModelSpec]:
    """Every registered family, in the order of their modules' names."""
    _load()
    return list(_FAMILIES.values())


def family(name: str) -> ModelSpec:
    _load()
    return _FAMILIES[name]


def spec_for(m: Keys) -> ModelSpec:
    """The family that config (or model keys) `m` names."""
    return family(m["model_family"])


def family_of_keys(m: Keys) -> ModelSpec:
    """The family whose model keys `m` are: the config check's (a config names its family) and, for a model
    description written before model_family existed, the one it is read as."""
    found = [s for s in families() if s.matches(m)]
    if not found:  # every family's predicate together covers every valid config
        raise ValueError(f"no model family matches num_experts={m['num_experts']}")
    return max(found, key=lambda s: s.priority)  # the first of the highest priority


def by_hf_type(model_type: Any) -> ModelSpec | None:
    """The family that imports and exports HF model_type `model_type`, if any."""
    if not isinstance(model_type, str):
        return None
    return next((s for s in families() if s.hf and model_type in s.hf.types), None)


def hf_types() -> dict[str, HFType]:
    """Every HF model_type a family converts, in registration order."""
    return {name: t for s in families() if s.hf for name, t in s.hf.types.items()}
