"""Launch scripts (--dry-run prints exactly what would run) and ahead-of-time compile for a TPU topology."""

import os
import re
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


@pytest.mark.parametrize("accelerator, gcloud_name, runtime", [
    ("v5e-16", "v5litepod-16", "v2-alpha-tpuv5-lite"), ("v5p-128", "v5p-128", "v2-alpha-tpuv5"),
    ("v6e-64", "v6e-64", "v2-alpha-tpuv6e"), ("v4-32", "v4-32", "tpu-ubuntu2204-base")])
def test_launch_tpu_pod_dry_run(tmp_path, accelerator, gcloud_name, runtime):
    """The runtime follows the accelerator's family (every one got v5p's); a config written outside the
    checkout goes to the workers with the code; the job starts detached through the worker script."""
    (tmp_path / "mine.yml").write_text("base_config: base.yml\nsteps: 7\n")
    out = dry("scripts/launch_tpu_pod.sh", "--dry-run", "--tpu", "my-pod", "--zone", "us-east5-a", "--project", "p1",
              "--create", "--accelerator", accelerator, "--env", "XLA_FLAGS=--xla_dump_to=/tmp/d", "--",
              str(tmp_path / "mine.yml"), "base_output_directory=gs://bucket/runs", "steps=100")
    lines = out.strip().splitlines()
    mine = f".maxtrain_user{tmp_path}/mine.yml"
    assert lines[0].startswith("launch_tpu_pod: the code, maxtrain-") and lines[0].endswith(
        f"tracked files + {mine} (from {tmp_path}/mine.yml)")
    create, _, scp, ssh = (shlex.split(x) for x in lines[1:5])
    assert create[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "my-pod"]
    assert create[create.index("--accelerator-type") + 1] == gcloud_name
    assert create[create.index("--runtime-version") + 1] == runtime
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in scp
    assert scp[6] == str(REPO / "scripts" / "tpu_worker.sh") and scp[7] == "my-pod:~/"
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod"] and "--worker=all" in ssh
    remote = shlex.split(ssh[ssh.index("--command") + 1])
    assert remote[:5] == ["cd", "&&", "bash", "tpu_worker.sh", "start"] and "--extras=tpu" in remote
    assert "--env=XLA_FLAGS=--xla_dump_to=/tmp/d" in remote
    assert remote[remote.index("--") + 1:] == [mine, "base_output_directory=gs://bucket/runs", "steps=100"]


def test_launch_tpu_pod_multislice_dry_run():
    out = dry("scripts/launch_tpu_pod.sh", "--dry-run", "--tpu", "big", "--zone", "z", "--num-slices", "2", "--create",
              "--accelerator", "v5p-64", "--", "configs/base.yml", "base_output_directory=gs://b")
    commands = [shlex.split(x) for x in out.strip().splitlines() if not x.startswith(("launch_tpu_pod:", "#"))]
    create, describe = commands[:2]
    assert create[create.index("--node-count") + 1] == "2" and create[create.index("--node-prefix") + 1] == "big"
    assert describe[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "big-0"]
    for slice_id, ssh in enumerate(commands[3::2]):
        assert ssh[5] == f"big-{slice_id}"
        remote = shlex.split(ssh[ssh.index("--command") + 1])
        assert {"--env=MEGASCALE_COORDINATOR_ADDRESS=big-0-worker-0-ip", "--env=MEGASCALE_NUM_SLICES=2",
                f"--env=MEGASCALE_SLICE_ID={slice_id}", "--env=MEGASCALE_PORT=8080"} <= set(remote)
    assert len(commands) == 6  # create, describe; scp and ssh for each slice


@pytest.mark.parametrize("args, line", [
    ([], "config error: base_output_directory: 'outputs' is on each worker's disk, which goes with its VM: set a "
         "gs:// bucket for a pod (e.g. base_output_directory=gs://BUCKET/runs)"),
    (["base_output_directory=gs://b", "dataset_type=text", "train_files=/srv/corpus/*.txt"],
     "config error: train_files: /srv/corpus/*.txt is on this machine, which the workers cannot read: put data and "
     "tokenizers on gs:// (gcloud storage cp -r ... gs://BUCKET/...)"),
    (["base_output_directory=gs://b", "stepz=3"], "config error: stepz: unknown key; did you mean steps?"),
    (["--env", "no-equals"], "config error: --env: 'no-equals': expected KEY=VALUE"),
    (["--create"], "config error: --create: needs --accelerator (e.g. v5p-128)"),
    (["--create", "--accelerator", "v9-8"], "config error: --accelerator: 'v9-8' is not one of v4-N, v5e-N "
                                            "(v5litepod-N), v5p-N, v6e-N"),
])
def test_launch_tpu_pod_refuses_in_one_line_before_anything_runs(args, line):
    flags = [a for a in args if "=" not in a or a.startswith("--") or a == "no-equals"]
    keys = [a for a in args if a not in flags]
    proc = subprocess.run(["scripts/launch_tpu_pod.sh", "--dry-run", "--tpu", "p", "--zone", "z", *flags, "--",
                           "configs/base.yml", *keys], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (proc.returncode, proc.stdout, proc.stderr.strip()) == (2, "", line)


def test_a_config_from_outside_the_checkout_loads_on_the_worker_as_here(tmp_path):
    """The archive holds the command's config and the base_config files it extends (relative or absolute
    paths, a shipped one by name), their base_config lines pointing at the copies: unpacked elsewhere, the
    config gives the same values."""
    import tarfile
    from maxtrain.config import load as config_lib
    from maxtrain.launch import tpu_pod
    (tmp_path / "exp" / "sub").mkdir(parents=True)
    (tmp_path / "exp" / "common.yml").write_text("base_config: shakespeare.yml\nsteps: 11\nlearning_rate: 1.0e-3\n")
    (tmp_path / "exp" / "sub" / "size.yml").write_text(f"base_config: {tmp_path}/exp/common.yml\nbase_emb_dim: 96\n")
    (tmp_path / "exp" / "run.yml").write_text("base_config: sub/size.yml\nsteps: 13\n")
    config, extra = tpu_pod.user_configs(str(tmp_path / "exp" / "run.yml"))
    assert config == f".maxtrain_user{tmp_path}/exp/run.yml" and len(extra) == 3
    tarball = tpu_pod.archive(["maxtrain/configs/base.yml", "maxtrain/configs/shakespeare.yml"], extra, tmp_path)
    assert tpu_pod.archive(["maxtrain/configs/base.yml", "maxtrain/configs/shakespeare.yml"], extra,
                           tmp_path / "exp").read_bytes() == tarball.read_bytes()  # named by what it holds
    worker = tmp_path / "worker"
    with tarfile.open(tarball) as tar:
        tar.extractall(worker, filter="data")
    here = config_lib.load([str(tmp_path / "exp" / "run.yml"), "base_output_directory=gs://b"])
    there = config_lib.load([str(worker / config), "base_output_directory=gs://b"])
    assert (there.steps, there.learning_rate, there.base_emb_dim, there.eval_interval) == (13, 1e-3, 96, 100)
    assert {k: v for k, v in there.items() if k != "run_name"} == {k: v for k, v in here.items() if k != "run_name"}


@pytest.mark.slow
def test_the_tpu_worker_script_makes_its_environment_and_runs_the_job_detached(tmp_path):
    """scripts/tpu_worker.sh in a folder standing in for a TPU worker's home: a Python 3.12 environment made
    and maxtrain[tpu] installed into it, a run started detached that ends by itself, its log; a
    second start reuses the environment; a run going already is refused; stop saves and stops it."""
    import shutil
    from maxtrain.launch import tpu_pod
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    (tmp_path / "mine.yml").write_text(f"base_config: {TINY}\nlog_period: 1\n")  # outside the checkout
    config, extra = tpu_pod.user_configs(str(tmp_path / "mine.yml"))
    tarball = tpu_pod.archive(tpu_pod.tracked_files(), extra, home)
    shutil.copy(REPO / "scripts" / "tpu_worker.sh", home)
    # a worker's PATH, with a Python 3.12 on it (this one's: the script looks for python3.12 first)
    python = os.path.realpath(sys._base_executable)
    env = {"PATH": f"{os.path.dirname(python)}:/usr/bin:/bin", "HOME": str(home),
           **{k: v for k, v in os.environ.items() if k.startswith("PIP_")}}

    def worker(*args, timeout=60):
        return subprocess.run(["bash", "tpu_worker.sh", *args], cwd=home, env=env, capture_output=True, text=True,
                              timeout=timeout)

    def start(*args):
        return worker("start", f"--archive={tarball.name}", "--env=JAX_PLATFORMS=cpu", "--", config,
                      f"base_output_directory={out}", *args, timeout=900)

    def wait_for(what, seconds=300):
        for _ in range(seconds):
            log = (home / "maxtrain" / "run" / "worker.log")
            if log.exists() and re.search(what, log.read_text()):
                return
            time.sleep(1)
        raise AssertionError(f"{what!r} not in the worker's log: {worker('logs').stdout[-3000:]}")

    first = start("steps=3", "run_name=short")
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"installed maxtrain\[tpu\] into \S+/venv in \d+ s", first.stdout), first.stdout
    assert "started (pid " in first.stdout
    wait_for("done: exit code 0")
    for _ in range(30):  # the supervisor's last line, then it exits
        if "running" not in (status := worker("status").stdout):
            break
        time.sleep(1)
    assert status.endswith("stopped: exit code 0\n") and "done: 3 steps" in worker("logs").stdout
    venv_python = home / "maxtrain" / "venv" / "bin" / "python"
    assert subprocess.run([venv_python, "-c", "import sys, jax, libtpu; assert sys.version_info >= (3, 12)"],
                          capture_output=True).returncode == 0

    second = start("steps=1000000", "run_name=long", "enable_checkpointing=true", "checkpoint_period=1000000")
    assert "is up to date" in second.stdout and "installed" not in second.stdout, second.stdout
    wait_for(r"step +3/1000000 ")
    assert "running (pid" in worker("status").stdout
    again = start("steps=5")
    assert again.returncode == 2 and "a run is already going" in again.stdout
    stopped = worker("stop", timeout=200)
    assert stopped.stdout.endswith("stopped\n"), stopped.stdout
    assert worker("status").stdout.endswith("stopped: exit code 0\n")  # SIGTERM: saved, stopped, exit 0
    assert [p.name for p in (out / "long" / "checkpoints").iterdir() if p.name.isdigit()]


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
                     "model_family=mixtral", "num_experts=8", "compile_topology=v5p-128"])
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
@pytest.mark.parametrize("args,mesh", [  # v5e: the next test's; fsdp, tensor and stages over slices in one compile
    (("compile_topology=v5p-8", "compile_topology_num_slices=2", "dcn_pipeline_parallelism=2", "ici_fsdp_parallelism=2",
      "ici_tensor_parallelism=2"), "{'stage': 2, 'data': 1, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 2}"),
], ids=["v5p-8x2slices_pipeline_tensor"])
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
