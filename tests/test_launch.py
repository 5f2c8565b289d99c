"""Launch scripts (--dry-run prints exactly what would run) and ahead-of-time compile for a TPU topology."""

import os
import shlex
import subprocess
import time
import sys

import pytest

from conftest import TINY, TESTS

REPO = TESTS.parent


def dry(*cmd, env=None):
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_launch_local_dry_run():
    out = dry("scripts/launch_local.sh", "--dry-run", "2", "configs/base.yml", "steps=5",
              env={"MAXTRAIN_COORDINATOR_PORT": "4321", "XLA_FLAGS": "--xla_dump_to=/tmp/d"})
    lines = [shlex.split(x) for x in out.strip().splitlines()]
    assert len(lines) == 2
    for i, argv in enumerate(lines):  # the shell's XLA_FLAGS kept, the device count after them (the last wins)
        assert argv[:3] == ["env", "XLA_FLAGS=--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4",
                            "JAX_PLATFORMS=cpu"]
        assert argv[4:7] == ["-m", "maxtrain.train", "configs/base.yml"]
        assert argv[-4:] == ["steps=5", "coordinator_address=127.0.0.1:4321", "num_processes=2", f"process_id={i}"]


def test_launch_tpu_pod_dry_run():
    out = dry("scripts/launch_tpu_pod.sh", "--dry-run", "--tpu", "my-pod", "--zone", "us-east5-a", "--project", "p1",
              "--create", "--accelerator", "v5p-128", "--", "configs/base.yml", "model_name=llama2-7b", "steps=100")
    lines = [shlex.split(x) for x in out.strip().splitlines()]
    create, archive, scp, ssh = lines
    assert create[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]
    assert "--accelerator-type" in create and create[create.index("--accelerator-type") + 1] == "v5p-128"
    assert archive[:2] == ["git", "archive"]
    assert scp[:4] == ["gcloud", "compute", "tpus", "tpu-vm"] and "--worker=all" in scp
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod"] and "--worker=all" in ssh
    remote = ssh[ssh.index("--command") + 1]
    assert "pip install -q -e '.[tpu]'" in remote
    assert remote.endswith("python -m maxtrain.train configs/base.yml model_name=llama2-7b steps=100")


def test_launch_slurm_dry_run():
    out = dry("bash", "scripts/launch_slurm.sbatch", "--dry-run", "configs/base.yml", "steps=7")
    assert shlex.split(out) == ["srun", "--kill-on-bad-exit=1", "python", "-m", "maxtrain.train",
                                "configs/base.yml", "steps=7"]
    out = dry("bash", "scripts/launch_slurm.sbatch", "--dry-run", "configs/base.yml", "steps=7",
              env={"MAXTRAIN_PROCESS_PER": "gpu"})
    argv = shlex.split(out)
    assert argv[:4] == ["srun", "--kill-on-bad-exit=1", "bash", "-c"]
    assert argv[4].startswith("CUDA_VISIBLE_DEVICES=$SLURM_LOCALID exec python -m maxtrain.train configs/base.yml steps=7")


def test_launch_gke_xpk_and_jobset_dry_runs():
    common = ["--cluster", "c1", "--workload", "run1", "--tpu-type", "v5p-128", "--image", "gcr.io/p/maxtrain:1",
              "--num-slices", "2", "--", "configs/base.yml", "steps=9"]
    argv = shlex.split(dry("scripts/launch_gke.sh", "--dry-run", "--xpk", *common))
    assert argv[:3] == ["xpk", "workload", "create"]
    assert argv[argv.index("--num-slices") + 1] == "2"
    assert argv[argv.index("--command") + 1] == "python -m maxtrain.train configs/base.yml steps=9"
    import yaml
    manifest, kubectl = dry("scripts/launch_gke.sh", "--dry-run", *common).split("---\n")
    job = yaml.safe_load(manifest)
    assert kubectl.strip() == "kubectl apply -f -"
    assert job["kind"] == "JobSet" and job["metadata"]["name"] == "run1"
    rj = job["spec"]["replicatedJobs"][0]
    pod = rj["template"]["spec"]["template"]["spec"]
    assert rj["replicas"] == 2 and rj["template"]["spec"]["parallelism"] == 16  # 64 chips / 4 per host
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4x4"}
    assert pod["containers"][0]["command"][-1] == "python -m maxtrain.train configs/base.yml steps=9"


def test_topology_names():
    from maxtrain.compile import topology
    assert topology("v5p-128")[1:] == ("v5p:4x4x4", 95.0, 64)
    assert topology("v5e-256")[1] == "v5e:16x16"
    assert topology("v4-8")[1] == "v4:2x2x1"
    assert topology("v6e-8")[1] == "v6e:2x4"


def test_mesh_axes_that_split_a_torus_dimension():
    """fsdp 8 x expert 8 on v5p-128's 4x4x4 chips, wired as a real slice (rings of 4): no axis spans whole
    torus dimensions, so one dimension is split between them (MaxText's allow_split_physical_axes)."""
    code = """
import maxtrain.compile as C
from jax.experimental import topologies
from maxtrain.config import load as config_lib
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.config.resolve import resolve
spec = C.topology("v5p-128")[1]
assert C.slice_shape(spec)["wrap"] == (True, True, True) and not any(C.slice_shape("v5p:2x4x4")["wrap"])
devices = topologies.get_topology_desc(platform="tpu", topology_name=spec, **C.slice_shape(spec)).devices
c = config_lib.load([str(config_lib.BASE_YML), "ici_fsdp_parallelism=8", "ici_expert_parallelism=8",
                     "num_experts=8", "compile_topology=v5p-128"])
mesh = mesh_lib.make_mesh(resolve(c, len(devices), 1, "tpu"), devices)
print(dict(mesh.shape), len(set(mesh.devices.flat)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "{'stage': 1, 'data': 1, 'fsdp': 8, 'expert': 8, 'context': 1, 'tensor': 1} 64" in proc.stdout


def run_compile(*args):
    return subprocess.run([sys.executable, "-m", "maxtrain.compile", TINY, *args], capture_output=True,
                          text=True, timeout=600, cwd=REPO)


@pytest.mark.slow
@pytest.mark.parametrize("args,mesh", [
    (("compile_topology=v5e-4",), "{'stage': 1, 'data': 1, 'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 1}"),
    (("compile_topology=v5p-8", "compile_topology_num_slices=2", "ici_fsdp_parallelism=2",
      "ici_tensor_parallelism=2"), "{'stage': 1, 'data': 2, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 2}"),
    (("compile_topology=v5p-8", "compile_topology_num_slices=2", "dcn_pipeline_parallelism=2"),
     "{'stage': 2, 'data': 1, 'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 1}"),
], ids=["v5e-4", "v5p-8x2slices", "v5p-8x2slices_pipeline"])
def test_compile_for_a_tpu_topology_on_cpu(args, mesh):
    proc = run_compile(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"mesh {mesh}" in proc.stdout
    assert "memory per device: arguments" in proc.stdout and "temporaries" in proc.stdout
    if "'stage': 2" in mesh:  # the schedule and where the layers run
        assert "| pipeline 2 stages (GPipe) x 2 micro-batches, bubble 33.3% |" in proc.stdout
        assert "pipeline placement: stage 0: layers 0; stage 1: layers 1 (layers);" in proc.stdout
    assert "model FLOPs per step" in proc.stdout and "fits:" in proc.stdout


@pytest.mark.slow
def test_compile_reports_a_model_that_does_not_fit():
    proc = run_compile("compile_topology=v5e-4", "base_emb_dim=8192", "base_mlp_dim=32768",
                       "base_num_decoder_layers=8", "vocab_size=32000", "head_dim=128", "ici_fsdp_parallelism=1",
                       "ici_data_parallelism=4")
    assert proc.returncode == 1
    assert "does not fit" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_compile_refuses_a_far_too_large_step_before_tracing_it():
    t0 = time.perf_counter()
    proc = run_compile("compile_topology=v5e-4", "per_device_batch_size=4000", "max_target_length=100000")
    assert proc.returncode == 1 and time.perf_counter() - t0 < 60, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]  # after libtpu's own start-up lines
    assert last.startswith("does not fit: the train step needs at least ") and \
        "GiB per device for its activations (batch " in last and "Traceback" not in proc.stderr, proc.stderr


def test_compile_bad_topology_is_a_config_error():
    proc = run_compile("compile_topology=v9-8")
    assert proc.returncode == 2 and proc.stderr.startswith("config error: compile_topology:")


@pytest.mark.slow
def test_two_compiles_can_run_at_once():
    """libtpu's one-process lockfile must not stop compile-only processes from sharing a machine."""
    procs = [subprocess.Popen([sys.executable, "-m", "maxtrain.compile", TINY, "compile_topology=v5e-4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        assert "fits:" in out


@pytest.mark.parametrize("script", ["launch_tpu_pod.sh", "launch_gke.sh", "launch_local.sh"])
def test_every_launcher_answers_help_with_its_usage(script):
    done = subprocess.run(["bash", str(TESTS.parent / "scripts" / script), "--help"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and f"scripts/{script}" in done.stdout and "CONFIG.yml" in done.stdout, done
