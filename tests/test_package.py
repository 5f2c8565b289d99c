"""The package as a user installs it: a built wheel carries its configs and presets, and trains from any
directory with `base.yml` (or `configs/base.yml`) naming the shipped config."""

import subprocess
import sys

import pytest

from conftest import TESTS


@pytest.mark.slow
def test_the_wheel_ships_its_configs_and_trains_from_anywhere(tmp_path):
    pytest.importorskip("setuptools")  # builds the wheel without fetching a build environment
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(TESTS.parent)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("maxtrain-*.whl"))
    # A fresh venv that sees this environment's dependencies (jax, flax, ...) but installs maxtrain
    # from the wheel alone, not from this checkout.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*args):
        return subprocess.run([python, *args], capture_output=True, text=True, cwd=elsewhere, timeout=300)

    where = run("-c", "import maxtrain; print(maxtrain.__file__)")
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout + where.stderr
    for config in ("base.yml", "configs/base.yml"):
        proc = run("-m", "maxtrain.train", config, "model_name=tiny", "steps=2", f"run_name=w{len(config)}")
        assert proc.returncode == 0 and "done: 2 steps" in proc.stdout, proc.stderr[-2000:]
    assert (elsewhere / "outputs" / "w8" / "metrics.jsonl").is_file()
    proc = run("-c", "from maxtrain import config; print(config.load(['base.yml', 'model_name=qwen2.5-72b']).num_params)")
    assert proc.stdout.strip() == "72706203648", proc.stderr[-2000:]  # the presets ship too
