"""Submit a training job to Cloud TPU VM slices from this machine (scripts/launch_tpu_pod.sh runs this):

    start   check the config here, ship the code to every worker, make each worker's Python environment, and
            start training there detached (it runs on when this machine goes away), a log per worker
    logs    a worker's log (--follow)      status   each worker's state      stop   stop the job everywhere

What reaches the workers: the checkout's tracked files as they are in the working tree, and the config files
the command names with the base_config files they extend, where they live outside the checkout (under
.maxtrain_user/ on the worker, their base_config lines pointing at the copies). Data, tokenizers, outputs and
checkpoints live on gs:// (a worker's disk goes with its VM): local ones are refused here, in one line.
Each worker runs scripts/tpu_worker.sh. --dry-run prints each command instead of running it.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from maxtrain.config import load as config_lib
from maxtrain.config import schema
from maxtrain.config.keys import ConfigError
from maxtrain.runtime import errors, storage

REPO = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = "scripts/tpu_worker.sh"
USER_FILES = ".maxtrain_user"  # config files from outside the checkout, at their absolute paths below it
# The TPU VM software version for each accelerator family (Cloud TPU's docs; --runtime overrides it).
RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
            "v6e": "v2-alpha-tpuv6e"}
ACCELERATOR_NAMES = {"v5e": "v5litepod"}  # what gcloud calls v5e
MEGASCALE_PORT = "8080"  # multislice: the port slices join on (MaxText's multihost runner's)


def accelerator_and_runtime(accelerator: str, runtime: str | None) -> tuple[str, str]:
    family, _, size = accelerator.partition("-")
    family = ACCELERATOR_NAMES.get(family, family)
    if family not in RUNTIMES or not size.isdigit():
        raise ConfigError("--accelerator", f"{accelerator!r} is not one of v4-N, v5e-N (v5litepod-N), v5p-N, v6e-N")
    return f"{family}-{size}", runtime or RUNTIMES[family]


# ---------------------------------------------------------------------------------------------
# What the workers get


def _local(value: str) -> bool:
    return bool(value.strip()) and not storage.is_url(value)


def check_for_a_pod(argv: list[str]):
    """The config loads and validates here; its outputs and data are on gs:// (or, for data, shipped in the
    checkout). Returns the Config."""
    c = config_lib.load(argv)
    if _local(c.base_output_directory):
        raise ConfigError("base_output_directory", f"{c.base_output_directory!r} is on each worker's disk, which "
                          "goes with its VM: set a gs:// bucket for a pod (e.g. base_output_directory=gs://BUCKET/runs)")
    named = [(key, c[key]) for key in schema.path_keys() if key != "base_output_directory"]
    named += [(f"{key}.{name}.files", spec["files"]) for key in ("data_sources", "eval_sources")
              for name, spec in c[key].items()]
    for key, value in named:
        for path in (p.strip() for p in str(value).split(",")):
            if _local(path) and not Path(path).resolve().is_relative_to(REPO):
                raise ConfigError(key, f"{path} is on this machine, which the workers cannot read: put data and "
                                  "tokenizers on gs:// (gcloud storage cp -r ... gs://BUCKET/...)")
    return c


SKIPPED = ("outputs", "build", "dist", "__pycache__")  # not a git checkout: what is not shipped


def tracked_files() -> list[str]:
    """The checkout's tracked files (symlinks too); without git (a copy of the tree), every file but hidden
    ones, outputs/, build outputs and caches."""
    def keep(p: Path) -> bool:
        return p.is_file() or p.is_symlink()
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=REPO, capture_output=True, check=True)
        return sorted(p for p in listed.stdout.decode().split("\0") if p and keep(REPO / p))
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for folder, dirs, names in os.walk(REPO):  # symlinked folders (configs -> maxtrain/configs) are kept as links
        found += [Path(folder) / d for d in dirs if (Path(folder) / d).is_symlink()]
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED and not d.endswith(".egg-info")
                   and not (Path(folder) / d).is_symlink()]
        found += [Path(folder) / n for n in names if not n.startswith(".")]
    return sorted(str(p.relative_to(REPO)) for p in found if keep(p))


def _on_worker(path: Path) -> str:
    """Where a local file is on the worker, relative to the code directory."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else f"{USER_FILES}{path}"


def user_configs(config: str) -> tuple[str, dict[str, bytes]]:
    """(the config's path on the worker, {worker path: contents} of the chain's files outside the checkout,
    their base_config lines made relative so they point at the copies)."""
    chain = [path for path, _ in config_lib.config_chain(config_lib.config_path(config))] or \
        [config_lib.config_path(config).resolve()]  # base.yml itself
    extra = {}
    for i, path in enumerate(chain):
        if path.is_relative_to(REPO):
            continue
        text = path.read_text()
        if i + 1 < len(chain):  # the base_config line names the next file of the chain
            here = Path("/code") / _on_worker(path)
            there = os.path.relpath(Path("/code") / _on_worker(chain[i + 1]), here.parent)
            text = "\n".join(f"base_config: {there}  # on the TPU workers; here: {line.split(':', 1)[1].strip()}"
                             if line.startswith("base_config:") else line for line in text.splitlines()) + "\n"
        extra[_on_worker(path)] = text.encode()
    return _on_worker(chain[0]), extra


def archive(files: list[str], extra: dict[str, bytes], directory: Path) -> Path:
    """A tar.gz of the files (and extra contents), the same bytes for the same files: named by their hash."""
    buffer, digest = io.BytesIO(), hashlib.sha256()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted({*files, *extra}):
            if name not in extra and (REPO / name).is_symlink():  # configs -> maxtrain/configs
                info = tarfile.TarInfo(name)
                info.type, info.linkname, info.mtime = tarfile.SYMTYPE, os.readlink(REPO / name), 0
                tar.addfile(info)
                digest.update(name.encode() + b"\0->" + info.linkname.encode())
                continue
            data = extra[name] if name in extra else (REPO / name).read_bytes()
            mode = 0o644 if name in extra else (0o755 if os.access(REPO / name, os.X_OK) else 0o644)
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
            digest.update(name.encode() + b"\0" + data)
    out = directory / f"maxtrain-{digest.hexdigest()[:12]}.tar.gz"
    out.write_bytes(gzip.compress(buffer.getvalue(), mtime=0))
    return out


# ---------------------------------------------------------------------------------------------
# gcloud


class Pod:
    def __init__(self, a):
        self.a, self.dry = a, a.dry_run
        self.where = ["--zone", a.zone] + (["--project", a.project] if a.project else [])
        # several slices: queued resources' --node-prefix names them NAME-0, NAME-1, ...
        self.slices = [a.tpu] if a.num_slices == 1 else [f"{a.tpu}-{i}" for i in range(a.num_slices)]

    def run(self, argv: list[str], check: bool = True) -> int:
        if self.dry:
            print(shlex.join(argv), flush=True)
            return 0
        code = subprocess.run(argv).returncode
        if check and code:
            raise errors.RunError(f"{argv[0]} {' '.join(argv[1:4])} ... exited with code {code}")
        return code

    def ssh(self, tpu: str, command: str, worker: str = "all", check: bool = True) -> int:
        return self.run(["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--worker={worker}", *self.where,
                         "--command", command], check)

    def worker(self, *args: str) -> str:
        """The worker script's command line (ssh starts in the home directory, where scp put it)."""
        return "cd && " + shlex.join(["bash", Path(WORKER_SCRIPT).name, *args])

    def create(self, accelerator: str, runtime: str) -> None:
        nodes = ["--node-id", self.a.tpu] if self.a.num_slices == 1 else \
            ["--node-count", str(self.a.num_slices), "--node-prefix", self.a.tpu]
        self.run(["gcloud", "compute", "tpus", "queued-resources", "create", self.a.tpu, *nodes,
                  "--accelerator-type", accelerator, "--runtime-version", runtime, *self.where,
                  *(["--spot"] if self.a.spot else [])])
        describe = ["gcloud", "compute", "tpus", "queued-resources", "describe", self.a.tpu, *self.where,
                    "--format=value(state.state)"]
        if self.dry:
            print(f"# then every 30 s until it says ACTIVE: {shlex.join(describe)}")
            return
        while (state := subprocess.run(describe, capture_output=True, text=True).stdout.strip()) != "ACTIVE":
            if state in ("FAILED", "SUSPENDED"):
                raise errors.RunError(f"queued resource {self.a.tpu} is {state}: "
                                      f"gcloud compute tpus queued-resources describe {self.a.tpu} says why")
            print(f"launch_tpu_pod: queued resource {self.a.tpu} is {state or 'not listed yet'}; waiting", flush=True)
            time.sleep(30)

    def coordinator(self) -> str:
        """Multislice: worker 0 of the first slice, which the others join (MEGASCALE_COORDINATOR_ADDRESS)."""
        describe = ["gcloud", "compute", "tpus", "tpu-vm", "describe", self.slices[0], *self.where,
                    "--format=value(networkEndpoints[0].ipAddress)"]
        if self.dry:
            print(shlex.join(describe))
            return f"{self.slices[0]}-worker-0-ip"  # a placeholder: the describe above gives it
        return subprocess.run(describe, capture_output=True, text=True, check=True).stdout.strip()


def start(a, train: list[str]) -> None:
    pod = Pod(a)
    accelerator, runtime = accelerator_and_runtime(a.accelerator, a.runtime) if a.create else (None, None)
    check_for_a_pod(train)
    config, extra = user_configs(train[0])
    with tempfile.TemporaryDirectory() as tmp:
        files = tracked_files()
        tarball = archive(files, extra, Path(tmp))
        shipped = "".join(f" + {name} (from {name.removeprefix(USER_FILES)})" for name in sorted(extra))
        print(f"launch_tpu_pod: the code, {tarball.name}: the checkout's {len(files)} tracked files{shipped}",
              flush=True)
        if a.create:
            pod.create(accelerator, runtime)
        env = list(a.env)
        address = pod.coordinator() if a.num_slices > 1 else None
        for i, tpu in enumerate(pod.slices):
            pod.run(["gcloud", "compute", "tpus", "tpu-vm", "scp", str(tarball), str(REPO / WORKER_SCRIPT),
                     f"{tpu}:~/", "--worker=all", *pod.where])
            megascale = [f"MEGASCALE_COORDINATOR_ADDRESS={address}", f"MEGASCALE_NUM_SLICES={a.num_slices}",
                         f"MEGASCALE_SLICE_ID={i}", f"MEGASCALE_PORT={MEGASCALE_PORT}"] if address else []
            flags = [f"--env={e}" for e in [*env, *megascale]]
            pod.ssh(tpu, pod.worker("start", f"--archive={tarball.name}", f"--extras={a.extras}",
                                    f"--max-restarts={a.max_restarts}", f"--restart-delay={a.restart_delay}",
                                    *flags, "--", config, *train[1:]))
    hosts = f"--tpu {a.tpu} --zone {a.zone}" + (f" --num-slices {a.num_slices}" if a.num_slices > 1 else "")
    print(f"{'# (dry run) then ' if a.dry_run else ''}launch_tpu_pod: started on every worker of {', '.join(pod.slices)} (code {tarball.name}); follow worker "
          f"0: scripts/launch_tpu_pod.sh logs {hosts} --follow; state: ... status {hosts}; stop: ... stop {hosts}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in ("start", "logs", "status", "stop") else "start"
    train = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog=f"scripts/launch_tpu_pod.sh {command}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tpu", required=True, help="the TPU VM (or queued resource) name")
    p.add_argument("--zone", required=True)
    p.add_argument("--project")
    p.add_argument("--num-slices", type=int, default=1, help="slices NAME-0 ... NAME-(N-1), joined as one job")
    p.add_argument("--dry-run", action="store_true", help="print each command instead of running it")
    if command == "start":
        p.add_argument("--create", action="store_true", help="create the slice(s) as a queued resource first")
        p.add_argument("--accelerator", help="with --create: v4-N, v5e-N, v5p-N, v6e-N")
        p.add_argument("--runtime", help="with --create: the TPU VM software version (default: the family's)")
        p.add_argument("--spot", action="store_true")
        p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for every worker; repeat")
        p.add_argument("--extras", default="tpu", help="pyproject extras installed on the workers (default tpu)")
        p.add_argument("--max-restarts", type=int, default=0, help="a failed start runs again, at most this often")
        p.add_argument("--restart-delay", type=int, default=60,
                       help="seconds before a restart, for every worker's process to stop first (default 60)")
    elif command == "logs":
        p.add_argument("--worker", default="0")
        p.add_argument("--slice", type=int, default=0)
        p.add_argument("--follow", action="store_true")
    a = p.parse_args(argv)
    try:
        if a.num_slices < 1:
            raise ConfigError("--num-slices", f"must be 1 or more, got {a.num_slices}")
        if command == "start":
            bad = [e for e in a.env if "=" not in e or not e.split("=", 1)[0].isidentifier()]
            if bad:
                raise ConfigError("--env", f"{bad[0]!r}: expected KEY=VALUE")
            if a.create and not a.accelerator:
                raise ConfigError("--create", "needs --accelerator (e.g. v5p-128)")
            if a.max_restarts < 0 or a.restart_delay < 0:
                raise ConfigError("--max-restarts", "--max-restarts and --restart-delay must be 0 or more")
            if not train:
                raise ConfigError("launch_tpu_pod", "the training arguments go after --: -- CONFIG.yml [key=value ...]")
            start(a, train)
            return 0
        pod = Pod(a)
        if command == "logs":
            return pod.ssh(pod.slices[a.slice], pod.worker("logs", *(["--follow"] if a.follow else [])),
                           worker=a.worker, check=False)
        return max(pod.ssh(tpu, pod.worker(command), check=False) for tpu in pod.slices)
    except errors.UserError as e:
        print(f"{e.kind} error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
