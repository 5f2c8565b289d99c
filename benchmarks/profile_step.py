"""Where a train step's time goes, op by op, on this machine.

    python benchmarks/profile_step.py configs/base.yml key=value ... [--top 30]

Runs a few steps under jax.profiler, reads XLA's per-op trace events (each carries the HLO
instruction's name) and prints the ops that took the most time per step, with the start of each op's
line in the compiled HLO, so a slow fusion can be traced back to the model code (its op_name metadata).
"""

import argparse
import glob
import gzip
import json
import re
import tempfile
import time

from maxtrain.runtime.hugepages import reexec_with_huge_pages

reexec_with_huge_pages()  # as `python -m maxtrain.train` does, so the profile shows the same allocations

import jax  # noqa: E402

from maxtrain.data import pipeline as data  # noqa: E402
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib
from maxtrain import train


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3)
    args, config_args = parser.parse_known_args()
    c = train.load_config(config_args)
    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    trace_dir = tempfile.mkdtemp(prefix="maxtrain_profile_")
    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
        batch = next(data.make_iterator(c, trainer.batch_sharding))
        hlo = trainer.train_step.lower(state, batch).compile().as_text()
        for _ in range(2):  # compile and warm up
            state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        t0 = time.perf_counter()
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(args.steps):
            state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        seconds = (time.perf_counter() - t0) / args.steps

    events = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    per_op: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and "hlo_op" in e.get("args", {}):
            per_op[e["args"]["hlo_op"]] = per_op.get(e["args"]["hlo_op"], 0.0) + e["dur"] / 1e3 / args.steps
    text = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)
        if m:
            text.setdefault(m.group(1), m.group(2)[:110])
    total = sum(per_op.values())
    print(f"step {seconds:.3f} s (profiled), ops {total:.0f} ms per step")
    print(f"| {'ms/step':>8} | {'share':>5} | op | HLO |\n|---|---|---|---|")
    for name, ms in sorted(per_op.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {ms:8.1f} | {100 * ms / total:4.1f}% | {name} | {text.get(name, '')} |")


if __name__ == "__main__":
    main()
