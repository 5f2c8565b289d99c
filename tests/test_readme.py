"""The README's commands, run as written one after another in a fresh copy of the checkout, give what the
README shows (scripts/check_readme.py); and that script reads a README as a newcomer would."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TESTS

SCRIPT = TESTS.parent / "scripts" / "check_readme.py"
spec = importlib.util.spec_from_file_location("check_readme", SCRIPT)
check_readme = sys.modules["check_readme"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(check_readme)

SAMPLE = '''Intro.

```bash
pip install -e . && python -m maxtrain.train configs/base.yml run_name=demo steps=20
pip install -e ".[test]" && python -m pytest -q
```

```bash
python -m maxtrain.train CONFIG.yml [key=value ...]

# eight devices
XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
  python -m maxtrain.train configs/base.yml run_name=demo2 \\
  steps=20   # a comment
python -m maxtrain.generate x.yml prompt="ROMEO: # not a comment" max_new_tokens=8
scripts/launch_gke.sh --cluster c -- configs/base.yml
```

```
step     20 | loss 6.0966 | 0.117 s/step | MFU 44.0%
```

```
$ python -m maxtrain.train configs/base.yml learning_rte=1e-3
config error: learning_rte: unknown key; did you mean learning_rate?
```

```python
print("not a shell command")
```
'''


def test_the_readme_is_read_as_a_newcomer_types_it():
    steps = check_readme.parse(SAMPLE)
    assert [(s.line, s.command, s.skip) for s in steps if not s.shape and not s.expect] == [
        (4, "python -m maxtrain.train configs/base.yml run_name=demo steps=20", ""),
        (5, "", "installs: the environment is installed already; the test command itself"),
        (9, "", "usage synopsis"),
        (12, "XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m maxtrain.train configs/base.yml "
             "run_name=demo2 steps=20", ""),
        (15, 'python -m maxtrain.generate x.yml prompt="ROMEO: # not a comment" max_new_tokens=8', ""),
        (16, "", "needs a cloud project (tests/test_launch.py runs its --dry-run)"),
    ]
    sample, shown = [s for s in steps if s.shape or s.expect]
    assert sample.shape == ["step     20 | loss 6.0966 | 0.117 s/step | MFU 44.0%"]
    assert (shown.line, shown.command) == (24, "python -m maxtrain.train configs/base.yml learning_rte=1e-3")
    assert shown.expect == ["config error: learning_rte: unknown key; did you mean learning_rate?"]


def test_a_sample_line_matches_by_its_fields_not_its_numbers():
    shape = check_readme.shape
    readme = "step     20 | loss 6.0966 | lr 1.068e-04 | 4,387 tok/s | MFU 44.0%"
    assert shape(readme) == shape("step      3 | loss 5.1 | lr 2.000e-03 | 12 tok/s | MFU 0.1%")
    assert shape(readme) != shape("step 3/20 | loss 5.1 | lr 2.000e-03 | 12 tok/s | MFU 0.1%")
    assert shape(readme) != shape("step 20 | loss 6.0966 | lr 1.068e-04 | 4,387 tok/s")


def test_a_command_is_judged_by_its_exit_code_and_the_lines_shown(tmp_path):
    steps = check_readme.parse("```\n$ echo 'config error: x' >&2; exit 2\nconfig error: x\n```\n"
                               "```bash\nexit 3\n```\n```\nstep 1 | loss 2.0\n```\n")
    lines = []
    ok = check_readme.check(steps, tmp_path, {"PATH": "/usr/bin:/bin"}, timeout=30, say=lines.append)
    assert not ok
    assert lines[0].startswith("ok    README.md:2 ")
    assert lines[1].startswith("FAIL  README.md:6 ") and lines[2] == "      exit 3, expected 0"
    assert lines[-1] == ("FAIL  README.md:9            output sample 'step 1 | loss 2.0': no command printed a "
                         "line with these fields")


def test_a_command_that_finds_its_run_finished_collided_with_an_earlier_one(tmp_path):
    steps = check_readme.parse("```bash\necho 'done: 20 steps'\necho 'nothing to do: run base-1 is finished'\n```\n",
                               "docs/x.md")
    lines = []
    assert not check_readme.check(steps, tmp_path, {"PATH": "/usr/bin:/bin"}, timeout=30, say=lines.append)
    assert lines[0].startswith("ok    docs/x.md:2 ") and lines[1].startswith("FAIL  docs/x.md:3 ")
    assert lines[2] == "      it found its run finished: an earlier command trained under the same run name"


PAGES = check_readme.groups(check_readme.reading_order(TESTS.parent / "README.md"))


@pytest.mark.slow
@pytest.mark.parametrize("pages", PAGES, ids=[" ".join(Path(p).name for p in group) for group in PAGES])
def test_each_pages_commands_give_what_it_shows(pages):
    """A section's commands as written, one after another, in a fresh checkout (a page that uses another's
    outputs whole, after it: check_readme.NEEDS); the sections side by side, sharing this session's compilation
    cache (its HOME)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), *pages, "--home", os.environ["HOME"]],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_the_pages_run_apart_only_where_no_page_uses_anothers_outputs():
    names = [[check_readme.page_name(p) for p in group] for group in PAGES]
    assert names[0] == ["README.md"] and ["docs/hf.md", "docs/generation.md"] in names
    assert ["docs/models.md#3"] in names and ["docs/models.md#6"] in names  # a long page's sections apart
    parts = [n for group in names for n in group]
    assert len(parts) == len(set(parts))
    order = check_readme.reading_order(TESTS.parent / "README.md")
    every = [s for page in order for s in check_readme.parse(page.read_text(), check_readme.page_name(page))]
    run = [s for part in parts for s in check_readme.steps_of(TESTS.parent / part)]
    assert every and [s for s in every if s.command or s.shape] == [s for s in run if s.command or s.shape]


def test_no_two_pages_train_one_run(tmp_path):
    """Each group of pages runs in its own checkout, so a page that trains a run an earlier page trained (and
    would resume it, or find it finished, in a newcomer's one folder) is found from the run names themselves."""
    assert check_readme.collisions(PAGES) == []
    readme = TESTS.parent / "README.md"
    again = tmp_path / "again.md"  # README's first run under another device count is another run; this one is not
    again.write_text("```bash\nXLA_FLAGS=--xla_force_host_platform_device_count=2 python -m maxtrain.train "
                     "configs/base.yml per_device_batch_size=4 steps=5\n"
                     "XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m maxtrain.train configs/base.yml "
                     "per_device_batch_size=2 steps=30\n```\n")
    first = check_readme.parse(readme.read_text())[0]
    assert check_readme.collisions([[readme], [again]]) == [
        f"{again}:3 trains run {check_readme.run_names([first])[0]}, as README.md:{first.line} does (another "
        "page's checkout)"]  # the same global batch of 4: the same run
    launched = check_readme.trained_run("scripts/launch_local.sh 2 configs/base.yml run_name=two steps=2")
    assert launched == (["configs/base.yml", "run_name=two", "steps=2"], 8, 2)


def test_the_readme_is_short_and_links_every_page_of_the_reference():
    """README.md is usage (at most 150 lines); docs/ holds the reference, each page linked from it (the README
    check runs them in that order), and every relative link in them names a file that exists."""
    readme = TESTS.parent / "README.md"
    assert len(readme.read_text().splitlines()) <= 150
    pages = sorted((TESTS.parent / "docs").glob("*.md"))
    linked = check_readme.reading_order(readme)[1:]
    assert sorted(linked) == pages and linked[:len(pages)] == [p for p in linked if f"]({p.parent.name}/{p.name})"
                                                               in readme.read_text()]
    for page in [readme, *pages, TESTS.parent / "benchmarks" / "README.md"]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


def test_the_pages_tpu_compiles_resolve_for_their_topology(monkeypatch):
    """The page check does not run the pages' `maxtrain.compile` commands (each compiles a full-size model for
    minutes); each one's config loads, resolves for its topology's devices and passes the activation floor."""
    from maxtrain import compile as compile_lib
    from maxtrain.config import load as config_lib, resolve
    from maxtrain.observe import fit
    monkeypatch.chdir(TESTS.parent)
    order = check_readme.reading_order(TESTS.parent / "README.md")
    skipped = [s for page in order for s in check_readme.parse(page.read_text(), check_readme.page_name(page))
               if s.skip == check_readme.TPU_COMPILE]
    assert len(skipped) >= 3  # scaling.md's, parallelism.md's and models.md's
    for step in skipped:
        args = shlex.split(step.written)
        args = args[args.index("maxtrain.compile") + 1:]
        c = config_lib.load(args)
        _, _, hbm_per_chip, chips = compile_lib.topology(c.compile_topology)
        devices = chips * c.compile_topology_num_slices
        resolved = resolve.resolve(c, devices, c.compile_topology_num_slices, "tpu")
        assert sum(fit.step_floor(resolved).values()) < hbm_per_chip * fit.GiB, step
