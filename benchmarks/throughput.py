"""Throughput, MFU and compiled memory of a ~20M-parameter config for each remat policy, on this machine.

    python benchmarks/throughput.py [--steps 5] [--policies full,minimal] [key=value ...]

MFU = model FLOPs per second (6*N*tokens + attention, remat recompute not counted) over the float32
matmul peak measured in the same run. Temp memory comes from XLA's memory_analysis() of the compiled
train step. All variants run in one process, one after another, so they share the machine's state.
"""

import argparse
import time
from pathlib import Path

import jax

from maxtrain.data import pipeline as data
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.observe import metrics
from maxtrain.training import step as step_lib
from maxtrain import train
from maxtrain.parallel.remat import POLICY_NAMES

CONFIG = [str(Path(__file__).parent.parent / "configs" / "base.yml"),
          "vocab_size=8192", "base_emb_dim=512", "base_num_query_heads=8", "base_num_kv_heads=8",
          "head_dim=64", "base_mlp_dim=1536", "base_num_decoder_layers=4", "max_target_length=256",
          "per_device_batch_size=4", "dtype=float32"]


def measure(c, steps: int) -> dict:
    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
        batches = data.make_iterator(c, trainer.batch_sharding)
        batch = next(batches)
        compiled = trainer.train_step.lower(state, batch).compile()
        for _ in range(2):  # warm up
            state, m = compiled(state, next(batches))
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = compiled(state, next(batches))
        jax.block_until_ready(m)
        seconds = (time.perf_counter() - t0) / steps
    return {"seconds": seconds, "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30,
            "loss": float(m["loss"])}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--policies", default="none,full,minimal,save_dot_except_mlp,save_qkv_proj,save_out_proj")
    args, overrides = parser.parse_known_args()
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICY_NAMES)
    if unknown:
        parser.error(f"unknown remat policies {sorted(unknown)}; known: {', '.join(POLICY_NAMES)}")

    peak = metrics.measure_cpu_peak_tflops(size=2048) if jax.devices()[0].platform == "cpu" else None
    base = train.load_config(CONFIG + overrides)
    peak = peak / jax.local_device_count() if peak else metrics.peak_tflops_per_device(base).tflops
    flops = metrics.train_flops_per_step(base) / base.num_devices
    tokens = base.global_batch_size * base.max_target_length
    print(f"{base.num_params / 1e6:.1f}M params | {base.num_devices} device(s) {jax.devices()[0].device_kind} | "
          f"batch {base.global_batch_size} x {base.max_target_length} | {base.dtype} | "
          f"peak {peak * 1e3:.1f} GFLOP/s/device (float32 matmul probe)")
    rows = []
    for policy in policies:
        r = measure(base.replace(remat_policy=policy), args.steps)
        tflops = flops / r["seconds"] / 1e12
        rows.append((policy, r["seconds"], tokens / r["seconds"], tflops * 1e3, tflops / peak, r["temp_gib"]))
    header = ("remat_policy", "s/step", "tokens/s", "GFLOP/s/dev", "MFU", "temp GiB")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for p, s, tps, gf, mfu, mem in rows:
        print(f"| {p} | {s:.3f} | {tps:,.0f} | {gf:.1f} | {100 * mfu:.1f}% | {mem:.3f} |")
    full = next((r for r in rows if r[0] == "full"), None)
    none = next((r for r in rows if r[0] == "none"), None)
    if full and none:
        print(f"ratio none/full: {full[1] / none[1]:.2f}x faster step, {none[5] / max(full[5], 1e-9):.2f}x the temp memory")


if __name__ == "__main__":
    main()
