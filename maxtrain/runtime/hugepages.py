"""Transparent huge pages for XLA's host buffers on Linux, which makes CPU steps faster.

XLA:CPU takes a step's large temporaries from malloc, and glibc maps fresh memory for each of them
every step: with 4 KiB pages, tens of thousands of page faults per step. With the
glibc tunable `glibc.malloc.hugetlb=1`, glibc asks for 2 MiB pages for such mappings (honoured when the
kernel's transparent huge pages are in "madvise" mode, the usual default) and the faults all but
vanish. glibc reads tunables only at process start, so the entry point re-executes itself once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def reexec_with_huge_pages() -> None:
    """Re-executes this process with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` where that helps.

    Returns without doing anything if GLIBC_TUNABLES is already set (set it, even to "", to opt out),
    or if transparent huge pages are not in madvise mode ("always" needs no help, "never" allows none).
    """
    if "GLIBC_TUNABLES" in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        if "[madvise]" not in THP_MODE.read_text():
            return
    except OSError:
        return
    sys.stdout.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
