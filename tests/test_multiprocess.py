"""Two real processes x 4 CPU devices form one JAX job (jax.distributed, gloo, coordinator on
127.0.0.1), launched with scripts/launch_local.sh exactly as a user would."""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import SHAKESPEARE, TINY, TESTS
from helpers import Output

REPO = TESTS.parent
LAUNCH = str(REPO / "scripts" / "launch_local.sh")
# Same math on the same devices, but the collectives run across processes: stated rtol 1e-5.
RTOL = 1e-5
TEXT = ("dataset_type=text", f"train_files={SHAKESPEARE}", "vocab_size=384")


def launch_env(tmp_path):
    # PYTHON: the interpreter running the tests, not whichever `python` PATH finds (a venv not activated)
    return dict(os.environ, MAXTRAIN_LOG_DIR=str(tmp_path / "logs"), MAXTRAIN_DEVICES_PER_PROCESS="4",
                PYTHON=sys.executable)


def launch(tmp_path, *args, timeout=600, env=None):
    """The launcher's result; past `timeout`, a failed one (returncode None) with what the job printed by then and
    process 1's log, so the assertion that follows says where it stood."""
    env = {**launch_env(tmp_path), **(env or {})}
    command = [LAUNCH, "2", TINY, f"base_output_directory={tmp_path}", "log_period=1", *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        text = lambda out: out.decode(errors="replace") if isinstance(out, bytes) else out or ""  # noqa: E731
        log = tmp_path / "logs" / "process_1.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        process_1 = "\n".join(x for x in lines if not x.startswith("[Gloo]"))[-2000:]
        return subprocess.CompletedProcess(command, None, text(e.stdout), f"timed out after {timeout} s\n"
                                           f"{text(e.stderr)}\n--- process_1.log:\n{process_1}")


def losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("two_process,one_process", [
    # fsdp across the processes is test_checkpoints_move_between_two_processes_and_one's mesh
    (("ici_fsdp_parallelism=4", "dcn_data_parallelism=2"), ("ici_data_parallelism=2", "ici_fsdp_parallelism=4")),
    # Context across the processes, with text: the two split every row's positions, so both read the same documents.
    (("ici_context_parallelism=4", "ici_fsdp_parallelism=1", "dcn_data_parallelism=1", "dcn_context_parallelism=2",
      *TEXT), ("ici_context_parallelism=8", "ici_fsdp_parallelism=1", *TEXT)),
    # The pipeline's stages across the processes: only activations cross between them.
    (("ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_pipeline_parallelism=2", "base_num_decoder_layers=4",
      "num_pipeline_microbatches=4", "num_pipeline_repeats=2", "per_device_batch_size=2"),
     ("ici_fsdp_parallelism=4", "ici_pipeline_parallelism=2", "base_num_decoder_layers=4",
      "num_pipeline_microbatches=4", "num_pipeline_repeats=2", "per_device_batch_size=2")),
], ids=["dcn_data2xfsdp4", "dcn_context2_text", "dcn_pipeline2xfsdp4"])
def test_two_processes_match_one(tmp_path, train_tiny, two_process, one_process):
    proc = launch(tmp_path, "run_name=multi", "steps=10", *two_process)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh {'stage': " in proc.stdout and "done: 10 steps" in proc.stdout
    multi = losses(tmp_path / "multi")
    single = train_tiny("run_name=single", "steps=10", *one_process)["losses"]
    np.testing.assert_allclose(multi, single, rtol=RTOL)
    # Only process 0 writes logs and metrics.
    assert "step " not in (tmp_path / "logs" / "process_1.log").read_text()


@pytest.mark.slow
def test_checkpoints_move_between_two_processes_and_one(tmp_path, train_tiny, capsys):
    """fsdp over both processes: saved by two and resumed by one, and back; the samples during training too
    (decoding with the KV cache across processes: the prompts go to every process's devices, the ids come back
    whole to each, and process 0 prints what one process prints)."""
    sample = ("sample_interval=3", 'sample_prompts=["ROMEO:", "To be"]', "max_new_tokens=8", "temperature=0.9")
    ckpt = ("vocab_size=384", "enable_checkpointing=true", "checkpoint_period=3", "learning_rate_schedule_steps=12",
            "ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2")
    straight = train_tiny("run_name=straight", "vocab_size=384", "steps=12", "learning_rate_schedule_steps=12",
                          *sample)["losses"]
    single = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sample at step")]
    # Saved by the two-process job, resumed by one process ...
    proc = launch(tmp_path, "run_name=a", "steps=6", *ckpt, *sample)
    assert proc.returncode == 0, proc.stderr[-3000:]
    multi = [x for x in proc.stdout.splitlines() if x.startswith("sample at step")]
    assert len(multi) == 4 and multi == single[:4]  # two prompts at steps 3 and 6
    resumed = train_tiny("run_name=a", "vocab_size=384", "steps=9", "enable_checkpointing=true",
                         "learning_rate_schedule_steps=12")
    np.testing.assert_allclose(resumed["losses"], straight[6:9], rtol=RTOL)
    # ... and saved by one process (at 9), resumed by the two-process job.
    proc = launch(tmp_path, "run_name=a", "steps=12", *ckpt, env={"JAX_LOG_COMPILES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {tmp_path}/a/checkpoints/9" in proc.stdout
    # The step the first job compiled is read from the compilation cache by process 1 too, not compiled again
    # while process 0 waits for it (startup.same_cache_keys_on_every_cpu_process).
    assert "Persistent compilation cache hit for 'jit_step'" in (tmp_path / "logs" / "process_1.log").read_text()
    np.testing.assert_allclose(losses(tmp_path / "a")[-3:], straight[9:12], rtol=RTOL)


def process_of(tmp_path, i):
    """The pid of process i of the job writing under tmp_path (the launched command, whose child is the trainer),
    never another job's: another test or the README check may run a 2-process job beside this one."""
    pids = {int(p) for p in subprocess.run(["pgrep", "-f", f"base_output_directory={tmp_path} .*process_id={i}$"],
                                           capture_output=True, text=True).stdout.split()}
    launched = [p for p in pids if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) not in pids]
    assert len(launched) == 1, f"process {i} of this job: found {sorted(pids)}"
    return launched[0]


FSDP8_2P = ("ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2")


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_saved_step(tmp_path):
    """A scheduler's SIGTERM reaches hosts at different steps (here: only process 1). JAX's preemption
    service agrees on one step: both save it and exit 0, and a rerun resumes there."""
    env = launch_env(tmp_path)
    args = [LAUNCH, "2", TINY, f"base_output_directory={tmp_path}", "log_period=1", "enable_checkpointing=true",
            "checkpoint_period=100000", *FSDP8_2P]
    proc = subprocess.Popen([*args, "steps=100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO, start_new_session=True)
    output = Output(proc)
    output.wait_for(re.escape("step      3/100000 |"), timeout=300)
    os.kill(process_of(tmp_path, 1), signal.SIGTERM)
    try:
        code, lines, err = output.finish(timeout=180)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the job did not stop within 180 s of the SIGTERM") from None
    assert code == 0, err[-3000:]
    out = "\n".join(lines)
    line = [x for x in out.splitlines() if "stopped by SIGTERM" in x][0]
    step = int(line.split("after step ")[1].split(":")[0])
    assert "checkpoint saved" in line and (tmp_path / "tiny" / "checkpoints" / str(step) / "state").is_dir()
    rerun = subprocess.run([*args, f"steps={step + 2}"], capture_output=True, text=True, env=env, cwd=REPO,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {tmp_path}/tiny/checkpoints/{step}" in rerun.stdout and f"done: {step + 2} steps" in rerun.stdout


@pytest.mark.slow
def test_eval_rows_that_end_at_different_batches(tmp_path, train_tiny, capsys):
    """Rows 0-3 (process 0) read the long eval documents, rows 4-7 (process 1) the short ones, so process
    1's rows end first: it must pad until both are done, and the eval counts every token, as one process
    reading all eight rows does."""
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text("\n\n".join(("long " * 60 if i % 8 < 4 else "short " * 12) for i in range(32)))
    text = ("dataset_type=text", "vocab_size=384", "max_target_length=16", f"train_files={SHAKESPEARE}",
            f"eval_files={eval_file}", "eval_interval=2", "eval_steps=1000")
    proc = launch(tmp_path, "steps=2", *text, *FSDP8_2P, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    capsys.readouterr()
    train_tiny("run_name=single", "steps=2", "ici_fsdp_parallelism=8", *text)
    single = capsys.readouterr().out

    def tokens(out):
        line = [x for x in out.splitlines() if x.startswith("eval ")][0]
        return int(re.search(r"\| ([\d,]+) tokens \|", line).group(1).replace(",", ""))
    # 16 long documents of 302 tokens (bos, 300 bytes, eos), 16 short of 74: each predicts all but its first
    assert tokens(proc.stdout) == tokens(single) == 16 * 301 + 16 * 73


@pytest.mark.slow
def test_finite_epochs_of_streamed_files_with_several_processes_are_refused(tmp_path):
    proc = launch(tmp_path, "dataset_type=text", "vocab_size=384", f"train_files={SHAKESPEARE}", "num_epochs=1",
                  timeout=120)
    # Both processes leave with the one line (one that left first would make the other abort natively).
    line = ("config error: num_epochs: 1: streamed files with several processes end at different steps: use -1 "
            "(repeat) and end the run with steps, or dataset_type=prepared (exact epochs)")
    assert proc.returncode == 2 and proc.stderr.strip() == line, proc.stderr[-3000:]
    assert (tmp_path / "logs" / "process_1.log").read_text().strip() == line


def checksums(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/batch_checksum"] for r in rows if "train/batch_checksum" in r]


@pytest.mark.slow
def test_the_data_position_moves_between_process_counts(tmp_path, train_tiny, tiny_config):
    """Saved by 2 processes after 6 steps and resumed by 1 for 6 more, and saved by 1 and resumed by 2: the 12
    global batches are those of an uninterrupted run, bitwise (each step's batch checksum). A mixture of a
    prepared source and a streamed parquet one, with a stage at step 4: each kind's position and the mixture's
    own move together (each alone was a case of 90 to 170 s that this one covers)."""
    import corpus
    from maxtrain.data import prepare as prepare_lib
    corpus.make(tmp_path / "corpus", 6, 60, formats=("parquet",))
    prepare_lib.run(tiny_config(f"train_files={tmp_path}/corpus/*", f"prepared_dir={tmp_path}/tok"),
                    say=lambda *_: None)
    mix = {"tok": {"files": f"{tmp_path}/tok", "weight": 0.7},
           "pq": {"files": f"{tmp_path}/corpus/*.parquet", "weight": 0.3}}
    stage = {"start_step": 4, "weights": {"tok": 0.2, "pq": 0.8}}
    data = ("data_sources=" + json.dumps(mix), f"data_stages=[{json.dumps(stage)}]", "grain_shuffle_buffer_size=8")
    common = (*data, "vocab_size=384", "learning_rate_schedule_steps=12", "enable_checkpointing=true",
              "checkpoint_period=6")
    straight = train_tiny("run_name=straight", "steps=12", *common, "ici_fsdp_parallelism=8")["losses"]
    want = checksums(tmp_path / "straight")
    assert len(want) == 12 and len(set(want)) == 12
    # 2 -> 1
    proc = launch(tmp_path, "run_name=a", "steps=6", *common, *FSDP8_2P)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = train_tiny("run_name=a", "steps=12", *common, "ici_fsdp_parallelism=8")
    assert checksums(tmp_path / "a") == want
    np.testing.assert_allclose(resumed["losses"], straight[6:], rtol=RTOL)
    # 1 -> 2
    train_tiny("run_name=b", "steps=6", *common, "ici_fsdp_parallelism=8")
    proc = launch(tmp_path, "run_name=b", "steps=12", *common, *FSDP8_2P)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {tmp_path}/b/checkpoints/6" in proc.stdout
    assert checksums(tmp_path / "b") == want
