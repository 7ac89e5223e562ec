"""Which code a result came from: the commit of the source tree, for the result documents.

`ROLLPLEX_COMMIT` names it where the tree's git history is not the code's (a copy of a working tree on another
machine, whose .git may be older than its files); else git's HEAD, with "-dirty" when tracked files differ from
it; None outside a git checkout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_commit() -> str | None:
    if os.environ.get("ROLLPLEX_COMMIT"):
        return os.environ["ROLLPLEX_COMMIT"]
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()
