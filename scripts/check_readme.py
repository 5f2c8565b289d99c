#!/usr/bin/env python
"""Runs the README's commands, then the docs' (docs/*.md, in the order the README links them), as a newcomer
does, one after another in one folder: a fresh copy of the checkout (its tracked files; no outputs/) outside
the repo, with a home of its own (no compilation cache, no settings), and checks that each gives what the text
shows. Commands that collide when run in order (two runs under one name) fail here.

    python scripts/check_readme.py [README.md | docs/x.md#K ...] [--keep DIR] [--home DIR] [--list] [--groups]

Given pages (or a page's `## ` section K, counted from 0) run in that order in one checkout. The tests run each
section in a checkout of its own, side by side, a page whole after the pages it uses the outputs of (NEEDS;
`--groups` lists them), and check statically that no two of them train one run (`collisions`).

Commands are the lines of the ```bash blocks (a trailing `\\` joins lines; `# ...` comments go), run with
bash so that `VAR=value` prefixes and `&&` work as typed, with the `python` running this script first on
PATH and none of the environment's JAX or maxtrain settings. Not run: `pip install` (the environment is
already installed), the test command itself, usage synopses (CONFIG.yml), and launchers that need a cloud
project or a cluster (their --dry-run is tests/test_launch.py's; a TPU pod's --dry-run is run). `path/to/hf_model` is made there: a
small random-weight Llama (transformers); `[--optional args]` are left out.

A block without a language that follows shows output: `$ command` lines are run, and each line after
them must appear in the command's output as written (a `... error:` line: exit code 2, else 0); a block
of plain lines (a sample log line) must match, field by field with the numbers left out, some line that
an earlier command printed. Prints one line per command (status, seconds) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# 3 to 5 minutes each on 2 cores, a tenth of the whole suite: tests/test_readme.py resolves each for its topology
# instead; tests/test_launch.py compiles small ones; benchmarks/compare.py gives the figures
TPU_COMPILE = "a TPU compile of a full-size model (minutes): the fast tier resolves its config for the topology"
SKIP = [  # (pattern, why): parts of a command line that are not run
    (r"^pip install\b", "installs: the environment is installed already"),
    (r"\bpytest\b", "the test command itself"),
    (r"CONFIG\.yml|\[key=value", "usage synopsis"),
    (r"^scripts/launch_(tpu_pod\.sh(?!.* --dry-run)|gke\.sh)\b", "needs a cloud project (tests/test_launch.py runs "
                                                              "its --dry-run)"),
    (r"^sbatch\b", "needs a SLURM cluster (tests/test_launch.py runs its --dry-run)"),
    (r"\bmaxtrain\.compile\b.*\bcompile_topology=", TPU_COMPILE),
]
HF_MODEL = "path/to/hf_model"
# A page that runs what another page made (its checkpoints, its imported model) runs after it, in its checkout.
NEEDS = {"docs/generation.md": ["docs/hf.md"]}
# Pages that run whole, not a section at a time: a later section shows what an earlier one's command printed.
WHOLE = {"README.md": "its Usage section shows the quickstart's log"}
# Environment settings that would change what a command does compared with a newcomer's shell.
CLEARED = ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH", "CUDA_VISIBLE_DEVICES")


@dataclass
class Step:
    line: int                       # line of its file where it starts
    command: str = ""               # bash command line; "" for an output-only sample
    skip: str = ""                  # why it is not run
    expect: list[str] = field(default_factory=list)  # lines its output must have ($ blocks)
    shape: list[str] = field(default_factory=list)   # sample lines some earlier output must match in shape
    file: str = "README.md"
    written: str = ""               # the command line as the page has it (a skipped one's too)


def _strip_comment(line: str) -> str:
    """`cmd  # comment` -> `cmd` (a # that starts a word, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _commands(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(README line, command) from a block's lines: continuations joined, comments and blank lines dropped."""
    out, current, start = [], "", 0
    for number, raw in lines:
        text = _strip_comment(raw) if not current else raw.rstrip()
        if not current:
            start = number
            if not text.strip():
                continue
        if text.endswith("\\"):
            current += text[:-1].rstrip() + " "
            continue
        out.append((start, " ".join((current + _strip_comment(text)).split())))
        current = ""
    return out


def _runnable(command: str) -> tuple[str, str]:
    """(what to run, why the rest is not): `pip install ... && python ...` runs the second part."""
    parts, skipped = [], []
    for part in (p.strip() for p in command.split("&&")):
        why = next((why for pattern, why in SKIP if re.search(pattern, part)), "")
        (skipped if why else parts).append(why or part)
    return " && ".join(parts), "; ".join(skipped)


def parse(readme: str, file: str = "README.md") -> list[Step]:
    steps, fence, block = [], None, []
    for number, line in enumerate(readme.splitlines(), 1):
        if fence is None:
            if line.startswith("```"):
                fence, block = line[3:].strip(), []
            continue
        if not line.startswith("```"):
            block.append((number, line))
            continue
        if fence == "bash":
            for start, command in _commands(block):
                run, why = _runnable(command)
                steps.append(Step(start, run, "" if run else why, file=file, written=command))
        elif fence == "" and block:
            if block[0][1].startswith("$ "):
                step = None
                for n, text in block:
                    if text.startswith("$ "):
                        step = Step(n, text[2:].strip(), file=file)
                        steps.append(step)
                    elif text.strip() and step is not None:
                        step.expect.append(text.rstrip())
            else:
                steps.append(Step(block[0][0], shape=[t for _, t in block if t.strip()], file=file))
        fence = None
    return steps


NUMBER = re.compile(r"[-+]?(\d[\d,]*\.?\d*|\.\d+)(e[-+]?\d+)?")
PATH = re.compile(r"[^\s,()]*/[^\s,()]*")         # where the reader's checkout and outputs are
REVISION = re.compile(r"\b[0-9a-f]{7,40}(-dirty)?\b")  # a git commit


def shape(line: str) -> list[str]:
    """A log line's fields with their numbers, paths and git revisions left out: `step     20 | loss 6.0966`
    -> ['step #', 'loss #']."""
    return [" ".join(NUMBER.sub("#", REVISION.sub("#", PATH.sub("PATH", f))).split()) for f in line.split("|")]


def fresh_checkout(where: Path) -> Path:
    """The checkout's tracked (and untracked, not ignored) files, as a fresh clone holds them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True)
    files = [f for f in listed.stdout.split("\0") if f] if listed.returncode == 0 else []
    if not files:  # not a git checkout: what the README's commands use
        files = [str(p.relative_to(REPO)) for d in ("configs", "data", "scripts", "maxtrain")
                 for p in (REPO / d).rglob("*") if p.is_file() or p.is_symlink()]
    for name in files:
        source, target = REPO / name, where / name
        if not (source.is_file() or source.is_symlink()):
            continue  # deleted in the working tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return where


def make_hf_model(where: Path) -> None:
    """A small random-weight LlamaForCausalLM in safetensors (what `path/to/hf_model` stands for)."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(where)


def environment(bin_dir: Path, home: Path) -> dict[str, str]:
    """A newcomer's shell: `python` is this one, none of our settings, and a home of its own (`~/.cache/maxtrain/xla`,
    the compilation cache, starts empty unless the caller shares one between checks)."""
    # A script, not a symlink: a venv's python called through a link elsewhere loses its venv.
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED and not k.startswith("MAXTRAIN_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(home)
    return env


def check(steps: list[Step], cwd: Path, env: dict[str, str], timeout: float, say=None) -> bool:
    say = say or (lambda line: print(line, flush=True))
    ok, printed = True, []
    for step in steps:
        where = f"{step.file}:{step.line}"
        if step.skip:
            say(f"skip  {where:15s}        {step.skip}")
            continue
        if step.shape:
            for sample in step.shape:
                found = any(shape(line) == shape(sample) for line in printed)
                ok &= found
                status = "ok   " if found else "FAIL "
                say(f"{status} {where:15s}        output sample {sample.strip()!r}"
                    + ("" if found else ": no command printed a line with these fields"))
            continue
        command = re.sub(r"\s\[--[^\]]*\]", "", step.command)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code, out = "timeout", b"".join(x or b"" for x in (e.stdout, e.stderr)).decode(errors="replace")
        seconds = time.perf_counter() - t0
        printed += out.splitlines()
        wanted = 2 if any(re.match(r"^[a-z]+ error: ", x) for x in step.expect) else 0
        problems = [] if code == wanted else [f"exit {code}, expected {wanted}"]
        lines = [x.rstrip() for x in out.splitlines()]
        problems += [f"no line {x!r}" for x in step.expect if x not in lines]
        if any(x.startswith("nothing to do: run ") for x in lines) and not step.expect:
            problems.append("it found its run finished: an earlier command trained under the same run name")
        ok &= not problems
        say(f"{'FAIL ' if problems else 'ok   '} {where:15s} {seconds:6.1f} s {command}")
        if problems:
            say("      " + "; ".join(problems))
            say("      last output: " + " / ".join(lines[-4:])[-1500:])
    return ok


def reading_order(readme: Path) -> list[Path]:
    """The README, then the docs/ pages in the order it links them (a user reads them so: a page may run what an
    earlier one made), then any page it does not link."""
    linked = [readme.parent / m for m in dict.fromkeys(re.findall(r"\]\((docs/[\w.-]+\.md)\)", readme.read_text()))]
    rest = [p for p in sorted((readme.parent / "docs").glob("*.md")) if p not in linked]
    return [readme, *(p for p in linked if p.exists()), *rest]


def page_name(page: str | Path) -> str:
    page = Path(page)
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


def sections(text: str) -> list[tuple[int, int]]:
    """A page's `## ` sections as (first line, last line); the text before the first heading is one too."""
    starts = [1] + [n for n, line in enumerate(text.splitlines(), 1) if line.startswith("## ") and n > 1]
    return list(zip(starts, [s - 1 for s in starts[1:]] + [len(text.splitlines())]))


def steps_of(part: str | Path) -> list[Step]:
    """The steps of a page (`docs/x.md`) or of one of its sections (`docs/x.md#K`, K counted from 0)."""
    path, _, k = str(part).partition("#")
    text = Path(path).read_text()
    steps = parse(text, page_name(path))
    if not k:
        return steps
    first, last = sections(text)[int(k)]
    return [s for s in steps if first <= s.line <= last]


def groups(pages: list[Path]) -> list[list[str]]:
    """The pages (in reading order) as runs of their own: each section of a page that has commands or samples
    alone (`page#K`; a page's sections share no outputs: a later one that used an earlier one's would fail
    here), or a page whole (WHOLE) or after the pages it NEEDS (which then run there only)."""
    by_name = {page_name(p): p for p in pages}
    needed = {name for names in NEEDS.values() for name in names}
    runs = []
    for page in pages:
        if page_name(page) in needed:
            continue
        if page_name(page) in NEEDS or page_name(page) in WHOLE:
            runs.append([str(by_name[n]) for n in NEEDS.get(page_name(page), []) if n in by_name] + [str(page)])
            continue
        runs += [[f"{page}#{k}"] for k in range(len(sections(page.read_text())))
                 if any(s.command or s.shape for s in steps_of(f"{page}#{k}"))]
    return runs


def trained_run(command: str) -> tuple[list[str], int, int] | None:
    """(maxtrain.train's arguments, devices, processes) of a command that trains, else None."""
    for part in command.split("&&"):
        words = shlex.split(part)
        env = {}
        while words and re.match(r"^[A-Z_]+=", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        count = re.search(r"device_count=(\d+)", env.get("XLA_FLAGS", ""))
        per_process = int(count[1]) if count else 1  # CPU: one device unless XLA_FLAGS says more
        if any(w.startswith("-") for w in words[3:]):
            continue  # --print-config, --help-keys: nothing trained
        if words[:3] == ["python", "-m", "maxtrain.train"] and words[3:]:
            return words[3:], per_process, 1
        if words and words[0].endswith("launch_local.sh") and words[1:2] and words[1].isdigit():
            processes = int(words[1])  # the script gives each process MAXTRAIN_DEVICES_PER_PROCESS devices
            return words[2:], int(env.get("MAXTRAIN_DEVICES_PER_PROCESS", 4)) * processes, processes
    return None


def run_names(steps: list[Step], cwd: Path = REPO) -> list[str | None]:
    """The run each step trains (None: it trains nothing, or its config is made by an earlier command, or it is
    shown failing), from maxtrain's own config load and resolve for the devices and processes the command
    gives, read in `cwd` (a checkout)."""
    from maxtrain.config import keys, load, resolve
    names = []
    with contextlib.chdir(cwd):
        for step in steps:
            found = trained_run(step.command) if step.command and not step.expect else None
            if not found:
                names.append(None)
                continue
            args, devices, processes = found
            try:
                names.append(resolve.resolve(load.load(args), devices, slices=processes).run_name)
            except keys.ConfigError:
                names.append(None)
    return names


def collisions(runs: list[list[Path]], cwd: Path = REPO) -> list[str]:
    """Runs that two groups of pages train: each group runs in its own checkout, so a later page resuming (or
    finding finished) an earlier page's run shows only here."""
    first: dict[str, tuple[str, int]] = {}  # run name -> (where it is first trained, its group)
    problems = []
    for number, group in enumerate(runs):
        steps = [s for part in group for s in steps_of(part)]
        for step, name in zip(steps, run_names(steps, cwd)):
            if name in first and first[name][1] != number:
                problems.append(f"{step.file}:{step.line} trains run {name}, as {first[name][0]} does (another "
                                "page's checkout)")
            if name:
                first.setdefault(name, (f"{step.file}:{step.line}", number))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("readme", nargs="*", help="default: README.md, then the docs/ pages it links, in order")
    parser.add_argument("--keep", help="run in this (new) directory and keep it, instead of a temporary one")
    parser.add_argument("--home", help="HOME for the commands (default: a new, empty one); sharing one between "
                        "checks shares their compilation cache")
    parser.add_argument("--list", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--groups", action="store_true", help="print the groups of pages the tests run apart")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per command")
    args = parser.parse_args(argv)
    files = [str(Path(path).resolve()) + hash_ + k for path, hash_, k in (f.partition("#") for f in args.readme)] \
        or reading_order(REPO / "README.md")
    if args.groups:
        for group in groups([Path(f) for f in files]):
            print(" ".join(page_name(p) for p in group))
        return 0
    steps = [s for f in files for s in steps_of(f)]
    if args.list:
        for s in steps:
            print(f"{s.file}:{s.line}: " + (f"(skip: {s.skip})" if s.skip else s.command or f"sample {s.shape}"))
        return 0
    with tempfile.TemporaryDirectory(prefix="readme-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp) / "maxtrain"
        work.mkdir(parents=True)
        fresh_checkout(work)
        bin_dir, home = Path(tmp) / "bin", Path(args.home) if args.home else Path(tmp) / "home"
        bin_dir.mkdir()
        home.mkdir(parents=True, exist_ok=True)
        if any(HF_MODEL in s.command for s in steps):
            make_hf_model(work / HF_MODEL)
        t0 = time.perf_counter()
        ok = check(steps, work, environment(bin_dir, home), args.timeout)
        print(f"{'all as the README shows' if ok else 'some commands differ from the README'} "
              f"({time.perf_counter() - t0:.0f} s, in {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
