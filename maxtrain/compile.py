"""Ahead-of-time compile of the train step for a TPU topology, on any machine (a CPU laptop too).

    python -m maxtrain.compile configs/x.yml compile_topology=v5p-128 [compile_topology_num_slices=2] ...

Needs libtpu (`pip install -e .[tpu]`). Prints the per-device memory XLA plans (arguments,
temporaries, outputs) against the chip's HBM and the FLOPs per step, and exits 1 if it would not fit.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import sys
import time

# Compile-only: never try to open real TPU chips (and their lockfile) or the TPU runtime's metadata.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# libtpu lets one process per machine hold the chips (a lockfile); compiling holds none, so several
# compiles, or a compile beside a training run, may share the machine.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


from maxtrain.config import help as cli_help, keys as config_keys, load as config_lib  # noqa: E402
from maxtrain.config import resolve  # noqa: E402
from maxtrain.observe import settings  # noqa: E402
from maxtrain.observe import fit, metrics, progress, summary  # noqa: E402
from maxtrain.ops import grouped_matmul  # noqa: E402
from maxtrain.parallel import mesh as mesh_lib  # noqa: E402
from maxtrain.runtime import errors, interrupts  # noqa: E402
from maxtrain.training import step as step_lib  # noqa: E402

# HBM per chip (GiB) and how the -N suffix counts: TensorCores for v4/v5p, chips for v5e/v6e.
CHIPS = {"v4": (32.0, 2, 3), "v5p": (95.0, 2, 3), "v5e": (16.0, 1, 2), "v6e": (32.0, 1, 2)}
# name -> (HBM GiB per chip, cores counted per chip in "-N", torus dimensions)


def topology(name: str) -> tuple[str, str, float, int]:
    """'v5p-128' -> ('v5p', 'v5p:4x4x4', HBM GiB per chip, chips)."""
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", name)
    if not m:
        raise config_keys.ConfigError("compile_topology", f"{name!r}: expected v4-N, v5e-N, v5p-N or v6e-N")
    gen, n = m.group(1), int(m.group(2))
    hbm, per_chip, ndim = CHIPS[gen]
    chips = n // per_chip
    if chips < 1 or n % per_chip or chips & (chips - 1):
        raise config_keys.ConfigError("compile_topology", f"{name!r}: the chip count must be a power of two")
    dims = [1] * ndim
    while math.prod(dims) < chips:  # as cubic as possible: double the smallest side
        dims[dims.index(min(dims))] *= 2
    dims = sorted(d for d in dims if d > 1) + [d for d in dims if d == 1]  # 2x2x1, 2x2x4, 4x4x8
    if len(dims) < ndim:
        dims += [1] * (ndim - len(dims))
    return gen, f"{gen}:{'x'.join(map(str, dims))}", hbm, chips


def slice_shape(spec: str) -> dict:
    """How the chips of a slice are wired, as on a real slice (and as MaxText describes them): up to
    2x2 chips a host; v4/v5p chips as megacores, whose slices of 4x4x4 and up close every dimension into
    a ring (wraparound links); v5e/v6e only as a full 16x16 pod. Described as an open mesh instead, the
    compiler plans other collectives (more memory per chip, and all-gathers built as all-reduces of
    zero-padded buffers)."""
    dims = [int(d) for d in spec.split(":")[1].split("x")]
    per_host = (min(dims[0], 2), min(dims[1], 2) if len(dims) > 1 else 1, 1)
    if len(dims) == 3:
        return {"chip_config_name": "megacore", "chips_per_host_bounds": per_host, "wrap": (min(dims) >= 4,) * 3}
    return {"chip_config_name": "default", "chips_per_host_bounds": per_host,
            "wrap": (dims == [16, 16],) * 2 + (False,)}


class CompileError(errors.UserError):
    kind = "compile"


def _libtpu_pin() -> str:
    """The tpu extra's libtpu requirement as installed maxtrain declares it (pyproject.toml)."""
    try:
        requirements = importlib.metadata.requires("maxtrain") or []
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        requirements = []
    return next((r.split(";")[0].strip() for r in requirements if r.startswith("libtpu")), "libtpu")


LIBTPU_HINT = f'install it with `pip install -e ".[tpu]"` (or `pip install "{_libtpu_pin()}"`)'


def topology_desc(name: str, spec: str, num_slices: int):
    """The devices of a TPU topology, described by libtpu (no chips needed); one line if libtpu is
    missing or will not load."""
    from jax.experimental import topologies
    # libtpu reads the host's TPU type and worker list at load; a machine without chips has neither, and
    # libtpu prints a screen of start-up errors. Compiling needs only the target's, given here.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=spec, **slice_shape(spec),
                                            num_slices=num_slices)
    except Exception as e:
        if "TPU support not installed" in str(e):  # jax found no libtpu (nor TPU_LIBRARY_PATH)
            raise CompileError(f"compile_topology={name} needs libtpu, which is not installed: "
                               f"{LIBTPU_HINT}") from None
        raise CompileError(f"compile_topology={name}: libtpu cannot describe {spec} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); the libtpu for this jax: {LIBTPU_HINT}") from None


def compile_for(c_static: config_lib.Config) -> int:
    gen, spec, hbm_per_chip, chips = topology(c_static.compile_topology)
    desc = topology_desc(c_static.compile_topology, spec, c_static.compile_topology_num_slices)
    interrupts.rearm()  # libtpu, loaded just now, installed its own SIGTERM handler (a stack dump)
    devices = desc.devices
    c = resolve.resolve(c_static, len(devices), resolve.num_slices(devices), "tpu")
    hbm = hbm_per_chip * chips * c.compile_topology_num_slices / len(devices)  # per device
    advice = "try a larger ici_fsdp_parallelism, remat_policy=full, or a smaller per_device_batch_size"
    floor = fit.step_floor(c)  # from the config alone: a step far too large is refused before it is traced
    if sum(floor.values()) > hbm * fit.GiB:
        parts = ", ".join(f"{k} {v / fit.GiB:.2f}" for k, v in floor.items())
        print(f"does not fit: the train step needs at least {sum(floor.values()) / fit.GiB:.2f} GiB per device for "
              f"its activations ({parts}), more than {hbm:.1f} GiB HBM; {advice}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    print(f"building the model and its shardings for {c.compile_topology} ({len(devices)} devices)", flush=True)
    with progress.heartbeat("building the model"):
        trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
    try:
        with mesh_lib.activate(trainer.mesh, trainer.rules), grouped_matmul.cross_compiling(c.moe_grouped_matmul):
            print("lowering the train step (tracing it to XLA)", flush=True)
            with progress.heartbeat("lowering the train step"):
                lowered = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch())
            t_lowered = time.perf_counter()
            print(f"compiling the train step for {c.compile_topology} (lowered in {t_lowered - t0:.1f} s)", flush=True)
            with progress.heartbeat(f"compiling the train step for {c.compile_topology}"):
                compiled = lowered.compile()
    except Exception as e:  # the TPU compiler itself refuses programs far over HBM
        message = str(e)
        if "Ran out of memory" not in message and "RESOURCE_EXHAUSTED" not in message:
            raise
        detail = message[message.find("the total memory"):].splitlines()[0] if "the total memory" in message else ""
        print(f"does not fit: XLA: {detail or 'out of HBM'}; {advice}", file=sys.stderr)
        return 1
    print(f"compiled in {time.perf_counter() - t_lowered:.1f} s; reading XLA's memory analysis", flush=True)
    mem = summary.memory_report(compiled)
    flops = metrics.train_flops_per_step(c)
    active = f" ({c.num_active_params / 1e6:,.1f}M active)" if c.num_experts > 1 else ""
    print(f"{c.compile_topology} x {c.compile_topology_num_slices} slice(s) ({spec}, {len(devices)} devices "
          f"{devices[0].device_kind}) | {c.num_params / 1e6:,.1f}M params{active} | mesh {c.mesh_shape} | "
          f"batch {c.global_batch_size} x {c.max_target_length} | remat {c.remat_policy} | "
          f"{settings.summary(c)} | {c.weight_dtype} weights")
    for note in trainer.notes:  # the pipeline's placement; dimensions left unsharded on an axis
        print(note)
    print(f"memory per device: {summary.format_memory(mem)} | HBM {hbm:.1f} GiB")
    print(summary.state_placement(trainer, mem["total"]))
    print(f"model FLOPs per step: {flops:.3e} ({flops / len(devices) / 1e12:.1f} TFLOP per device)")
    if mem["total"] > hbm:
        print(f"does not fit: {mem['total']:.2f} GiB > {hbm:.1f} GiB HBM per device; {advice}", file=sys.stderr)
        return 1
    print(f"fits: {mem['total']:.2f} GiB of {hbm:.1f} GiB ({100 * mem['total'] / hbm:.0f}%)")
    return 0


USAGE = """usage: python -m maxtrain.compile CONFIG.yml compile_topology=v5p-128 [key=value ...]

Compiles the train step CONFIG.yml describes for a TPU topology (v4-N, v5e-N, v5p-N, v6e-N; more slices
with compile_topology_num_slices) on this machine, and prints the memory per device against HBM and the
FLOPs per step; exit 1 if it would not fit. Needs libtpu: pip install -e ".[tpu]"."""


def main(argv: list[str] | None = None) -> int:
    from_shell, argv = argv is None, sys.argv[1:] if argv is None else argv
    if (code := cli_help.handle(argv, USAGE)) is not None:
        return code
    if from_shell:
        interrupts.watch("the compile")  # Ctrl-C or SIGTERM: one line, never libtpu's stack dump

    def run():
        c = config_lib.load(argv)
        if not c.compile_topology:
            raise config_keys.ConfigError("compile_topology", "name a topology to compile for, e.g. v5p-128")
        return compile_for(c)
    return errors.exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
