"""A job's goodput over all its restarts, from its run directory's ledger (maxtrain.observe.goodput):

    python -m maxtrain.goodput outputs/<run> [--json]

Prints the share of the job's wall time that trained steps kept in the end, and the rest by cause; --json
prints wall_s, productive_s, goodput (a fraction), badput (seconds by cause), restarts and steps_lost.
"""

from __future__ import annotations

import json
import sys

from maxtrain.observe import goodput
from maxtrain.runtime import errors, storage

USAGE = "usage: python -m maxtrain.goodput RUN_DIR [--json]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    as_json = "--json" in argv
    paths = [a for a in argv if a != "--json"]
    if len(paths) != 1 or paths[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2

    def run():
        ledger = storage.path(paths[0], "RUN_DIR") / goodput.FILE
        try:
            events = goodput.read(ledger)
        except (OSError, UnicodeDecodeError) as e:
            raise errors.UserError(f"{ledger}: cannot read it ({storage.error_text(e)}): RUN_DIR is a run's "
                                   "directory, base_output_directory/run_name") from None
        if not any("start" in e for e in events):
            raise errors.UserError(f"{ledger}: holds no start of a run")
        summary = goodput.summarize(events)
        if as_json:
            print(json.dumps(summary, indent=1))
            return 0
        print(goodput.line(summary))
        wall = summary["wall_s"] or 1.0
        print(f"  {'productive':<11}{summary['productive_s']:10.1f} s {100 * summary['goodput']:6.1f}%  "
              f"({summary['steps']} steps kept)")
        for cause, s in summary["badput"].items():
            print(f"  {goodput.NAMES.get(cause, cause):<11}{s:10.1f} s {100 * s / wall:6.1f}%")
        return 0
    return errors.exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
