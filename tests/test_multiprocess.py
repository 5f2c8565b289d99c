"""Two real processes x 4 CPU devices form one JAX job (jax.distributed, gloo, coordinator on
127.0.0.1), launched with scripts/launch_local.sh exactly as a user would."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import TINY, TESTS

REPO = TESTS.parent
LAUNCH = str(REPO / "scripts" / "launch_local.sh")
# Same math on the same devices, but the collectives run across processes: stated rtol 1e-5.
RTOL = 1e-5


def launch(tmp_path, *args, timeout=600):
    env = dict(os.environ, MAXTRAIN_LOG_DIR=str(tmp_path / "logs"), MAXTRAIN_DEVICES_PER_PROCESS="4")
    return subprocess.run([LAUNCH, "2", TINY, f"base_output_directory={tmp_path}", "log_period=1", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def losses(run_dir):
    return [json.loads(x)["train/loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("two_process,one_process", [
    (("ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2"), ("ici_fsdp_parallelism=8",)),
    (("ici_fsdp_parallelism=4", "dcn_data_parallelism=2"), ("ici_data_parallelism=2", "ici_fsdp_parallelism=4")),
], ids=["fsdp8", "dcn_data2xfsdp4"])
def test_two_processes_match_one(tmp_path, train_tiny, two_process, one_process):
    proc = launch(tmp_path, "run_name=multi", "steps=10", *two_process)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh {'data': " in proc.stdout and "done: 10 steps" in proc.stdout
    multi = losses(tmp_path / "multi")
    single = train_tiny("run_name=single", "steps=10", *one_process)["losses"]
    np.testing.assert_allclose(multi, single, rtol=RTOL)
    # Only process 0 writes logs and metrics.
    assert "step " not in (tmp_path / "logs" / "process_1.log").read_text()


@pytest.mark.slow
def test_checkpoints_move_between_two_processes_and_one(tmp_path, train_tiny):
    ckpt = ("enable_checkpointing=true", "checkpoint_period=3", "learning_rate_schedule_steps=12",
            "ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2")
    straight = train_tiny("run_name=straight", "steps=12", "learning_rate_schedule_steps=12")["losses"]
    # Saved by the two-process job, resumed by one process ...
    proc = launch(tmp_path, "run_name=a", "steps=6", *ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = train_tiny("run_name=a", "steps=9", "enable_checkpointing=true", "learning_rate_schedule_steps=12")
    np.testing.assert_allclose(resumed["losses"], straight[6:9], rtol=RTOL)
    # ... and saved by one process (at 9), resumed by the two-process job.
    proc = launch(tmp_path, "run_name=a", "steps=12", *ckpt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {tmp_path}/a/checkpoints/9" in proc.stdout
    np.testing.assert_allclose(losses(tmp_path / "a")[-3:], straight[9:12], rtol=RTOL)


@pytest.mark.slow
def test_a_dead_process_stops_the_job_within_the_heartbeat_bound(tmp_path):
    """Kill process 1 mid-run: process 0 must exit with an error, not hang. Bound: heartbeat
    timeout (10 s here) + detection and teardown; we allow 90 s."""
    env = dict(os.environ, MAXTRAIN_LOG_DIR=str(tmp_path / "logs"), MAXTRAIN_DEVICES_PER_PROCESS="4")
    proc = subprocess.Popen([LAUNCH, "2", TINY, f"base_output_directory={tmp_path}", "steps=100000",
                             "log_period=1", "distributed_heartbeat_timeout_seconds=10"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    for line in proc.stdout:
        if "step      2 |" in line:
            break
    victim = subprocess.run(["pgrep", "-f", "process_id=1"], capture_output=True, text=True).stdout.split()
    assert victim, "process 1 not found"
    os.kill(int(victim[0]), signal.SIGKILL)
    t0 = time.time()
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the surviving process did not exit within 90 s")
    assert code != 0
    print(f"job exited {time.time() - t0:.1f} s after the kill")
