"""Faults of the run's machinery: background writers on a full disk, steps far too large for memory,
and a peer process that dies or hangs. Each is one line, a non-zero exit code, within a bound."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from maxtrain.config import load as config_lib
from maxtrain.observe import fit, writers as metric_writers, summary
from maxtrain.parallel import mesh as mesh_lib
from maxtrain import train
from maxtrain.config.resolve import resolve
from conftest import TESTS, TINY, xla_flags
from helpers import Output, one_line, read_events, run_cli
from test_faults import CKPT, small_disk  # noqa: F401 (a fixture)

REPO = TESTS.parent


# ---- metrics on a full disk: the run stops with one line instead of hanging on a dead writer thread ------

def fill(disk: Path, leave: int) -> None:
    """Fills `disk` up to `leave` free bytes."""
    st = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - leave))


@pytest.mark.slow
@pytest.mark.parametrize("backends", ["jsonl,tensorboard", "jsonl"])
def test_a_full_disk_under_the_metrics_is_one_line_and_exits(small_disk, backends):
    fill(small_disk, leave=64 * 1024)  # a few hundred steps' metrics, then no space
    code, out, err, seconds = run_cli(TINY, "steps=1000000", f"metrics_backends={backends}", out=small_disk,
                                      timeout=120)
    line = one_line(err)
    assert code == 1 and line.startswith("metrics error: step "), err[-2000:]
    assert f"writing {small_disk}/tiny/" in line and line.endswith("failed: No space left on device [errno 28]")
    assert seconds < 60 and "step      20/1000000 |" in out  # it trained until the disk was full


def test_a_metrics_directory_that_cannot_be_written_is_one_line(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory goes")
    with pytest.raises(metric_writers.MetricsError, match=f"cannot write {blocker}/metrics.jsonl: "):
        metric_writers.MetricsWriter(blocker, ("tensorboard", "jsonl"))


def test_tensorboard_events_are_written_in_the_callers_thread(tmp_path):
    import threading
    before = set(threading.enumerate())  # (an earlier test's thread may end meanwhile: new ones count)
    w = metric_writers.MetricsWriter(tmp_path, ("tensorboard", "jsonl"), start_step=3)
    w.write(4, {"loss": 2.5, "nonfinite": 0.0, "grad_norm": float("nan")})
    w.write(5, {"expert_load": [[0.25, 0.75]]})
    assert not set(threading.enumerate()) - before  # no writer thread that could die or block
    w.close()
    events = read_events(next((tmp_path / "tensorboard").glob("events.out.tfevents.*")))
    assert events[0].file_version == "brain.Event:2"
    assert events[1].step == 4 and events[1].session_log.status == events[1].session_log.START  # purge_step
    scalars = [(e.step, v.tag, v.simple_value) for e in events[2:] for v in e.summary.value]
    assert scalars == [(4, "train/loss", 2.5), (4, "train/nonfinite", 0.0),
                       (5, "train/expert_load/layer_0/expert_0", 0.25), (5, "train/expert_load/layer_0/expert_1", 0.75)]


# ---- a step far too large is refused from its shapes, in seconds --------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("batch, length, expected", [
    # the command: its tokens per step overflow int32 already, a config error
    (100000, 100000, "config error: per_device_batch_size: 100000.0 x 8 devices x max_target_length 100000 = "
     "80000000000 tokens per step, out of range: at most 2147483647"),
    # within int32, far over memory: refused from the activations' lower bound
    (2000, 100000, "memory error: the train step needs at least "),
])
def test_a_huge_batch_is_refused_before_anything_is_traced(batch, length, expected, tmp_path):
    code, out, err, seconds = run_cli(TINY, f"per_device_batch_size={batch}", f"max_target_length={length}",
                                      out=tmp_path, timeout=120)
    line = one_line(err)
    assert code == 2 and line.startswith(expected), err[-2000:]
    if expected.startswith("memory"):
        assert "GiB per device for its activations (batch " in line and "layer inputs " in line, line
    assert seconds < 30  # tracing alone took ~50 s, compiling minutes more
    assert not (tmp_path / "tiny").exists()  # refused before anything was written


@pytest.mark.parametrize("argv", [
    [TINY],
    [str(config_lib.BASE_YML)],
    [str(config_lib.CONFIG_DIR / "shakespeare.yml")],
    [str(config_lib.BASE_YML), "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "remat_policy=minimal"],
    [str(config_lib.BASE_YML), "model_name=125m"],
    [str(config_lib.BASE_YML), "model_name=mixtral-tiny", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
], ids=["tiny", "base", "shakespeare", "fsdp4xtensor2", "125m", "mixtral-tiny"])
def test_the_readme_examples_pass_the_activation_check(argv):
    c = train.load_config(argv)
    fit.check_activations(c, mesh_lib.make_mesh(c, jax.devices()))


# docs/scaling.md's TPU table ("Per-chip memory from that plain command"): what XLA planned per chip, GiB.
README_TPU_ROWS = [
    ("llama2-7b", 64, ("per_device_batch_size=4", "max_target_length=4096"), 10.96),
    ("llama3-8b", 64, ("per_device_batch_size=4", "max_target_length=8192"), 17.50),
    ("llama3-8b", 64, ("per_device_batch_size=0.0625", "max_target_length=131072", "ici_context_parallelism=16",
                       "ici_fsdp_parallelism=4"), 8.03),
    ("mixtral-8x7b", 64, ("per_device_batch_size=4", "max_target_length=4096"), 30.17),
    ("mixtral-8x7b", 64, ("per_device_batch_size=4", "max_target_length=4096", "ici_expert_parallelism=8",
                          "ici_fsdp_parallelism=8"), 23.89),
    ("llama2-7b", 256, ("per_device_batch_size=4", "max_target_length=4096"), 9.35),
    ("llama3-8b", 256, ("per_device_batch_size=2", "max_target_length=8192"), 9.99),
]


@pytest.mark.parametrize("model, chips, overrides, planned", README_TPU_ROWS)
def test_the_floor_is_below_what_xla_planned_for_the_presets(model, chips, overrides, planned):
    c = resolve(config_lib.load([str(config_lib.BASE_YML), f"model_name={model}", *overrides]),
                              chips, 1, "tpu")
    state = c.num_params * (4 + 4 + 4) / chips  # float32 weights and Adam moments, split over every chip
    assert (state + sum(fit.step_floor(c).values())) / fit.GiB < planned


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("remat_policy=none", "scan_layers=false"),
    ("dtype=bfloat16", "logits_dot_in_fp32=false", "per_device_batch_size=4", "gradient_accumulation_steps=2",
     "max_target_length=128"),
    ("per_device_batch_size=2", "max_target_length=512", "vocab_size=4096"),
    ("ici_context_parallelism=4", "ici_fsdp_parallelism=2", "max_target_length=256"),
    ("model_family=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=64", "per_device_batch_size=4"),
], ids=["no_remat_unscanned", "bf16_logits_accumulation", "long_wide_vocab", "context4", "moe"])
def test_the_floor_is_below_the_compiled_step(tiny_config, overrides):
    c = tiny_config(*overrides)
    trainer = train.step_lib.build(c, mesh_lib.make_mesh(c, jax.devices()))
    state = sum(summary.shard_bytes(x) for x in jax.tree.leaves(trainer.abstract_state))
    compiled = summary.memory_report(trainer.compile_train_step())["total"] * fit.GiB
    assert state + sum(fit.step_floor(c).values()) <= compiled


# ---- a peer that dies or hangs: the survivor says which, and the last checkpoint, in one line ----------

FSDP8_2P = ("ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2")
HEARTBEAT = 10


def start_job(out: Path, *args) -> list[subprocess.Popen]:
    """Two processes x 4 CPU devices as scripts/launch_local.sh starts them, each one's pipes our own."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu")
    return [subprocess.Popen([os.sys.executable, "-m", "maxtrain.train", TINY, f"base_output_directory={out}", *args,
                              f"coordinator_address=127.0.0.1:{port}", "num_processes=2", f"process_id={i}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
            for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("victim, sig, went_away", [
    (1, signal.SIGKILL, f"process 1 of 2 went away (no heartbeat for distributed_heartbeat_timeout_seconds={HEARTBEAT})"),
    (1, signal.SIGSTOP, f"process 1 of 2 went away (no heartbeat for distributed_heartbeat_timeout_seconds={HEARTBEAT})"),
    (0, signal.SIGKILL, "process 0 of 2 (the coordinator) went away"),
], ids=["dead", "hung", "coordinator_dead"])
def test_a_lost_peer_is_one_line_naming_it_and_the_last_checkpoint(tmp_path, victim, sig, went_away):
    procs = start_job(tmp_path, *FSDP8_2P, *CKPT, "checkpoint_period=2", "steps=100000",
                      f"distributed_heartbeat_timeout_seconds={HEARTBEAT}")
    outputs = [Output(p) for p in procs]  # both processes' pipes drained: neither blocks on a full one
    try:
        outputs[0].wait_for(re.escape("step      5/100000 |"), timeout=300)
        ckpts = tmp_path / "tiny" / "checkpoints"
        deadline = time.time() + 60
        while not any(p.name.isdigit() for p in ckpts.iterdir()) and time.time() < deadline:
            time.sleep(0.2)
        # The training process itself (the command's process supervises it), as an OOM kill or a hang hits it
        trainer = subprocess.run(["pgrep", "-P", str(procs[victim].pid)], capture_output=True, text=True).stdout
        os.kill(int(trainer.split()[0]), sig)
        t0 = time.time()
        code, _, err = outputs[1 - victim].finish(timeout=HEARTBEAT + 60)
        seconds = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)  # its child goes with it
    line = one_line(err)
    from maxtrain.checkpoint.trust import Trust
    trusted = Trust(ckpts, 0.0).newest_trusted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert trusted is not None  # checkpoints 2 and 4 were judged by steps 3 and 5
    # a killed peer: gloo may see its socket close before the service misses a heartbeat, or read what the
    # killed peer left in its socket cut short (seen in CI: "op.preamble.length <= op.nbytes. 4096 vs 4")
    closed = f"process {victim} of 2 went away (its connection closed during a collective)"
    cut = f"process {victim} of 2 went away (a collective's message from it was cut short)"
    killed = (closed, cut) if sig == signal.SIGKILL else ()
    assert code == 1 and line in (
        f"run error: {reason}: this process stopped too; last trusted checkpoint: step {trusted} in {ckpts}"
        for reason in (went_away, *killed)), err[-3000:]
    assert seconds < HEARTBEAT + 30, seconds


GLOO_ABORT = """
import os, sys
print("step 5 | loss 5.0", flush=True)
sys.stderr.write("terminate called after throwing an instance of 'gloo::EnforceNotMet'\\n"
                 "  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:539] {what}\\n")
sys.stderr.flush()
os.abort()
"""
PAIR = "[enforce fail at external/gloo/gloo/transport/tcp/pair.cc:539]"


@pytest.mark.parametrize("what, reason", [
    ("Connection closed by peer [127.0.0.1]:40123",
     "process 1 of 2 went away (its connection closed during a collective)"),
    ("op.preamble.length <= op.nbytes. 16 vs 4. Received data size doesn't match expected size. Is there a "
     "distributed collective mismatch in your code?",  # what a survivor saw of a peer killed with -9
     "process 1 of 2 went away (a collective's message from it was cut short)"),
    ("Timed out waiting 1800000ms for recv operation to complete",
     f"a collective failed (gloo: {PAIR} Timed out waiting 1800000ms for recv operation to complete)"),
], ids=["peer_closed", "peer_cut", "other"])
def test_gloos_abort_in_a_collective_is_one_line(tmp_path, what, reason):
    """Under load gloo can notice a killed peer before the coordination service does: its exception ends
    the child through std::terminate. The survivor says which peer went away (or, for gloo's other
    failures, gloo's own words), in one line. The supervisor runs in a process of its own, as a user's does:
    its fork (preexec_fn) in this test's process, which JAX has made multithreaded, could deadlock."""
    args = [TINY, f"base_output_directory={tmp_path}", "num_processes=2", "process_id=0",
            "coordinator_address=127.0.0.1:1"]
    supervisor = (
        "import sys\n"
        "from maxtrain.config import load\n"
        "from maxtrain.launch import distributed\n"
        f"c = load.load({args!r})\n"
        f"sys.orig_argv = [sys.executable, '-c', {GLOO_ABORT.replace('{what}', what)!r}]\n"
        "sys.exit(distributed._run_child(c))\n")
    done = subprocess.run([sys.executable, "-c", supervisor], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "step 5 | loss 5.0" in done.stdout, done.stderr[-2000:]
    assert one_line(done.stderr) == f"run error: {reason}: this process stopped too; checkpointing is off", done.stderr


@pytest.mark.slow
def test_every_process_refusing_the_config_exits_2_with_its_line(tmp_path):
    """Process 0 hosts the coordination service: when it left first, process 1 aborted natively (134). Twice:
    which leaves first is a race."""
    for _ in range(2):
        procs = start_job(tmp_path, "dataset_type=text", "vocab_size=384", f"train_files={REPO}/data/tinyshakespeare.txt",
                          "num_epochs=1")
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 2 and one_line(err).startswith("config error: num_epochs: 1: streamed files with several processes"), err


def test_a_writer_made_again_within_the_second_keeps_the_first_events(tmp_path):
    # A rollback makes a new writer; in the same second it must not truncate the first one's event file.
    first = metric_writers.MetricsWriter(tmp_path, ("tensorboard", "jsonl"), start_step=0)
    for step in range(1, 6):
        first.write(step, {"loss": 1.0 / step})
    first.close()
    events = sorted((tmp_path / "tensorboard").iterdir())
    size = events[0].stat().st_size
    again = metric_writers.MetricsWriter(tmp_path, ("tensorboard", "jsonl"), start_step=2)
    again.write(3, {"loss": 0.5})
    again.close()
    after = sorted((tmp_path / "tensorboard").iterdir())
    assert len(after) == 2 and after[0] == events[0] and after[0].stat().st_size == size
