"""HF import reads a config.json as transformers does: a key the file leaves out takes the default of the
family's transformers config class. maxtrain.convert must not need transformers, so the defaults are a
table (each family's HFType.defaults in maxtrain.models); these tests hold it to transformers' own."""

import dataclasses

import pytest

from maxtrain.runtime.errors import ConvertError
from maxtrain.models import hf as hf_format, registry
from maxtrain.models.hf import model_keys_from_hf

HF_DEFAULTS = hf_format.hf_defaults()
SUPPORTED = hf_format.supported()

transformers = pytest.importorskip("transformers")

CLASSES = {kind: t.config_class for kind, t in registry.hf_types().items()}  # each family names its class


def test_every_supported_family_has_a_table():
    assert set(HF_DEFAULTS) == set(SUPPORTED) == set(CLASSES)
    assert {"llama", "mistral", "qwen2", "mixtral", "qwen3_moe"} <= set(SUPPORTED)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_the_defaults_table_is_transformers(kind):
    cls = getattr(transformers, CLASSES[kind])
    fields = {f.name: f.default for f in dataclasses.fields(cls)}  # what a key left out of config.json gets
    for key, ours in HF_DEFAULTS[kind].items():
        theirs = cls.default_theta if key == "rope_theta" else fields[key]
        if isinstance(theirs, dict):  # Gemma 3: a base per layer type; the table has the global layers'
            theirs = theirs["global"]
        assert ours == theirs and type(ours) is type(theirs), (kind, key, ours, theirs)


def outcome(hf: dict):
    try:
        return model_keys_from_hf(hf)
    except ConvertError as e:
        return str(e)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_a_bare_config_json_imports_as_transformers_reads_it(kind):
    # Every key maxtrain reads, derived ones included: the file that names only the family against the
    # config transformers builds from it.
    full = getattr(transformers, CLASSES[kind])().to_dict()
    assert outcome({"model_type": kind}) == outcome(full)
    if kind == "mistral":  # transformers' Mistral slides over 4096 tokens unless told otherwise
        assert outcome({"model_type": kind})["sliding_window_size"] == 4096
        assert outcome({"model_type": kind, "sliding_window": None}) == outcome({**full, "sliding_window": None})
        assert outcome({"model_type": kind, "sliding_window": None})["sliding_window_size"] == 0


def test_mixtral_without_rope_theta_or_eps_imports_with_mixtrals_defaults():
    hf = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
          "num_experts_per_tok": 2}
    keys = model_keys_from_hf(hf)
    assert keys["rope_theta"] == 1e6 and keys["normalization_layer_epsilon"] == 1e-5
    reference = transformers.MixtralConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    assert keys["rope_theta"] == reference.rope_parameters["rope_theta"]
    assert keys["normalization_layer_epsilon"] == reference.rms_norm_eps
