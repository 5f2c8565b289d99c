"""The local checkpoint tier (maxtrain/checkpoint/local.py) and the one restore that picks a step of either tier
(Checkpointer.restore): newest first, bit for bit, damaged or foreign copies passed over in one line, a
replaced host's shards from its peers."""

import re
import shutil
import subprocess
import sys
import os

import jax
import numpy as np
import pytest

from conftest import TINY, TESTS, tmpfs
from helpers import main_in_process, one_line, saved_arrays

LAUNCH = str(TESTS.parent / "scripts" / "launch_local.sh")


def tiers(tmp_path, *more, local=True):
    """Local every 2 steps, persistent every 5, one schedule whatever `steps` is."""
    return ("enable_checkpointing=true", "checkpoint_period=5", "learning_rate_schedule_steps=9", *more,
            *([f"local_checkpoint_directory={tmp_path / 'local'}", "local_checkpoint_period=2"] if local else []),
            *([] if any(x.startswith("run_name=") for x in more) else ["run_name=r"]))


def same_bits(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def flip_a_byte(path, at=1000):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


def test_a_start_restores_the_newest_step_of_either_tier_bit_for_bit(tmp_path, train_tiny, capsys):
    reference = train_tiny("steps=9", "learning_rate_schedule_steps=9", "run_name=reference")
    train_tiny(*tiers(tmp_path, "steps=7"))  # local 4, 6 (the newest two); persistent 5, 7
    local = tmp_path / "local" / "r" / "process_0"
    assert sorted(p.name for p in local.iterdir()) == ["4", "6"]
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "7")  # as if the job died before its last save
    train_tiny(*tiers(tmp_path, "steps=7"))  # resumed at its last step: the persistent tier gets it too
    assert (tmp_path / "r" / "checkpoints" / "7" / "state").is_dir()
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "7")
    capsys.readouterr()
    resumed = train_tiny(*tiers(tmp_path, "steps=9"))
    out = capsys.readouterr().out
    assert f"resumed from step 6 of the local tier ({local}/6): newer than the persistent tier's newest step, 5\n" in out
    assert len(resumed["losses"]) == 3 and same_bits(resumed["state"].params, reference["state"].params)
    assert same_bits(resumed["state"].opt_state, reference["state"].opt_state)

    # the persistent tier holds the same step: the local copy is read
    train_tiny(*tiers(tmp_path, "steps=10"))
    assert "resumed from step 9 of the local tier" not in capsys.readouterr().out  # 9 is not a local step
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "10")
    train_tiny(*tiers(tmp_path, "steps=10"))
    assert re.search(r"resumed from step 10 of the local tier \(.*/10\): the persistent tier holds it too; the "
                     r"local copy is faster to read|resumed from step 10 of the local tier .*: newer than",
                     capsys.readouterr().out)


def test_a_damaged_or_foreign_local_copy_is_passed_over_in_one_line(tmp_path, train_tiny, capsys):
    train_tiny(*tiers(tmp_path, "steps=7"))
    local = tmp_path / "local" / "r" / "process_0"
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "7")
    flip_a_byte(local / "6" / "shards.bin")
    capsys.readouterr()
    train_tiny(*tiers(tmp_path, "steps=7"))
    out = capsys.readouterr().out
    why = r"\.params\['[a-z_]+'\].*: its bytes do not match their CRC-32"
    assert re.search(rf"warning: local checkpoint 6 \({tmp_path}/local/r\) is unusable \({why}\); resuming from step "
                     rf"5 instead \(each process's copy moved to 6.unusable\)\n", out), out
    assert re.search(rf"resumed from step 5 of the persistent tier \({tmp_path}/r/checkpoints/5\): the local tier's "
                     rf"step 6 is unusable \({why}\)\n", out), out
    assert (local / "6").is_dir() and (local / "6.unusable").is_dir()  # the step trained again, saved again

    # a copy written on another mesh (fsdp 8 -> fsdp 4 x tensor 2) is not read; the persistent step is
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "7")
    train_tiny(*tiers(tmp_path, "steps=7", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"))
    out = capsys.readouterr().out
    assert re.search(r"resumed from step 5 of the persistent tier .*: the local tier's step 6 is unusable \(written on "
                     r"another mesh \(1 processes, mesh \[1, 1, 8, 1, 1, 1\]\)\)", out), out


def test_a_full_local_disk_stops_the_local_copies_and_the_run_goes_on(tmp_path, train_tiny, capsys):
    with tmpfs(tmp_path / "ram", "size=256k") as ram:  # a tiny state's shards are about 1 MB
        result = train_tiny(*tiers(tmp_path, "steps=6", f"local_checkpoint_directory={ram}",
                                   "local_checkpoint_period=2", local=False))
        out = capsys.readouterr().out
        assert len(re.findall(r"warning: process 0: a local checkpoint could not be written", out)) == 1, out
        assert re.search(rf"to {ram}/r/process_0: No space left on device \[errno 28\]; this process keeps no more "
                         r"local copies in this run \(the persistent tier goes on\)", out)
        assert len(result["losses"]) == 6 and (tmp_path / "r" / "checkpoints" / "6" / "state").is_dir()
        assert not list((ram / "r" / "process_0").iterdir())  # no half-written copy left


@pytest.mark.parametrize("overrides, expected", [
    (["local_checkpoint_period=10"], "config error: local_checkpoint_period: needs local_checkpoint_directory"),
    (["local_checkpoint_directory=gs://b/x", "local_checkpoint_period=10"],
     "config error: local_checkpoint_directory: gs://b/x: must be a path on each host's own disk"),
    (["local_checkpoint_directory=/tmp/x"], "config error: local_checkpoint_directory: needs local_checkpoint_period"),
    (["local_checkpoint_directory=/tmp/x", "local_checkpoint_period=-1"],
     "config error: local_checkpoint_period: must be >= 0"),
    (["local_checkpoint_directory=/tmp/x", "local_checkpoint_period=10", "enable_checkpointing=false"],
     "config error: local_checkpoint_directory: needs enable_checkpointing=true"),
])
def test_bad_local_tier_keys_are_one_line(overrides, expected, capsys):
    code, err = main_in_process([TINY, "enable_checkpointing=true", *overrides], capsys)
    assert code == 2 and one_line(err).startswith(expected), err


def test_a_local_directory_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("in the way")
    done = subprocess.run([sys.executable, "-m", "maxtrain.train", TINY, f"base_output_directory={tmp_path}",
                           "enable_checkpointing=true", f"local_checkpoint_directory={tmp_path / 'file'}",
                           "local_checkpoint_period=2", "steps=2"], capture_output=True, text=True, timeout=300,
                          cwd=TESTS.parent)
    assert done.returncode == 2, done.stderr[-2000:]
    assert one_line(done.stderr).startswith(f"config error: local_checkpoint_directory: cannot write {tmp_path}/file: ")
    assert not (tmp_path / "tiny").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout, peers", [("dcn_data_parallelism=2", True), ("dcn_fsdp_parallelism=2", False)])
def test_a_replaced_host_gets_its_local_shards_from_a_peer(tmp_path, layout, peers):
    """Two processes; process 1's local copies are lost (a replaced host). With data-parallel replicas across
    processes the job still resumes from the newest local step, bit for bit (against a job never interrupted);
    without, every process from the persistent tier's step (the persistent tier's exact resume is tested apart)."""
    env = dict(os.environ, MAXTRAIN_LOG_DIR=str(tmp_path / "logs"), MAXTRAIN_DEVICES_PER_PROCESS="4",
               PYTHON=sys.executable)

    def launch(*more, local=True):
        done = subprocess.run([LAUNCH, "2", TINY, f"base_output_directory={tmp_path}", "ici_fsdp_parallelism=4",
                               layout, *tiers(tmp_path, *more, local=local)], capture_output=True, text=True, env=env,
                              cwd=TESTS.parent, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout
    if peers:
        launch("steps=9", "run_name=reference", local=False)
    launch("steps=7")
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "7")
    shutil.rmtree(tmp_path / "local" / "r" / "process_1")
    out = launch("steps=9")
    if peers:
        assert (f"resumed from step 6 of the local tier ({tmp_path}/local/r/process_*/6): newer than the persistent "
                "tier's newest step, 5; process 1 could not read its copy (missing or damaged): the shards came from "
                "other processes' replicas\n") in out, out
    else:
        assert re.search(r"resumed from step 5 of the persistent tier \(.*\): the local tier's step 6 is unusable "
                         r"\(processes \[1\] could not read their copies and the mesh holds no replica of their shards "
                         r"on another process; \d+ arrays differ from their checksums", out), out
        return
    ours, reference = (saved_arrays(tmp_path / run / "checkpoints" / "9" / "state") for run in ("r", "reference"))
    assert same_bits(ours, reference)


@pytest.mark.parametrize("damage, why", [
    ("truncate", r"shards\.bin ends before \.opt_state\S+'s bytes \(truncated\)"),
    ("garbage index", "cannot read its index: UnicodeDecodeError"),
    ("no shards", "cannot read its shards: FileNotFoundError"),
    ("foreign index", "its index is not what maxtrain writes"),
])
def test_damaged_local_files_fall_back_to_the_persistent_step(tmp_path, train_tiny, capsys, damage, why):
    train_tiny(*tiers(tmp_path, "steps=7"))
    newest = tmp_path / "local" / "r" / "process_0" / "6"
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "7")
    (newest.parent / "8.partial").mkdir()  # a save cut short by a kill: removed, never read
    if damage == "truncate":
        os.truncate(newest / "shards.bin", (newest / "shards.bin").stat().st_size // 2)
    elif damage == "garbage index":
        (newest / "index.json").write_bytes(b"\x00\xff garbage")
    elif damage == "no shards":
        (newest / "shards.bin").unlink()
    else:
        (newest / "index.json").write_text('{"format": 99}')
    capsys.readouterr()
    result = train_tiny(*tiers(tmp_path, "steps=7"))
    out = capsys.readouterr().out
    assert re.search(rf"resumed from step 5 of the persistent tier \(.*\): the local tier's step 6 is unusable \({why}",
                     out), out
    assert len(result["losses"]) == 2 and not (newest.parent / "8.partial").exists()
    assert (newest.parent / "6.unusable").is_dir()


def test_a_rollback_goes_back_to_the_newest_local_copy_it_trusts(tmp_path, train_tiny, monkeypatch, capsys):
    """Batch 8 (step 9, the first on local copy 8's parameters) is poisoned: copy 8 is rejected, the rollback
    goes back to local copy 6 and skips the batches of steps 7-9, as a run that never saw them."""
    from test_faults import Poisoned, Skipping, stream
    args = (*tiers(tmp_path, "steps=12", "nan_policy=rollback"), "learning_rate_schedule_steps=12")
    args = tuple(a for a in args if a != "learning_rate_schedule_steps=9")
    stream(monkeypatch, Poisoned, [8])
    rolled = train_tiny(*args)
    out = capsys.readouterr().out
    assert "rollback: step 9 was not finite (1 of max_nonfinite_steps=10); back at step 6, skipping the 3 batches " \
        "after it" in out, out
    assert re.search(r"warning: checkpoint 8 in \S+ is not trusted \(step 8: step 9, the first on its parameters, was "
                     r"not finite\); resuming from step 6 instead \(kept aside as local 8.untrusted\)", out), out
    stream(monkeypatch, Skipping, [6, 7, 8])
    reference = train_tiny(*(a for a in args if not a.startswith("local_checkpoint")), "run_name=reference")
    assert rolled["losses"] == reference["losses"]  # identical, not close


def test_local_copies_of_a_run_whose_outputs_were_deleted_are_not_resumed(tmp_path, train_tiny, capsys):
    train_tiny(*tiers(tmp_path, "steps=7"))
    shutil.rmtree(tmp_path / "r")  # the user deletes the run's outputs to start it afresh
    capsys.readouterr()
    result = train_tiny(*tiers(tmp_path, "steps=3"))
    out = capsys.readouterr().out
    assert len(result["losses"]) == 3 and "resumed from" not in out, out
    assert f"warning: local checkpoint 6 ({tmp_path}/local/r) is unusable (written by an earlier run named r whose " \
           "outputs are gone); starting from the beginning (each process's copy moved to 6.unusable)" in out, out


def test_a_local_copy_of_another_model_or_optimizer_is_one_line(tmp_path, train_tiny):
    from maxtrain.checkpoint.describe import CheckpointError
    train_tiny(*tiers(tmp_path, "steps=7"))
    shutil.rmtree(tmp_path / "r" / "checkpoints")  # only the local copies are left to resume from
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/local/r: local step 6: model shape differs: base_mlp_dim "
                       r"\(checkpoint 128, config 192\); run_name=r is another model's run"):
        train_tiny(*tiers(tmp_path, "steps=7", "base_mlp_dim=192"))
    with pytest.raises(CheckpointError, match=r"local step 6: \.opt_state\S+ is float32\[256, 64\] in the checkpoint, "
                       r"bfloat16\[256, 64\] in this config \(an optimizer, dtype or shape change\); cannot resume"):
        train_tiny(*tiers(tmp_path, "steps=7", "mu_dtype=bfloat16"))


def test_a_local_directory_gone_at_restart_resumes_from_the_persistent_tier(tmp_path, train_tiny, capsys):
    train_tiny(*tiers(tmp_path, "steps=7"))
    shutil.rmtree(tmp_path / "local")  # the host's RAM disk went with its VM
    capsys.readouterr()
    train_tiny(*tiers(tmp_path, "steps=9"))
    assert f"resumed from step 7 of the persistent tier ({tmp_path}/r/checkpoints/7): the local tier holds no newer " \
           "step\n" in capsys.readouterr().out
