"""What many test files need, in one place: the CLI as a user runs it, one-line error checks, HuggingFace reference
models and a converted checkpoint to compare them with, and results computed once per test run (the one-device
references the mesh tests compare with), whichever xdist worker asks first."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from conftest import TESTS, xla_flags

REPO = TESTS.parent


# ---- the command line, as a user runs it ---------------------------------------------------------------------

class Run(NamedTuple):
    code: int
    out: str
    err: str
    seconds: float


def run_cli(*args, module: str = "maxtrain.train", out: Path | None = None, devices: int = 8, cwd: Path = REPO,
            timeout: float = 600, env: dict[str, str] | None = None) -> Run:
    """`python -m module args` in the checkout with `devices` fake CPU devices (and base_output_directory=out
    when given): exit code, stdout, stderr, seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args, *([f"base_output_directory={out}"] if out else [])],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "XLA_FLAGS": xla_flags(devices),
                               **(env or {})})
    return Run(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0)


def one_line(err: str) -> str:
    """The one line an error is, with no traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def main_in_process(argv, capsys) -> tuple[int, str]:
    """train.main without a subprocess, for errors found before anything compiles: (exit code, stderr)."""
    from maxtrain import train
    code = train.main(argv)
    return code, capsys.readouterr().err


# ---- HuggingFace references (random weights from small configs: nothing is downloaded) -----------------------

def norms_about_one(name: str) -> tuple[float, float]:
    """(centre, spread) of a tensor's random values: HF starts norms at 1 and biases at 0, which would hide a
    mapping mistake, so norms are about 1 and the rest about 0.1."""
    return (1.0, 0.1) if "norm" in name else (0.0, 0.1)


def random_hf(model_cls, config, values: Callable[[str], tuple[float, float]] = norms_about_one):
    """A transformers model of `config` with every parameter random (torch seed 0)."""
    import torch
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre, spread = values(name)
            p.copy_(centre + spread * torch.randn_like(p) if centre else spread * torch.randn_like(p))
    return model


TOLERANCE = 1e-4  # max abs logit difference in float32, against transformers


def hf_logits(model, tokens) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def save_hf(model, where: Path) -> Path:
    model.save_pretrained(where)
    return where


def edit_hf_config(hf_dir: Path, **changes) -> None:
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def cpu_env() -> dict[str, str]:
    """A convert or generate process on one CPU device."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}


def load_maxtrain(config_path, *overrides, n_devices: int = 8, attention: str | None = None):
    """(config, trainer, params) for a converted checkpoint in float32 (parity with HF), on n_devices (fsdp over
    all by default); `attention` sets the kernel before the overrides."""
    import jax
    from maxtrain import train
    from maxtrain.checkpoint import loading as ckpt_loading
    from maxtrain.parallel import mesh as mesh_lib
    from maxtrain.training import step as step_lib
    devices = jax.devices()[:n_devices]
    c = train.load_config([str(config_path), "dtype=float32", *([f"attention={attention}"] if attention else []),
                           *overrides], devices)
    mesh = mesh_lib.make_mesh(c, devices)
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        params = ckpt_loading.load_parameters(c, trainer.abstract_state.params)
    return c, trainer, params


def maxtrain_logits(trainer, params, tokens) -> np.ndarray:
    import jax
    from maxtrain.parallel import mesh as mesh_lib
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        return np.asarray(jax.jit(trainer.model.apply)({"params": params}, np.asarray(tokens, np.int32)))


def assert_import_refused(tmp_path: Path, capsys, args: list[str], expected: str) -> None:
    """`convert hf_to_maxtrain --hf_dir D [--config C] --out O [key=value]` exits 2 with one line holding
    `expected`, and writes nothing."""
    from maxtrain import convert
    capsys.readouterr()  # drop what transformers printed while writing the input
    out = tmp_path / "out"
    code = convert.main(["hf_to_maxtrain", *args[:2], "--out", str(out), *args[2:]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


# ---- computed once per test run ------------------------------------------------------------------------------

def once(name: str, compute: Callable[[], Any]) -> Any:
    """compute()'s JSON result, computed by the first test of this run that asks (any xdist worker) and read by
    the others: e.g. the one-device losses that each mesh's test compares with."""
    folder = Path(os.environ["MAXTRAIN_TEST_HOME"]) / "once"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.json"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here for the first one's result
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())


class Output:
    """A process's stdout and stderr, each read as it comes by a thread of its own (neither pipe fills while
    the test waits on the other), waited on for a stdout line; nothing here waits without a timeout."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.err, self.seen = proc, [], [], threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(pipe, into, strip), daemon=True)
                        for pipe, into, strip in ((proc.stdout, self.lines, True), (proc.stderr, self.err, False))
                        if pipe is not None]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe, into: list[str], strip: bool) -> None:
        for line in pipe:
            with self.seen:
                into.append(line.rstrip("\n") if strip else line)
                self.seen.notify_all()

    def wait_for(self, pattern: str, timeout: float = 180) -> None:
        with self.seen:
            if not self.seen.wait_for(lambda: any(re.search(pattern, x) for x in self.lines), timeout):
                raise AssertionError(f"{pattern!r} not seen in {self.lines[-30:]}; stderr: {''.join(self.err)[-2000:]}")

    def finish(self, timeout: float = 300) -> tuple[int, list[str], str]:
        """(exit code, stdout lines, stderr) once the process ends; killed, and an AssertionError, if it has
        not ended within `timeout` seconds."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running after {timeout} s; stdout: {self.lines[-20:]}") from None
        for reader in self.readers:  # a child the process started may hold its pipes: not for ever
            reader.join(timeout=10)
        with self.seen:
            return self.proc.returncode, list(self.lines), "".join(self.err)


def popen_as_from_a_terminal(args: list[str], **kwargs) -> subprocess.Popen:
    """Popen with SIGINT at its default in the child, as a terminal's foreground command has it (a test run
    started in the background inherits SIGINT ignored, which Python keeps). The parent's disposition is
    switched around the spawn, not reset in the child: a preexec_fn would fork this multithreaded process
    (JAX's threads) and run Python in the child before exec, which can deadlock there."""
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)


def saved_arrays(state_dir: Path):
    """A checkpoint's train state (its `state` item) as numpy arrays, whatever devices or processes saved it."""
    import jax
    import orbax.checkpoint as ocp
    checkpointer = ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            checkpointer.metadata(state_dir).item_metadata.tree)
    return checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=as_numpy))


def read_events(path: Path) -> list:
    """Every Event of a tensorboard event file, checking each record's framing and CRCs."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c
    data, events, i = path.read_bytes(), [], 0
    while i < len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("Q", header)
        assert struct.unpack("I", data[i + 8:i + 12])[0] == masked_crc32c(header)
        body = data[i + 12:i + 12 + length]
        assert struct.unpack("I", data[i + 12 + length:i + 16 + length])[0] == masked_crc32c(body)
        events.append(event_pb2.Event.FromString(body))
        i += 16 + length
    return events
