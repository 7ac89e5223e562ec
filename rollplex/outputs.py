"""Where a command writes its files, checked before the work: a run of minutes or hours that can only fail at its end
for want of a folder or a permission is refused at once, in one line."""

from __future__ import annotations

import os
from pathlib import Path

from rollplex.errors import SpecError


def check_output(flag: str, path: str | Path, create: bool = False) -> Path:
    """The folder `flag`'s file `path` goes to exists (made first, with `create`) and this user may write there, and
    `path` itself is not a folder; else a one-line SpecError. Returns `path`."""
    path = Path(path)
    folder = path.absolute().parent  # as the file is written: a quoted '~' is a folder named so
    if create and not folder.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)  # another rank may make it meanwhile
        except OSError as e:
            raise SpecError("", f"{flag} {path}: cannot create {folder} ({e.strerror})",
                            "give a path this user can write") from None  # fmt: skip
    if not folder.is_dir():
        raise SpecError("", f"{flag} {path}: the folder {folder} does not exist", "create it, or give another path")
    if path.is_dir():
        raise SpecError("", f"{flag} {path} is a folder", "give a file's path")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise SpecError("", f"{flag} {path}: this user cannot write there", "give a path this user can write")
    return path
