"""Each key declared once: base.yml's line (default and meaning) and one `Key` (group, values, checks, platform
default); the family named by model_family; run names kept across the change of where keys are declared."""

import re
from pathlib import Path

import pytest
import yaml

from maxtrain import train
from maxtrain.config import load as config, schema
from maxtrain.config.keys import ConfigError
from maxtrain.models import registry
from maxtrain.runtime import base_yml

from helpers import one_line

BASE = str(config.BASE_YML)
CONFIG_DIR = Path(config.__file__).parent
PRESETS = sorted(p.stem for p in (config.CONFIG_DIR / "models").glob("*.yml"))


def test_every_key_of_base_yml_has_one_declaration_and_no_other_is_declared():
    declared = schema.declared()
    assert sorted(declared) == sorted(base_yml.names())
    assert all(key.group in schema.GROUPS for key in declared.values())
    with pytest.raises(ValueError, match="declared twice"):
        schema.declare(schema.Key("steps", "run"))


def test_a_family_declares_its_own_keys_in_its_module():
    own = {name for name, key in schema.declared().items() if key.family == "llama4"}
    assert own == {"nope_layer_interval", "chunk_attn_window_size", "use_qk_l2_norm", "temperature_tuning",
                   "temperature_tuning_scale", "temperature_tuning_floor_scale"}
    source = (Path(registry.__file__).parent / "llama4.py").read_text()
    assert all(f'_own("{name}"' in source for name in own)


@pytest.mark.parametrize("key", ["num_pipeline_microbatches", "mlp_chunk_size", "checkpoint_period",
                                 "context_parallel_strategy", "loss_chunk_size", "interleave_moe_layer_step",
                                 "remat_policy"])
def test_a_key_is_named_in_at_most_one_config_module(key):
    naming = [str(p.relative_to(CONFIG_DIR)) for p in sorted(CONFIG_DIR.rglob("*.py"))
              if re.search(rf"\b{key}\b", p.read_text())]
    assert len(naming) <= 1, naming


def test_resolved_values_keep_their_keys_names():
    import jax
    c = train.load_config([BASE, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"], jax.devices()[:8])
    assert (c.num_pipeline_microbatches, c.num_layers_per_pipeline_stage, c.num_pipeline_repeats) == (2, 2, 1)
    assert c.plan.schedule.microbatches == c.num_pipeline_microbatches
    assert not {"pipeline_microbatches", "pipeline_repeats"} & set(c)
    left_auto = [k for k, auto in schema.declared().items() if auto.choose and c[k] == auto.auto]
    assert left_auto == []


def test_help_keys_shows_each_keys_type(capsys):
    assert train.main(["--help-keys", "num_pipeline_microbatches"]) == 0
    assert capsys.readouterr().out.startswith("num_pipeline_microbatches: int = -1  # micro-batches per step")
    assert train.main(["--help-keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    types = {line.split(":")[0]: line.split(": ", 1)[1].split(" = ")[0] for line in lines}
    assert types == {k: type(v).__name__ for k, v in config.defaults().items()}


def test_range_and_values_come_from_the_declaration():
    for override, text in (("checkpoint_period=0", "checkpoint_period: must be a positive integer, got 0"),
                           ("remat_policy=most", "remat_policy: 'most' is not one of none, full,"),
                           ("context_parallel_strategy=ulysses",
                            "context_parallel_strategy: 'ulysses' is not one of all_gather, ring"),
                           ("mlp_chunk_size=-2", "mlp_chunk_size: must be >= 0 or -1 (auto), got -2"),
                           ("adam_b2=1.0", "adam_b2: must be in [0, 1), got 1.0")):
        with pytest.raises(ConfigError) as e:
            config.load([BASE, override])
        assert str(e.value).startswith(text), str(e.value)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_names_its_family_and_print_config_shows_it(preset, capsys):
    named = config.load([BASE, f"model_name={preset}"]).model_family
    assert yaml.safe_load((config.CONFIG_DIR / "models" / f"{preset}.yml").read_text())["model_family"] == named
    assert named == registry.family_of_keys(config.load([BASE, f"model_name={preset}"])).name
    assert train.main([BASE, f"model_name={preset}", "--print-config"]) == 0
    assert f"model_family: {named}\n" in capsys.readouterr().out


def test_a_family_is_named_not_guessed(capsys):
    with pytest.raises(ConfigError) as e:
        config.load([BASE, "model_family=llama3"])
    known = ", ".join(s.name for s in registry.families())
    assert str(e.value) == f"model_family: 'llama3' is not one of {known}"
    with pytest.raises(ConfigError) as e:  # a mixture of experts named llama: the keys are Mixtral's
        config.load([BASE, "num_experts=4", "num_experts_per_tok=2"])
    assert str(e.value) == ("model_family: llama, but these model keys describe a mixtral model: set "
                            "model_family=mixtral, or change the keys")
    with pytest.raises(ConfigError) as e:  # another family's own key
        config.load([BASE, "model_family=llama", "chunk_attn_window_size=64"])
    assert str(e.value).startswith("chunk_attn_window_size: only llama4 models read it")
    assert train.main([BASE, "model_family=qwen3"]) == 2
    assert one_line(capsys.readouterr().err).startswith("config error: model_family: qwen3, but these model keys "
                                                        "describe a llama model")


# Names derived before the keys' declarations moved (HEAD 1d89ff8, 8 CPU devices): a rerun of the same command
# must find its run.
RUN_NAMES = {
    (BASE,): "base-160baf26",
    (BASE, "model_name=llama3-8b"): "base-bc465135",
    (BASE, "model_name=mixtral-tiny", "ici_expert_parallelism=4"): "base-9ed656c1",
    (BASE, "mlp_chunk_size=32", "loss_chunk_size=64", "remat_policy=minimal"): "base-160baf26",  # layout: not hashed
}


@pytest.mark.parametrize("argv", list(RUN_NAMES))
def test_derived_run_names_are_what_they_were(argv):
    import jax
    assert train.load_config(list(argv), jax.devices()[:8]).run_name == RUN_NAMES[argv]
