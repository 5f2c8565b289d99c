"""Checkpoints: exact resume, restore across meshes, SIGTERM, kill -9 at random moments, bad paths."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import SHAKESPEARE, TESTS, TINY, xla_flags

CKPT = ("enable_checkpointing=true", "learning_rate_schedule_steps=20")
FSDP8 = ("ici_fsdp_parallelism=8",)


def params_equal_bitwise(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.slow
def test_exact_resume_matches_straight_run(train_tiny, tmp_path):
    straight = train_tiny(*CKPT, *FSDP8, "run_name=straight", "steps=20")
    first = train_tiny(*CKPT, *FSDP8, "run_name=resumed", "steps=10", "checkpoint_period=5")
    assert first["losses"] == straight["losses"][:10]
    assert sorted(int(p.name) for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.isdigit()) == [5, 10]
    resumed = train_tiny(*CKPT, *FSDP8, "run_name=resumed", "steps=20", "checkpoint_period=5")
    assert int(resumed["state"].step) == 20
    assert resumed["losses"] == straight["losses"][10:]  # identical, not merely close
    assert params_equal_bitwise(resumed["state"].params, straight["state"].params)
    assert params_equal_bitwise(resumed["state"].opt_state, straight["state"].opt_state)


@pytest.mark.slow
def test_exact_resume_with_the_text_pipeline(train_tiny):
    """Same, reading Tiny Shakespeare through grain: the iterator state is in the checkpoint."""
    text = ("dataset_type=text", f"train_files={TESTS.parent / 'data' / 'tinyshakespeare.txt'}",
            "vocab_size=384", "eval_split_fraction=0.1", "max_target_length=64")
    straight = train_tiny(*CKPT, *FSDP8, *text, "run_name=straight", "steps=20")
    train_tiny(*CKPT, *FSDP8, *text, "run_name=resumed", "steps=10", "checkpoint_period=5")
    resumed = train_tiny(*CKPT, *FSDP8, *text, "run_name=resumed", "steps=20", "checkpoint_period=5")
    assert resumed["losses"] == straight["losses"][10:]
    assert params_equal_bitwise(resumed["state"].params, straight["state"].params)


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once(train_tiny, tmp_path):
    # Checkpoints at 3 and 5; without the one at 5 (as if killed before it), a rerun resumes from 3
    # and logs 4 and 5 again: the first attempt's lines for them must go.
    train_tiny(*CKPT, "run_name=again", "steps=5", "checkpoint_period=3", "metrics_backends=jsonl,tensorboard")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "5")
    with open(tmp_path / "again" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')  # and a line cut short by the kill
    train_tiny(*CKPT, "run_name=again", "steps=6", "checkpoint_period=3", "metrics_backends=jsonl,tensorboard")
    rows = [json.loads(x) for x in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "start" not in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "start" in r] == [0, 3]  # each start's record, the resume's at its step


@pytest.mark.slow
def test_the_end_of_the_data_is_saved_and_evaluated(train_tiny, tmp_path):
    # 40 short documents, one epoch: the data ends long before `steps`, between checkpoints and evals.
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(40)))
    args = (*CKPT, "dataset_type=text", f"train_files={docs}", "vocab_size=384", "max_target_length=16",
            "eval_split_fraction=0.2", "num_epochs=1", "steps=1000", "checkpoint_period=1000", "eval_interval=1000")
    out = train_tiny(*args, "run_name=ends")
    last = len(out["losses"])
    assert 0 < last < 1000 and int(out["state"].step) == last
    assert (tmp_path / "ends" / "checkpoints" / str(last) / "state").is_dir()
    assert len(out["eval_losses"]) == 1
    # A rerun resumes there and has nothing left to read.
    again = train_tiny(*args, "run_name=ends")
    assert again["losses"] == [] and int(again["state"].step) == last


@pytest.mark.slow
def test_restore_onto_a_different_mesh(train_tiny):
    straight = train_tiny(*CKPT, *FSDP8, "run_name=a", "steps=12")
    train_tiny(*CKPT, *FSDP8, "run_name=b", "steps=10")
    other_mesh = train_tiny(*CKPT, "run_name=b", "steps=12", "ici_data_parallelism=2", "ici_fsdp_parallelism=4")
    # Different collectives sum in a different order: equal to float32 rounding (stated rtol 1e-5).
    np.testing.assert_allclose(other_mesh["losses"], straight["losses"][10:], rtol=1e-5)


@pytest.mark.slow
def test_restore_on_one_device_from_eight(train_tiny):
    train_tiny(*CKPT, *FSDP8, "run_name=c", "steps=10")
    single = train_tiny(*CKPT, "run_name=c", "steps=11", "per_device_batch_size=8", n_devices=1)
    assert len(single["losses"]) == 1 and np.isfinite(single["losses"][0])


@pytest.mark.slow
def test_load_parameters_path_starts_a_fresh_optimizer(train_tiny, tmp_path):
    src = train_tiny(*CKPT, "run_name=src", "steps=10")
    fresh = train_tiny("run_name=dst", "steps=1", f"load_parameters_path={tmp_path}/src/checkpoints/10")
    assert int(fresh["state"].step) == 1
    assert fresh["losses"][0] < src["losses"][0]
    # The full state goes on with the source's data position too: step 11 is the one the source itself runs next.
    cont = train_tiny("run_name=dst2", "steps=11", f"load_full_state_path={tmp_path}/src/checkpoints/10",
                      "learning_rate_schedule_steps=20")
    assert int(cont["state"].step) == 11
    resumed = train_tiny(*CKPT, "run_name=src", "steps=11")
    np.testing.assert_allclose(cont["losses"][0], resumed["losses"][0], rtol=1e-6)


# ---- through the CLI, as a user (or a preempted job) runs it ------------------------------------

def cli(*args, out):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8))
    return subprocess.Popen([sys.executable, "-m", "maxtrain.train", TINY, f"base_output_directory={out}",
                             "enable_checkpointing=true", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=TESTS.parent)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def saved_params(step_dir: Path):
    return ocp.PyTreeCheckpointer().restore(step_dir / "state")["params"]


def wait_for_line(proc, text, timeout=120):
    deadline = time.time() + timeout
    lines = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:  # the process ended without printing it
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} not seen in {lines}")


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero_then_resumes(tmp_path):
    proc = cli("steps=100000", "checkpoint_period=100000", "log_period=1", out=tmp_path)
    wait_for_line(proc, "step      3/100000 |")
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == 0, err[-2000:]
    line = [x for x in out.splitlines() if "stopped by SIGTERM" in x][0]
    step = int(line.split("after step ")[1].split(":")[0])
    assert "checkpoint saved" in line and (tmp_path / "tiny" / "checkpoints" / str(step) / "state").is_dir()
    code, out, err = finish(cli(f"steps={step + 2}", "log_period=1", out=tmp_path))
    assert code == 0, err[-2000:]
    assert f"resumed from {tmp_path}/tiny/checkpoints/{step}" in out and f"step {step + 2}/{step + 2} |" in out


@pytest.mark.slow
def test_kill_9_at_random_moments_resumes_to_the_same_params(tmp_path):
    args = ("steps=24", "checkpoint_period=2", "log_period=1", "max_num_checkpoints_to_keep=2")
    code, _, err = finish(cli(*args, "run_name=reference", out=tmp_path))
    assert code == 0, err[-2000:]
    rng = random.Random(0)
    kills = 0
    for attempt in range(8):
        proc = cli(*args, "run_name=killed", out=tmp_path)
        if kills < 2:  # the goodput test kills a two-process job twice more
            wait_for_line(proc, "first step")
            time.sleep(rng.uniform(0.0, 1.5))  # somewhere in training, often mid async save
            if proc.poll() is None:
                proc.kill()
                kills += 1
            finish(proc)
            continue
        code, out, err = finish(proc)
        assert code == 0, err[-2000:]
        break
    assert kills == 2
    ckpts = tmp_path / "killed" / "checkpoints"
    assert params_equal_bitwise(saved_params(ckpts / "24"), saved_params(tmp_path / "reference" / "checkpoints" / "24"))


@pytest.mark.slow
def test_interrupted_save_is_skipped_with_a_warning(tmp_path):
    code, _, err = finish(cli("steps=4", "checkpoint_period=2", out=tmp_path))
    assert code == 0, err[-2000:]
    ckpts = tmp_path / "tiny" / "checkpoints"
    # What a kill during the save of step 6 leaves: a temporary directory with part of the files.
    partial = ckpts / "6.orbax-checkpoint-tmp-1700000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\0" * 100)
    code, out, err = finish(cli("steps=6", "checkpoint_period=2", "log_period=1", out=tmp_path))
    assert code == 0, err[-2000:]
    assert "ignoring incomplete checkpoint 6.orbax-checkpoint-tmp" in out
    assert f"resumed from {ckpts}/4" in out and (ckpts / "6" / "state").is_dir()


@pytest.mark.slow
def test_bad_checkpoints_give_one_line_and_exit_2(tmp_path):
    v384 = "vocab_size=384"  # the byte tokenizer's: the text pipeline below resumes this run too
    code, _, err = finish(cli("steps=2", v384, out=tmp_path))
    assert code == 0, err[-2000:]
    # A different model shape under the same run name.
    code, out, err = finish(cli("steps=4", v384, "base_emb_dim=32", out=tmp_path))
    assert code == 2 and err.strip().startswith("checkpoint error:") and "base_emb_dim (checkpoint 64, config 32)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    # Another optimizer chain (no clipping) under the same run name: the saved state does not fit.
    code, out, err = finish(cli("steps=4", v384, "gradient_clipping_threshold=0", out=tmp_path))
    assert code == 2 and "cannot resume this run with this config" in err, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    # Another input pipeline: the saved data position (synthetic) does not fit grain's.
    code, out, err = finish(cli("steps=4", v384, "dataset_type=text", f"train_files={SHAKESPEARE}", out=tmp_path))
    assert code == 2 and "data position" in err and "Traceback" not in err, err[-2000:]
    # A path that does not exist.
    code, out, err = finish(cli("run_name=x", f"load_parameters_path={tmp_path}/nope", out=tmp_path))
    assert code == 2 and "load_parameters_path:" in err and "Traceback" not in err
    # A corrupt checkpoint: state files overwritten with junk.
    step = tmp_path / "tiny" / "checkpoints" / "2"
    for f in (step / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"junk")
    code, out, err = finish(cli("run_name=y", v384, f"load_full_state_path={step}", out=tmp_path))
    assert code == 2 and err.strip().startswith("checkpoint error: load_full_state_path:"), err[-2000:]
    assert "Traceback" not in err


@pytest.mark.slow
def test_the_saved_line_counts_the_whole_save(train_tiny, monkeypatch, capsys):
    """The state's checksums (its copy to the host) are part of the save the heartbeat calls `still saving`:
    the `saved checkpoint` line's time includes them."""
    import time
    from maxtrain.checkpoint import manager
    slow = manager.digest
    monkeypatch.setattr(manager, "digest", lambda state: (time.sleep(1.5), slow(state))[1])
    train_tiny(*CKPT, "steps=2", "checkpoint_period=2", n_devices=1)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("saved checkpoint 2 ("))
    assert float(line.split("(")[1].split(" s,")[0]) >= 1.5, line
