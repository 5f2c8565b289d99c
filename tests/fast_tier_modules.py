"""Which modules of maxtrain/ the fast tier runs: the fast tier under coverage (its xdist workers and every process
a test starts included), then each module's share of function-body lines executed. A module counts as run when
at least one line inside one of its functions ran (importing it runs only its top level); a module without
functions counts when it was imported.

    python tests/fast_tier_modules.py [pytest args]    # default: -q -n 2 -m "not slow"

Prints one line per module, those never run first, and exits 1 if any was not run.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "maxtrain"


def body_lines(path: Path) -> set[int]:
    """Line numbers of the statements inside the module's functions (methods included)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for statement in node.body:
                for inner in ast.walk(statement):
                    if isinstance(inner, ast.stmt):
                        lines.add(inner.lineno)
    return lines


def main(argv: list[str]) -> int:
    import coverage
    pytest_args = argv or ["-q", "-n", "2", "-m", "not slow"]
    with tempfile.TemporaryDirectory(prefix="fast-tier-coverage-") as tmp:
        rc = Path(tmp) / "coveragerc"
        rc.write_text(f"[run]\nsource = {PACKAGE}\nparallel = true\ndata_file = {tmp}/.coverage\n"
                      "patch = subprocess\n         _exit\n         execv\nsigterm = true\n")
        env = {**os.environ, "COVERAGE_RCFILE": str(rc)}
        code = subprocess.run([sys.executable, "-m", "coverage", "run", "-m", "pytest", *pytest_args], cwd=REPO,
                              env=env).returncode
        subprocess.run([sys.executable, "-m", "coverage", "combine", "-q"], cwd=REPO, env=env, check=True)
        data = coverage.CoverageData(basename=f"{tmp}/.coverage")
        data.read()
        executed = {Path(f).resolve(): set(data.lines(f) or ()) for f in data.measured_files()}
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        ran = executed.get(path.resolve(), set())
        body = body_lines(path)
        share = len(ran & body) / len(body) if body else float(bool(ran))
        rows.append((share > 0, share, path.relative_to(REPO)))
    for run, share, path in sorted(rows):
        print(f"{'ran      ' if run else 'NOT RUN  '} {share:6.1%}  {path}")
    missing = [path for run, _, path in rows if not run]
    print(f"{len(rows) - len(missing)} of {len(rows)} modules run by the tests (pytest exit {code})")
    return 1 if missing or code else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
