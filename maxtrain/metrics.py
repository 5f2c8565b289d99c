"""FLOPs accounting, MFU, and the metrics writers (stdout line, metrics.jsonl, tensorboardX)."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain import storage
from maxtrain.config import Config
from maxtrain.errors import RunError

# Dense bf16 peak TFLOP/s per chip, matched by substring of jax's device_kind (most specific first).
PEAK_TFLOPS = (
    ("TPU v6 lite", 918.0), ("TPU v6e", 918.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
    ("TPU v5p", 459.0), ("TPU v5", 459.0), ("TPU v4", 275.0), ("TPU v3", 123.0),
    ("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L4", 121.0),
)


def forward_flops(c: Config, tokens: int, causal: bool = True) -> float:
    """Matmul FLOPs of one forward pass over `tokens` tokens of length max_target_length (MaxText's
    formula: 2 x multiply-adds of every projection, plus attention scores and context). An MoE layer
    counts the experts a token uses (top-k and shared) and its router, as MaxText does."""
    d, h, kv, hd, f = c.base_emb_dim, c.base_num_query_heads, c.base_num_kv_heads, c.head_dim, c.base_mlp_dim
    projections = 2 * d * hd * (h + 2 * kv) + 2 * d * hd * h
    attention = 4 * c.max_target_length * h * hd * (0.5 if causal else 1.0)  # QK^T and PV, per token
    dense, moe = c.base_num_decoder_layers, 0
    if c.num_experts > 1:
        dense, moe = c.first_num_dense_layers, c.base_num_decoder_layers - c.first_num_dense_layers
    experts = 2 * 3 * d * c.moe_mlp_dim * (c.num_experts_per_tok + c.shared_experts) + 2 * d * c.num_experts
    per_token = (dense * (projections + attention + 2 * 3 * d * f) + moe * (projections + attention + experts)
                 + 2 * d * c.vocab_size)
    return float(per_token * tokens)


def train_flops_per_step(c: Config) -> float:
    """Forward + backward (2x forward) for one optimizer step; remat recompute not counted."""
    return 3.0 * forward_flops(c, c.global_batch_size * c.max_target_length)


def measure_cpu_peak_tflops(size: int = 1024, repeats: int = 5, dtype=jnp.float32) -> float:
    """Best matmul rate (float32 by default) of one device, a stand-in for a CPU's peak."""
    # On one device whatever mesh is active: under the run's mesh the matmul would be replicated over
    # every device, and the probe would time all of them doing the same work.
    with jax.set_mesh(jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("probe",))):
        a = jnp.ones((size, size), dtype)
        matmul = jax.jit(lambda x, y: x @ y)
        matmul(a, a).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            matmul(a, a).block_until_ready()
            best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def peak_tflops_per_device(c: Config) -> float:
    if c.peak_tflops_per_device > 0:
        return c.peak_tflops_per_device
    device = jax.devices()[0]
    for name, peak in PEAK_TFLOPS:
        if name in device.device_kind:
            return peak
    # Fake CPU devices share the same cores, so each gets an equal part of the measured rate.
    return measure_cpu_peak_tflops() / jax.local_device_count()


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

    def flush(self) -> None:
        self._records._writer.flush()  # no fsync per log line (RecordWriter.flush's): close() syncs


    def close(self) -> None:
        self._records.flush()
        self._records.close()


class MetricsWriter:
    """One line to stdout per log, JSONL and tensorboard events under the run directory (process 0 only).

    `start_step`: the step the run starts from. What an earlier attempt logged after it (it ran past
    its last checkpoint before it was killed) is dropped, so a resumed run's logs hold each step once.
    Every write happens in the caller's thread and a failed one is a MetricsError naming the file.
    """

    def __init__(self, run_dir: Path, enable_tensorboard: bool, start_step: int = 0):
        self.active = jax.process_index() == 0
        self._jsonl = self._tb = None
        if not self.active:
            return
        path = self._at = run_dir / "metrics.jsonl"  # the file being written, for the error
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            _drop_steps_after(path, start_step)
            self._jsonl = storage.open_append(path)
            if enable_tensorboard:
                self._at = run_dir / "tensorboard"
                self._tb = _EventFile(run_dir / "tensorboard", purge_step=start_step + 1)
        except OSError as e:
            self._abandon()
            raise MetricsError(f"cannot write {self._at}: {_os_error(e)}") from None

    def write(self, step: int, scalars: dict[str, float], prefix: str = "train") -> None:
        if not self.active:
            return
        # Strict JSON: a non-finite value is written as null (the step's nonfinite flag says why).
        # expert_load is a list per MoE layer of each expert's share: a list in JSON, a scalar per expert
        # (expert_load/layer_<i>/expert_<e>) in tensorboard.
        finite = lambda v: v if math.isfinite(v) else None  # noqa: E731
        row = {f"{prefix}/{k}": finite(v) if not isinstance(v, list) else [[finite(x) for x in layer] for layer in v]
               for k, v in scalars.items()}
        try:
            self._at = self._jsonl.name
            self._jsonl.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
            self._jsonl.flush()
            if self._tb:
                self._at = self._tb.path
                for k, v in scalars.items():
                    values = {k: v} if not isinstance(v, list) else {
                        f"{k}/layer_{i}/expert_{e}": x for i, layer in enumerate(v) for e, x in enumerate(layer)}
                    for name, x in values.items():
                        if math.isfinite(x):  # a gap in the curve; the nonfinite flag is plotted
                            self._tb.add_scalar(f"{prefix}/{name}", x, step)
                self._tb.flush()
        except OSError as e:
            self._abandon()
            raise MetricsError(f"step {step}: writing {self._at} failed: {_os_error(e)}") from None

    def close(self) -> None:
        try:
            for f in (self._jsonl, self._tb):
                if f:
                    self._at = getattr(f, "path", None) or f.name
                    f.close()
        except OSError as e:
            self._abandon()
            raise MetricsError(f"writing {self._at} failed: {_os_error(e)}") from None
        self._jsonl = self._tb = None

    def _abandon(self) -> None:
        """Closes the files after a failed write; the flush that closing tries again would fail as well."""
        for f in (self._jsonl, self._tb):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        self._jsonl = self._tb = None


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


def format_line(step: int, m: dict[str, float]) -> str:
    return (f"step {step:>6d} | loss {m['loss']:.4f} | lr {m['learning_rate']:.3e} | "
            f"grad_norm {m['grad_norm']:.3f} | {m['step_seconds']:.3f} s/step | "
            f"{m['tokens_per_second']:,.0f} tok/s | {m['tflops_per_device']:.3f} TFLOP/s/dev | "
            f"MFU {100 * m['mfu']:.1f}%" + moe_summary(m) + (" | non-finite: update skipped" if m.get("nonfinite") else ""))


def moe_summary(m: dict) -> str:
    """An MoE's balance at a glance: the busiest expert's load over a fair share (1.00 = balanced), over all
    MoE layers, and the balancing loss."""
    if "expert_load" not in m:
        return ""
    busiest = max(max(layer) * len(layer) for layer in m["expert_load"])
    dropped = f" | dropped {100 * m['moe_dropped']:.1f}%" if "moe_dropped" in m else ""
    return f" | max expert load {busiest:.2f}x | lb_loss {m['moe_lb_loss']:.3f}{dropped}"
