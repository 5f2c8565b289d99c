"""What a run's start records about itself: the resolved config, the command line, the code's git revision,
the versions, the devices and the output directory. Printed at start, kept in the run directory (config.yml
of the first start, one line per start in starts.jsonl), and handed to the metrics backends."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import yaml

from maxtrain.config import load as config_lib, yaml_file
from maxtrain.runtime import storage

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # maxtrain/


def git_revision() -> str | None:
    """`<commit>` or `<commit>-dirty` (as git describe --dirty says it) when maxtrain runs from a git checkout of itself; None otherwise
    (an installed wheel, no git, a package inside some other repository)."""
    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(PACKAGE_DIR), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout
    try:
        top, commit = git("rev-parse", "--show-toplevel", "HEAD").split()
        if Path(top).resolve() / "maxtrain" != PACKAGE_DIR:
            return None
        modified = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return commit[:12] + ("-dirty" if modified else "")


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def command_line(argv: list[str]) -> str:
    """sys.argv as the user typed it: `python -m maxtrain.train ...` for the module's own path."""
    head = argv[0] if argv else ""
    if head.endswith(("maxtrain/train.py", "maxtrain/compile.py")):
        head = f"python -m maxtrain.{Path(head).stem}"
    return " ".join([head, *map(shlex.quote, argv[1:])]).strip()


def resolved(c: config_lib.Config) -> dict:
    """The declared keys as this run resolved them (platform defaults applied): config.yml's content."""
    return yaml_file.safe_load(c.to_yaml())


def record(c: config_lib.Config, run_dir: Path, start_step: int | None = None) -> dict:
    devices = jax.devices()
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "start_step": start_step,
        "command": command_line(sys.argv),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),  # where the config's relative paths (data, tokenizer) point from
        "git": git_revision(),
        "versions": {"maxtrain": version("maxtrain"), "jax": jax.__version__, "jaxlib": version("jaxlib"),
                     "python": platform.python_version()},
        "devices": {"kind": devices[0].device_kind, "platform": devices[0].platform, "count": c.num_devices,
                    "processes": jax.process_count()},
        "output_directory": str(storage.absolute(run_dir)),
        "config": resolved(c),
    }


def line(r: dict) -> str:
    """The record in one line, printed after the run's first."""
    d, v = r["devices"], r["versions"]
    git = f" | git {r['git']}" if r["git"] else ""
    return (f"run {r['output_directory']} | {d['count']} x {d['kind']} ({d['processes']} process"
            f"{'es' * (d['processes'] > 1)}) | maxtrain {v['maxtrain']}, jax {v['jax']}, python {v['python']}{git} | "
            f"{r['command']}")


def changed_keys(c: config_lib.Config) -> str:
    """The keys whose resolved value differs from base.yml's default, `key=value ...`."""
    defaults = config_lib.defaults()
    ours = resolved(c)
    return " ".join(f"{k}={_show(v)}" for k, v in ours.items() if defaults.get(k) != v)


def _show(v) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10**9).strip().removesuffix("\n...").strip() \
        if isinstance(v, (list, dict)) else str(v)


def differences(first: dict, c: config_lib.Config) -> str:
    """`steps 20 -> 40, ...`: how this start's config differs from config.yml's (the first start's)."""
    ours = resolved(c)
    return ", ".join(f"{k} {_show(first.get(k))} -> {_show(v)}" for k, v in ours.items() if first.get(k) != v)


def start_lines(c: config_lib.Config, run_dir: Path) -> str:
    """What the run prints after its first line: the record, and the config as it differs from base.yml."""
    return (f"{line(record(c, run_dir))}\nconfig: {changed_keys(c) or 'as base.yml'} (the other keys as in base.yml; "
            f"all in {run_dir / 'config.yml'})")
