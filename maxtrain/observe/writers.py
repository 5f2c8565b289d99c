"""Where the metrics go besides stdout: metrics.jsonl, tensorboardX events, Weights & Biases (metrics_backends).

Each backend's package is imported only when the run names it. Only process 0 writes. Every write happens in
the caller's thread and a failed one is a MetricsError naming the file, so a full disk stops the run with one
line instead of a writer thread dying.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import secrets
import socket
import sys
import time
from pathlib import Path

import jax
import yaml

from maxtrain.runtime import storage
from maxtrain.config.keys import ConfigError
from maxtrain.runtime.errors import RunError

EXTRAS = {"wandb": "wandb"}  # backend -> the pyproject extra that installs its package


def backends(c) -> tuple[str, ...]:
    """metrics_backends as names (config.py checked and normalized it)."""
    return tuple(b for b in c.metrics_backends.split(",") if b)


def check_installed(c) -> None:
    """Before anything compiles: a backend whose package is missing is one line naming the extra."""
    for name, extra in EXTRAS.items():
        if name in backends(c) and importlib.util.find_spec(name) is None:
            raise ConfigError("metrics_backends", f"{name} is not installed: pip install -e \".[{extra}]\" "
                              f"(or remove {name} from metrics_backends)")


def _import_tensorboardx():
    """tensorboardX, without the `import torch` it tries at import time (2 s, to accept torch tensors).

    We only log Python floats. `torch` is hidden only while tensorboardX loads; later imports are normal.
    """
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # a None entry makes `import torch` raise ImportError
    try:
        import tensorboardX
    finally:
        if hide:
            del sys.modules["torch"]
    return tensorboardX


class MetricsError(RunError):
    """Metrics that cannot be written (a full or read-only disk): the run stops with one line, exit code 1."""
    kind = "metrics"


def _os_error(e: OSError) -> str:
    return f"{e.strerror} [errno {e.errno}]" if e.strerror else f"{type(e).__name__}: {e}"


class _EventFile:
    """A tensorboard event file written in the calling thread, through tensorboardX's own record writer.

    tensorboardX's SummaryWriter writes from a thread of its own: when a write fails (a full disk) that
    thread dies with a traceback and the next writes block on its full queue, holding the run forever.
    Here a failed write raises where the loop can report it.
    """

    def __init__(self, logdir: Path, purge_step: int):
        tbx = _import_tensorboardx()
        from tensorboardX.proto import event_pb2
        from tensorboardX.record_writer import RecordWriter
        self._pb, self._summary = event_pb2, tbx.summary
        logdir.mkdir(parents=True, exist_ok=True)
        stem, n = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}", 0
        self.path = logdir / stem
        while self.path.exists():  # a writer made again within the second (a rollback) must not truncate it
            n += 1
            self.path = logdir / f"{stem}.{n}"
        if storage.is_url(self.path):  # tensorboardX's gs:// writer needs google-cloud-storage: write through epath
            self._records = RecordWriter.__new__(RecordWriter)
            self._records._writer = storage.AppendedObject(self.path)
        else:
            self._records = RecordWriter(str(self.path))
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        # tensorboard hides the events of steps >= purge_step that earlier files hold (a resumed run's repeats)
        self._add(event_pb2.Event(wall_time=time.time(), step=purge_step,
                                  session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        self.flush()

    def _add(self, event) -> None:
        self._records.write(event.SerializeToString())

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._add(self._pb.Event(wall_time=time.time(), step=step, summary=self._summary.scalar(tag, value)))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._add(self._pb.Event(wall_time=time.time(), step=step, summary=self._summary.text(tag, text)))

    def flush(self) -> None:
        self._records._writer.flush()  # no fsync per log line (RecordWriter.flush's): close() syncs

    def close(self) -> None:
        self._records.flush()
        self._records.close()


def _wandb_id(run_dir: Path) -> str:
    """One W&B run per maxtrain run: an id made at its first start and kept in its directory, so a resume
    continues that W&B run, and a run started again in a directory deleted since gets a new one."""
    kept = run_dir / "wandb_id"
    if kept.exists():
        return kept.read_text().strip()
    name = re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[:48]
    made = f"{name}-{secrets.token_hex(4)}"
    kept.write_text(made + "\n")
    return made


class _WandbRun:
    """A W&B run in the run directory (wandb/ beside metrics.jsonl, unless WANDB_DIR says otherwise).

    W&B's own environment variables apply: WANDB_MODE=offline keeps it on this machine (`wandb sync` uploads it
    later), WANDB_PROJECT (default maxtrain) and WANDB_ENTITY pick where it goes."""

    def __init__(self, run_dir: Path, record: dict):
        import wandb
        self._wandb = wandb
        # W&B writes local files: a URL run directory leaves them in W&B's default place (./wandb)
        self.path = Path(os.environ.get("WANDB_DIR") or (os.getcwd() if storage.is_url(run_dir) else run_dir))
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            # console="off": W&B would otherwise wrap stdout and stderr, and the run's one-line errors with them
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "maxtrain"), name=run_dir.name,
                                   id=_wandb_id(run_dir), resume="allow", dir=str(self.path),
                                   config={**record["config"], "maxtrain": {k: v for k, v in record.items()
                                                                             if k != "config"}},
                                   settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # W&B raises its own types (no login, no network, a bad mode)
            raise MetricsError(f"metrics_backends=wandb: cannot start the W&B run: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from None
        self._last = -1

    def write(self, step: int, row: dict) -> None:
        if step < self._last:  # W&B refuses steps that go back (a rollback's repeats): they keep the first values
            return  # (the same step again adds to it: the eval or the mixture's figures of a logged step)
        self._last = step
        self._run.log({k: v for k, v in row.items() if v is not None}, step=step)

    def close(self, exit_code: int = 0) -> None:
        self._run.finish(exit_code=exit_code)  # not 0: W&B marks the run failed


JSONL_ONLY = {"batch_checksum"}  # a fingerprint, not a curve: metrics.jsonl only


class MetricsWriter:
    """The run's metrics files under its directory, through the backends named (process 0 only).

    `start_step`: the step the run starts from. What an earlier attempt logged after it (it ran past
    its last checkpoint before it was killed) is dropped, so a resumed run's logs hold each step once.
    """

    def __init__(self, run_dir: Path, backends: tuple[str, ...] = ("tensorboard", "jsonl"), start_step: int = 0,
                 record: dict | None = None):
        self.active = jax.process_index() == 0
        self._run_dir, self._backends = run_dir, backends
        self._jsonl = self._tb = self._wandb = None
        if not self.active:
            return
        self._open(start_step)
        if "wandb" in backends:
            self._at = run_dir / "wandb"
            self._wandb = _WandbRun(run_dir, record or {"config": {}})
        if record is not None:
            self.record_start(start_step, record)

    def _open(self, start_step: int) -> None:
        first = "metrics.jsonl" if "jsonl" in self._backends else "tensorboard"
        self._at = self._run_dir / first  # the file being written, for the error
        try:
            self._run_dir.mkdir(parents=True, exist_ok=True)
            if "jsonl" in self._backends:
                path = self._at = self._run_dir / "metrics.jsonl"
                _drop_steps_after(path, start_step)
                self._jsonl = storage.open_append(path)
            if "tensorboard" in self._backends:
                self._at = self._run_dir / "tensorboard"
                self._tb = _EventFile(self._run_dir / "tensorboard", purge_step=start_step + 1)
        except OSError as e:
            self.abandon()
            raise MetricsError(f"cannot write {self._at}: {_os_error(e)}") from None

    def rewind(self, step: int) -> None:
        """A rollback to `step`: the steps after it are logged again (W&B keeps its first values)."""
        if not self.active:
            return
        self._close_files()
        self._open(step)

    def record_start(self, step: int, record: dict) -> None:
        """The start's record (config, command line, versions, devices): metrics.jsonl's line for it and
        tensorboard's text tab (W&B has it as the run's config)."""
        if not self.active:
            return
        try:
            if self._jsonl:
                self._at = self._jsonl.name
                self._jsonl.write(json.dumps({"step": step, "start": record}, default=str) + "\n")
                self._jsonl.flush()
            if self._tb:
                self._at = self._tb.path
                text = yaml.safe_dump(json.loads(json.dumps(record, default=str)), sort_keys=False)
                self._tb.add_text("run", "```\n" + text + "```", step)  # markdown: keep the layout
                self._tb.flush()
        except OSError as e:
            self.abandon()
            raise MetricsError(f"writing {self._at} failed: {_os_error(e)}") from None

    def write(self, step: int, scalars: dict[str, float], prefix: str = "train", jsonl: bool = True) -> None:
        """jsonl=False: tensorboard and W&B only (what another file of the run already holds)."""
        if not self.active:
            return
        # Strict JSON: a non-finite value is written as null (the step's nonfinite flag says why).
        # expert_load is a list per MoE layer of each expert's share: a list in JSON, a scalar per expert
        # (expert_load/layer_<i>/expert_<e>) in tensorboard and W&B.
        finite = lambda v: v if math.isfinite(v) else None  # noqa: E731
        row = {f"{prefix}/{k}": finite(v) if not isinstance(v, list) else [[finite(x) for x in layer] for layer in v]
               for k, v in scalars.items()}
        flat = {}
        for k, v in scalars.items():
            values = {k: v} if not isinstance(v, list) else {
                f"{k}/layer_{i}/expert_{e}": x for i, layer in enumerate(v) for e, x in enumerate(layer)}
            flat.update({f"{prefix}/{name}": x for name, x in values.items()
                         if math.isfinite(x) and name not in JSONL_ONLY})
        try:
            if self._jsonl and jsonl:
                self._at = self._jsonl.name
                self._jsonl.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
                self._jsonl.flush()
            if self._tb:
                self._at = self._tb.path
                for name, x in flat.items():  # a non-finite value is a gap in the curve; the nonfinite flag is plotted
                    self._tb.add_scalar(name, x, step)
                self._tb.flush()
        except OSError as e:
            self.abandon()
            raise MetricsError(f"step {step}: writing {self._at} failed: {_os_error(e)}") from None
        if self._wandb:
            self._wandb.write(step, flat)

    def write_samples(self, step: int, samples: list[dict[str, str]]) -> None:
        """Sampled continuations ({"prompt", "text"} each): a metrics.jsonl line, tensorboard's text tab,
        a W&B table."""
        if not self.active:
            return
        try:
            if self._jsonl:
                self._at = self._jsonl.name
                self._jsonl.write(json.dumps({"step": step, "samples": samples}) + "\n")
                self._jsonl.flush()
            if self._tb:
                self._at = self._tb.path
                rows = "\n".join(f"| {_cell(x['prompt'])} | {_cell(x['text'])} |" for x in samples)
                self._tb.add_text("samples", "| prompt | continuation |\n|---|---|\n" + rows, step)
                self._tb.flush()
        except OSError as e:
            self.abandon()
            raise MetricsError(f"step {step}: writing {self._at} failed: {_os_error(e)}") from None
        if self._wandb:
            table = self._wandb._wandb.Table(columns=["prompt", "continuation"],
                                             data=[[x["prompt"], x["text"]] for x in samples])
            self._wandb.write(step, {"samples": table})

    def _close_files(self) -> None:
        try:
            for f in (self._jsonl, self._tb):
                if f:
                    self._at = getattr(f, "path", None) or f.name
                    f.close()
        except OSError as e:
            self.abandon()
            raise MetricsError(f"writing {self._at} failed: {_os_error(e)}") from None
        self._jsonl = self._tb = None

    def close(self) -> None:
        self._close_files()
        if self._wandb:
            wandb_run, self._wandb = self._wandb, None
            wandb_run.close()

    def abandon(self) -> None:
        """Closes the files after a failed write or a failed run, quietly (the flush that closing tries again
        may fail as well); the W&B run ends marked failed, with what it had logged."""
        for f in (self._jsonl, self._tb):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        self._jsonl = self._tb = None
        if self._wandb:
            wandb_run, self._wandb = self._wandb, None
            try:
                wandb_run.close(exit_code=1)
            except Exception:  # the run is already stopping for the error at hand
                pass


def _cell(text: str) -> str:
    """Text in one cell of a markdown table."""
    return text.replace("|", "\\|").replace("\n", "<br>")


def _drop_steps_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)

    def step_of(line: str) -> float:
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            return float("inf")

    kept = [line for line in lines if step_of(line) <= step]
    if len(kept) < len(lines):
        storage.write_atomic(path, "".join(kept))  # a kill now leaves the old file or the new one


