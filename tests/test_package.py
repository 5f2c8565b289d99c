"""The package as a user installs it: a built wheel carries its configs and presets, and trains from any
directory with `base.yml` (or `configs/base.yml`) naming the shipped config."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import TESTS

# A checkout on PYTHONPATH (its maxtrain, its maxtrain.egg-info) would stand in for the wheel.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def can_build_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def venv_with_wheel(path, wheel) -> str:
    """A new venv with the wheel alone installed; its own site-packages come first, then the paths of the
    interpreter running the tests (jax, flax, ...). `--system-site-packages` would add the base
    interpreter's instead, which lack them when the tests run inside a venv. Those paths go in as plain
    .pth lines, after the install (pip would take this environment's maxtrain as already installed); the
    environment's own .pth hooks (an editable maxtrain's finder) stay out."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True)
    python = str(path / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, env=ENV)
    theirs = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True, env=ENV).stdout.strip()
    # What this interpreter imports from (site-packages and what their .pth files add), less the checkout
    # itself (`python -m pytest` puts it first) and PYTHONPATH; the new venv's stdlib is the same one.
    skip = {os.path.realpath(x) for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x}
    skip |= {os.path.realpath(theirs), os.path.realpath(TESTS.parent)}
    paths = map(os.path.realpath, filter(None, sys.path))
    lines = dict.fromkeys(x for x in paths if os.path.isdir(x) and x not in skip)
    with open(os.path.join(theirs, "this_environment.pth"), "w") as f:
        f.write("".join(f"{p}\n" for p in lines))
    return python


@pytest.mark.slow
def test_the_wheel_ships_its_configs_and_trains_from_anywhere(tmp_path):
    # Built with this environment's setuptools where it can build wheels (>= 70.1, or the wheel package:
    # a fresh venv's bundled 65.5 cannot), else in the isolated build environment pip makes by default.
    isolation = ["--no-build-isolation"] if can_build_wheels() else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *isolation,
                    "-w", str(tmp_path / "dist"), str(TESTS.parent)], check=True, capture_output=True, env=ENV)
    wheel = next((tmp_path / "dist").glob("maxtrain-*.whl"))
    python = venv_with_wheel(tmp_path / "venv", wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*args):
        return subprocess.run([python, *args], capture_output=True, text=True, cwd=elsewhere, timeout=300, env=ENV)

    where = run("-c", "import maxtrain; print(maxtrain.__file__)")
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout + where.stderr
    for config in ("base.yml", "configs/base.yml"):
        proc = run("-m", "maxtrain.train", config, "model_name=tiny", "steps=2", f"run_name=w{len(config)}")
        assert proc.returncode == 0 and "done: 2 steps" in proc.stdout, proc.stderr[-2000:]
    assert (elsewhere / "outputs" / "w8" / "metrics.jsonl").is_file()
    proc = run("-c", "from maxtrain.config.load import load; print(load(['base.yml', 'model_name=qwen2.5-72b']).num_params)")
    assert proc.stdout.strip() == "72706203648", proc.stderr[-2000:]  # the presets ship too


def test_requires_python_is_what_the_pinned_packages_need():
    """pyproject's lower bound is the highest lower bound among the pinned dependencies (flax, tokamax, ...
    need 3.12): a lower one lets pip start an install on a Python that cannot finish it."""
    import importlib.metadata
    import re
    import tomllib

    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]

    def lower_bound(spec: str) -> tuple[int, ...]:
        bounds = [tuple(int(x) for x in s.version.split(".")[:2]) for s in SpecifierSet(spec) if s.operator == ">="]
        assert bounds, spec
        return max(bounds)

    needed = {}
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group()
        needed[name] = lower_bound(importlib.metadata.metadata(name)["Requires-Python"] or ">=3")
    ours = lower_bound(project["requires-python"])
    assert ours == max(needed.values()), (ours, sorted(needed.items(), key=lambda x: x[1])[-3:])
    listed = sorted(tuple(int(x) for x in c.rsplit(" ", 1)[1].split(".")) for c in project["classifiers"]
                    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert listed[0] == ours  # the classifiers start where requires-python does
