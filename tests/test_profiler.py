"""profiler=xplane: a jax.profiler trace of the chosen steps lands under the run directory."""

import pytest


def test_xplane_trace_of_the_chosen_steps(train_tiny, tmp_path):
    train_tiny("run_name=profiled", "steps=4", "profiler=xplane", "profiler_start_step=2", "profiler_steps=2")
    traces = list((tmp_path / "profiled" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].parent.parent.name == "profile"  # <run>/profile/plugins/profile/<time>/
    assert b"jit_step" in traces[0].read_bytes()  # the train step's device work is in it


def test_off_by_default(train_tiny, tmp_path):
    train_tiny("run_name=plain", "steps=2")
    assert not (tmp_path / "plain" / "profile").exists()


def test_bad_profiler_settings_are_config_errors(tiny_config):
    from maxtrain.config.keys import ConfigError
    with pytest.raises(ConfigError, match='profiler: .perfetto. is not one of "", xplane'):
        tiny_config("profiler=perfetto")
    with pytest.raises(ConfigError, match="profiler_steps: must be a positive integer"):
        tiny_config("profiler=xplane", "profiler_steps=0")
