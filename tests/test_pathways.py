"""Pathways (maxtrain/runtime/pathways.py): pathwaysutils.initialize() runs exactly when JAX_PLATFORMS names
the proxy backend, and then jax.distributed.initialize does not; checkpoints go without OCDBT and resume.
What only a Pathways cluster can show (the proxy backend's devices, Pathways' persistence handler writing to
GCS) is not tested here: there is no proxy server on this machine."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxtrain.config import load as config_lib
from maxtrain.launch import distributed
from maxtrain.runtime import pathways

from conftest import TESTS, TINY
from test_checkpoint import CKPT, params_equal_bitwise


@pytest.fixture
def recorded(monkeypatch):
    """The calls to pathwaysutils.initialize and jax.distributed.initialize, recorded instead of made."""
    import pathwaysutils
    calls = []
    monkeypatch.setattr(pathwaysutils, "initialize", lambda: calls.append("pathwaysutils"))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append("jax.distributed"))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    return calls


@pytest.mark.parametrize("platforms,coordinator,expected", [
    (None, False, []), ("cpu", False, []), (None, True, ["jax.distributed"]), ("cpu", True, ["jax.distributed"]),
    ("proxy", False, ["pathwaysutils"]), ("proxy", True, ["pathwaysutils"]), ("proxy,cpu", True, ["pathwaysutils"]),
    ("tpu", True, ["jax.distributed"]),
])
def test_pathwaysutils_starts_exactly_under_the_proxy_backend(recorded, monkeypatch, platforms, coordinator,
                                                              expected):
    monkeypatch.setenv("JAX_BACKEND_TARGET", "grpc://localhost:29000")
    if platforms is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
    c = config_lib.load([TINY, *(["coordinator_address=127.0.0.1:1234"] if coordinator else [])])
    distributed.initialize(c)
    assert recorded == expected
    assert distributed.wanted(c) == (expected == ["jax.distributed"])  # no supervising parent under Pathways


@pytest.mark.slow
def test_the_real_initialize_applies_pathways_settings():
    """pathwaysutils' own initialize, run by maxtrain's start-up with JAX_PLATFORMS=proxy, applies its changes
    (it turns JAX's compilation cache off: Pathways keeps its own); without it, nothing changes."""
    code = ("from maxtrain.runtime import pathways; import jax; jax.config.update('jax_enable_compilation_cache', "
            "True); print(pathways.initialize(), jax.config.jax_enable_compilation_cache)")
    out = {}
    for platforms in ("proxy", "cpu"):
        env = {**os.environ, "JAX_PLATFORMS": platforms, "PYTHONPATH": str(TESTS.parent),
               "JAX_BACKEND_TARGET": "grpc://localhost:29000"}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[platforms] = proc.stdout.split()
    assert out == {"proxy": ["True", "False"], "cpu": ["False", "True"]}


@pytest.mark.slow
def test_checkpoints_under_pathways_skip_ocdbt_and_resume_exactly(train_tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(pathways, "used", lambda: True)
    monkeypatch.setattr(pathways, "initialize", lambda: True)
    straight = train_tiny(*CKPT, "run_name=straight", "steps=6", n_devices=2)
    train_tiny(*CKPT, "run_name=resumed", "steps=3", "checkpoint_period=3", n_devices=2)
    state_dir = tmp_path / "resumed" / "checkpoints" / "3" / "state"
    assert not any("ocdbt" in p.name for p in state_dir.iterdir()), sorted(p.name for p in state_dir.iterdir())
    resumed = train_tiny(*CKPT, "run_name=resumed", "steps=6", "checkpoint_period=3", n_devices=2)
    assert resumed["losses"] == straight["losses"][3:]
    assert params_equal_bitwise(resumed["state"].params, straight["state"].params)
    assert np.isfinite(resumed["losses"]).all()


def test_without_pathways_checkpoints_use_ocdbt(train_tiny, tmp_path):
    """The check above can fail: the same save off Pathways writes OCDBT."""
    train_tiny(*CKPT, "run_name=plain", "steps=3", "checkpoint_period=3", n_devices=2)
    assert any("ocdbt" in p.name for p in (tmp_path / "plain" / "checkpoints" / "3" / "state").iterdir())


def test_proxy_without_pathwaysutils_is_one_line(tmp_path):
    fake = tmp_path / "site" / "pathwaysutils"  # shadows the installed package, as if it were not installed
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named \'pathwaysutils\'")\n')
    env = {**os.environ, "JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": "grpc://localhost:29000",
           "PYTHONPATH": os.pathsep.join([str(fake.parent), str(TESTS.parent)])}
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", TINY, f"base_output_directory={tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        'input error: JAX_PLATFORMS=proxy (Pathways) needs pathwaysutils: pip install -e ".[pathways]"']


@pytest.mark.slow
@pytest.mark.parametrize("target,code,line", [
    (None, 2, "input error: JAX_PLATFORMS=proxy (Pathways) needs the proxy server's address: "
              "JAX_BACKEND_TARGET=grpc://HOST:PORT"),
    ("grpc://127.0.0.1:1", 1,
     "run error: JAX_PLATFORMS=proxy: no Pathways proxy at JAX_BACKEND_TARGET=grpc://127.0.0.1:1 ("),
])
def test_no_proxy_server_is_one_line(tmp_path, target, code, line):
    env = {k: v for k, v in os.environ.items() if k != "JAX_BACKEND_TARGET"}
    env.update(JAX_PLATFORMS="proxy", PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="5", PYTHONPATH=str(TESTS.parent))
    if target:
        env["JAX_BACKEND_TARGET"] = target
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", TINY, f"base_output_directory={tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith(line), proc.stderr[-2000:]
