"""FLOPs accounting, MFU against a peak that cannot be exceeded, and the stdout line (writers.py
writes the files)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.runtime.wording import duration
from maxtrain.config.load import Config
from maxtrain.models import registry

# Dense (not 2:4 sparse) bf16 peak TFLOP/s per device, matched by words of jax's device_kind, most specific
# first. jax names a v5e "TPU v5 lite", a v6e "TPU v6 lite", a v5p "TPU v5"; an H100 SXM "NVIDIA H100 80GB HBM3".
PEAK_TFLOPS = (
    ("TPU v6 lite", 918.0), ("TPU v6e", 918.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
    ("TPU v5p", 459.0), ("TPU v5", 459.0), ("TPU v4", 275.0), ("TPU v3", 123.0),
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
    ("H100", 989.0), ("A100", 312.0), ("L4", 121.0),
)


def forward_flops(c: Config, tokens: int, causal: bool = True) -> float:
    """Matmul FLOPs of one forward pass over `tokens` tokens of length max_target_length, as the model's
    family counts them per token (MaxText's formula; an MoE layer counts the experts a token uses)."""
    return float(registry.spec_for(c).flops_per_token(c, c.max_target_length, causal, True) * tokens)


def train_flops_per_step(c: Config) -> float:
    """Forward + backward (2x forward) for one optimizer step; remat recompute not counted."""
    return 3.0 * forward_flops(c, c.global_batch_size * c.max_target_length)


def measure_cpu_peak_tflops(size: int = 1024, repeats: int = 5, dtype=jnp.float32, probes: int = 3) -> float:
    """Best matmul rate (float32 by default) of one device over `probes` rounds of `repeats` matmuls, a
    stand-in for a CPU's peak: the best of several, as a single round taken while the machine is busy
    reads low."""
    # On one device whatever mesh is active: under the run's mesh the matmul would be replicated over
    # every device, and the probe would time all of them doing the same work.
    with jax.set_mesh(jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("probe",))):
        a = jnp.ones((size, size), dtype)
        matmul = jax.jit(lambda x, y: x @ y)
        matmul(a, a).block_until_ready()
        best = float("inf")
        for probe in range(probes):
            if probe:
                time.sleep(0.05)  # a moment for whatever else runs to yield the cores
            for _ in range(repeats):
                t0 = time.perf_counter()
                matmul(a, a).block_until_ready()
                best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


CPU_PROBES = 3


@dataclass
class Peak:
    """The MFU denominator, per device, and where it came from: `config` (peak_tflops_per_device), `nominal`
    (the table, for device kind `kind`) or `measured` (CPU matmul probes)."""
    tflops: float
    source: str
    kind: str = ""
    raised: bool = False

    def describe(self) -> str:
        if self.source == "config":
            return f"MFU against peak_tflops_per_device={self.tflops:g} TFLOP/s"
        if self.source == "nominal":
            return f"MFU against the nominal dense bf16 peak of {self.kind}: {self.tflops:g} TFLOP/s per device"
        if self.source == "unknown":
            return f"no MFU: no nominal peak for {self.kind} (peak_tflops_per_device=X sets one)"
        shared = f", shared by {jax.local_device_count()} devices" if jax.local_device_count() > 1 else ""
        return (f"MFU against a measured CPU peak of {self.tflops:.3f} TFLOP/s per device (best of {CPU_PROBES} "
                f"matmul probes{shared}; peak_tflops_per_device=X sets it)")

    def mfu(self, tflops: float) -> tuple[float | None, str | None]:
        """The fraction of peak, at most 1: a rate above the peak becomes the peak (a probe taken while the
        machine was busy, a wrong peak_tflops_per_device), said once. None where the peak is unknown."""
        if self.source == "unknown":
            return None, None
        if tflops <= self.tflops:
            return tflops / self.tflops, None
        note = None if self.raised else (
            f"note: the step ran at {tflops:.3f} TFLOP/s per device, above the {self.source} peak of "
            f"{self.tflops:.3f}: MFU is reported against the highest rate seen from now on")
        self.tflops, self.raised = tflops, True
        return 1.0, note


def nominal_peak(device_kind: str) -> float | None:
    """Whole words only: "L4" is not the start of "L40S"."""
    return next((peak for name, peak in PEAK_TFLOPS if re.search(rf"\b{re.escape(name)}\b", device_kind)), None)


def peak_tflops_per_device(c: Config) -> Peak:
    if c.peak_tflops_per_device > 0:
        return Peak(c.peak_tflops_per_device, "config")
    device = jax.devices()[0]
    kind = device.device_kind
    if nominal_peak(kind):
        return Peak(nominal_peak(kind), "nominal", kind)
    if device.platform != "cpu":  # a float32 probe on an accelerator the table lacks says nothing of its peak
        return Peak(0.0, "unknown", kind)
    # Fake CPU devices share the same cores, so each gets an equal part of the measured rate.
    return Peak(measure_cpu_peak_tflops(probes=CPU_PROBES) / jax.local_device_count(), "measured", kind)


def format_line(step: int, total: int, m: dict[str, float], eta_seconds: float | None = None) -> str:
    """The stdout line of a logged step: `step N/M`, the step's figures, and the time left at the recent rate."""
    mfu = f" | MFU {100 * m['mfu']:.1f}%" if "mfu" in m else ""
    return (f"{step_of(step, total)} | loss {m['loss']:.4f} | lr {m['learning_rate']:.3e} | "
            f"grad_norm {m['grad_norm']:.3f} | {m['step_seconds']:.3f} s/step | "
            f"{m['tokens_per_second']:,.0f} tok/s | {m['tflops_per_device']:.3f} TFLOP/s/dev{mfu}" + moe_summary(m)
            + (f" | mtp_loss {m['mtp_loss']:.4f}" if "mtp_loss" in m else "")
            + (f" | ETA {duration(eta_seconds)}" if eta_seconds is not None else "")
            + (" | non-finite: update skipped" if m.get("nonfinite") else ""))


def format_eval_line(step: int, total: int, e: dict, seconds: float, eta_seconds: float | None) -> str:
    named = "".join(f" | {name} {x['loss']:.4f}" for name, x in e.get("sources", {}).items())
    return (f"eval {step_of(step, total)} | loss {e['loss']:.4f} | perplexity {e['perplexity']:.3f}{named} | "
            f"{e['tokens']:,.0f} tokens | {seconds:.1f} s" + (f" | ETA {duration(eta_seconds)}"
                                                              if eta_seconds is not None else ""))


def step_of(step: int, total: int) -> str:
    """`step  7/20`: the step padded to the total's width, so the lines' columns align."""
    return f"step {step:>{len(str(total))}d}/{total}"


def moe_summary(m: dict) -> str:
    """An MoE's balance at a glance: the busiest expert's load over a fair share (1.00 = balanced), over all
    MoE layers, and the balancing loss."""
    if "expert_load" not in m:
        return ""
    busiest = max(max(layer) * len(layer) for layer in m["expert_load"])
    dropped = f" | dropped {100 * m['moe_dropped']:.1f}%" if "moe_dropped" in m else ""
    return f" | max expert load {busiest:.2f}x | lb_loss {m['moe_lb_loss']:.3f}{dropped}"
