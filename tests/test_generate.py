"""`python -m maxtrain.generate` as a user runs it (prompt files, batches, sampling keys, its one-line
refusals) and samples during training (sample_interval, sample_prompts)."""

import json
import re
import subprocess
import sys

import pytest

from maxtrain import generate, train
from conftest import TINY
from helpers import one_line

BYTES = ("vocab_size=384",)  # the byte tokenizer's 259 ids, padded: text prompts


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    c = train.load_config([TINY, *BYTES, f"base_output_directory={out}", "enable_checkpointing=true", "steps=2",
                           "checkpoint_period=2"])
    train.train(c)
    return out / "tiny" / "checkpoints" / "2"


def ids_printed(out: str) -> list[list[int]]:
    return [json.loads(x) for x in re.findall(r"generated ids: (\[[0-9, ]*\])", out)]


@pytest.mark.slow
def test_a_prompt_file_in_batches_as_a_user_runs_it(step_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\n\nJULIET: O Romeo\nTo be\n", encoding="utf-8")  # the blank line is skipped
    command = [sys.executable, "-m", "maxtrain.generate", TINY, *BYTES, f"load_parameters_path={step_dir}",
               f"prompt_file={prompts}", "max_new_tokens=12", "generate_batch_size=2", "temperature=0.8",
               "top_p=0.95", "sampling_seed=4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    batched = ids_printed(done.stdout)
    assert len(batched) == 3 and all(len(ids) <= 12 for ids in batched)
    assert len(re.findall(r"^text: '.*'$", done.stdout, re.M)) == 3
    prompt_ids = [json.loads(x) for x in re.findall(r"prompt ids: (\[[0-9, ]*\])", done.stdout)]
    assert [len(ids) for ids in prompt_ids] == [7, 16, 6]  # bos and the bytes
    speed = re.search(r"^prefill: (\d+) tokens in [0-9.]+ s \([0-9,.]+ tokens/s\) \| decode: (\d+) tokens in [0-9.]+ s "
                      r"\([0-9,.]+ tokens/s\)$", done.stdout, re.M)
    assert speed and int(speed[1]) == 29 and int(speed[2]) == sum(len(ids) - 1 for ids in batched), done.stdout
    alone = subprocess.run([*command[:-5], "max_new_tokens=12", "generate_batch_size=1", "temperature=0.8",
                            "top_p=0.95", "sampling_seed=4"], capture_output=True, text=True, timeout=300)
    assert ids_printed(alone.stdout) == batched  # the same samples one prompt at a time


@pytest.mark.slow
def test_output_piped_into_head_ends_quietly(step_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(40)))
    command = (f"{sys.executable} -m maxtrain.generate {TINY} vocab_size=384 load_parameters_path={step_dir} "
               f"prompt_file={prompts} max_new_tokens=4 max_target_length=32 | head -1")  # head leaves during the decode
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=300)
    assert done.returncode == 141 and "Traceback" not in done.stderr and done.stderr.strip() == "", done.stderr[-2000:]
    assert done.stdout.startswith("prefill and decode compiled in ") and len(done.stdout.splitlines()) == 1


@pytest.mark.parametrize("args,expected", [
    (["prompt=a", "prompt_file=x.txt"], "config error: prompt: set exactly one of prompt=\"text\", prompt_ids=1,2,3 or "
                                        "prompt_file=FILE (got prompt and prompt_file)"),
    (["prompt_file=/nonexistent/p.txt"], "config error: prompt_file: cannot read /nonexistent/p.txt: "),
    (["prompt=a", "top_p=0"], "config error: top_p: must be in (0, 1] (1 = off), got 0.0"),
    (["prompt=a", "top_p=1.5"], "config error: top_p: must be in (0, 1] (1 = off), got 1.5"),
    (["prompt=a", "generate_batch_size=0"], "config error: generate_batch_size: must be a positive integer"),
    (["prompt=a", "temperature=1e-38"], "config error: temperature: must be 0 (greedy) or at least 1e-6, got 1e-38"),
])
def test_generate_refuses_bad_keys_in_one_line(step_dir, capsys, args, expected):
    assert generate.main([TINY, *BYTES, f"load_parameters_path={step_dir}", *args]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(expected), line


@pytest.mark.parametrize("content,expected", [
    (b"\xff\xfe not text", "is not UTF-8 text"),
    (b"\n  \n", "has no prompts (one per line)"),
])
def test_a_bad_prompt_file_is_named(step_dir, tmp_path, capsys, content, expected):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(content)
    assert generate.main([TINY, *BYTES, f"load_parameters_path={step_dir}", f"prompt_file={bad}"]) == 2
    assert one_line(capsys.readouterr().err) == f"config error: prompt_file: {bad} {expected}"


def test_prompt_file_lines_end_at_newlines_only(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a\u2028b\x0bc\r\n  \r\nd\x85e\n".encode())  # separators str.splitlines would split at
    assert generate.read_prompt_file(str(prompts)) == ["a\u2028b\x0bc", "d\x85e"]


def test_a_prompt_file_line_too_long_for_the_context_is_refused(step_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short\n" + "x" * 40 + "\n")
    assert generate.main([TINY, *BYTES, f"load_parameters_path={step_dir}", f"prompt_file={prompts}"]) == 2
    assert one_line(capsys.readouterr().err) == ("config error: prompt_file: 41 tokens leave no room for new ones in "
                                                 "max_target_length=32")


# ---- samples during training ------------------------------------------------------------------------

@pytest.mark.slow
def test_training_prints_and_logs_samples_every_sample_interval(tmp_path, capsys):
    c = train.load_config([TINY, *BYTES, f"base_output_directory={tmp_path}", "steps=4", "sample_interval=2",
                           'sample_prompts=["ROMEO:", "To be"]', "max_new_tokens=6", "metrics_backends=jsonl,tensorboard"])
    train.train(c)
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("sample at step")]
    assert [x.split(":")[0] for x in lines] == ["sample at step 2"] * 2 + ["sample at step 4"] * 2
    assert lines[0].startswith("sample at step 2: 'ROMEO:' -> '") and lines[1].startswith("sample at step 2: 'To be' -> '")
    rows = [json.loads(x) for x in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in rows if "samples" in r]
    assert [r["step"] for r in samples] == [2, 4]
    assert [x["prompt"] for x in samples[0]["samples"]] == ["ROMEO:", "To be"]
    assert all(len(x["text"].encode()) <= 6 * 4 for r in samples for x in r["samples"])
    events = list((tmp_path / "tiny" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and b"samples" in events[0].read_bytes()


@pytest.mark.slow
def test_a_step_rolled_back_shows_no_sample(tmp_path, capsys):
    """Every step 2 here is non-finite (and rolled back, until max_nonfinite_steps ends the run): the step is
    checked before its sample, so no sample of it is shown or logged."""
    code = train.main([TINY, *BYTES, f"base_output_directory={tmp_path}", "steps=3", "sample_interval=1",
                       'sample_prompts=["ab"]', "max_new_tokens=4", "nan_policy=rollback", "learning_rate=1e38",
                       "gradient_clipping_threshold=0", "max_nonfinite_steps=2"])
    out = capsys.readouterr().out
    assert code == 1 and "rollback: step 2 was not finite" in out and "sample at step 1: 'ab' -> '" in out
    assert "sample at step 2" not in out
    rows = [json.loads(x) for x in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows if "samples" in r} == {1}


@pytest.mark.parametrize("args,expected", [
    (["sample_interval=5"], "config error: sample_prompts: sample_interval needs prompts to continue"),
    (["sample_prompts=[1, 2]"], "config error: sample_prompts: must be a list of non-empty strings"),
    (["sample_interval=-1"], "config error: sample_interval: must be >= 0 (0 = never)"),
    (["sample_interval=2", f'sample_prompts=["{"x" * 31}"]'],
     "config error: sample_prompts: '" + "x" * 31 + "' is 32 tokens: no room for a new one in max_target_length=32"),
])
def test_sample_keys_are_checked_before_training(tmp_path, capsys, args, expected):
    assert train.main([TINY, *BYTES, f"base_output_directory={tmp_path}", *args]) == 2
    assert one_line(capsys.readouterr().err).startswith(expected)
    assert not (tmp_path / "tiny").exists()  # refused before the run directory is made


@pytest.mark.slow
def test_samples_longer_than_the_context_stop_early_with_a_warning(tmp_path, capsys):
    """A context shortened below the config's max_new_tokens (shakespeare.yml's 64 at max_target_length=64):
    one warning, and the samples stop where the context ends; the run trains on."""
    assert train.main([TINY, *BYTES, f"base_output_directory={tmp_path}", "steps=2", "sample_interval=2",
                       'sample_prompts=["x", "xyz"]', "max_new_tokens=40", "temperature=1.0"]) == 0
    out = capsys.readouterr().out
    assert ("warning: max_new_tokens: 40 after the 4-token sample prompt 'xyz' exceeds max_target_length=32: "
            "samples stop at 28 new tokens") in out.splitlines()
    rows = [json.loads(x) for x in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    samples = next(r for r in rows if "samples" in r)["samples"]
    assert len(samples) == 2 and all(len(s["text"]) <= 28 for s in samples)  # a token decodes to a char at most


@pytest.mark.slow
def test_ctrl_c_during_a_long_decode_is_one_line_within_seconds(step_dir):
    """The decode loop comes back to the host every few steps, so Ctrl-C lands mid-decode."""
    import signal
    import time
    from helpers import Output, popen_as_from_a_terminal
    proc = popen_as_from_a_terminal([sys.executable, "-m", "maxtrain.generate", TINY, *BYTES,
                                     "max_target_length=32768", f"load_parameters_path={step_dir}", "prompt=ROMEO:",
                                     "max_new_tokens=32000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    output = Output(proc)
    output.wait_for(r"^prefill and decode compiled in ", timeout=240)
    time.sleep(3)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    code, lines, err = output.finish(timeout=60)
    assert code == 130 and one_line(err) == "interrupted by Ctrl-C", err[-3000:]
    assert time.perf_counter() - t0 < 20 and not any(x.startswith("generated ids") for x in lines)
