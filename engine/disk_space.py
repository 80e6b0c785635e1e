"""Disk space for people: a write that fails because the disk or the quota is full is one
line with the space it needed and the space free, so the user knows what to clear. No torch
import (tools/report.py and engine/log.py use it on any machine).
"""

import errno
import shutil
from pathlib import Path

from engine.errors import ResourceProblem

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or the user's quota on it


def size_text(nbytes):
    """Bytes for people: 12.3 kB, 620.3 MB, 2.41 GB, 80 GB."""
    if nbytes < 1e6:
        return f"{nbytes / 1e3:.1f} kB"
    if nbytes < 1e9:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e9:.{2 if nbytes < 1e10 else 0}f} GB"


def free_bytes(path):
    """Bytes free to this user on the file system that holds (or will hold) ``path``."""
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def space_problem(what, path, err, needed=None):
    """The one line for a write of ``what`` to ``path`` that failed with OSError ``err``: with the
    space it needed and the space free when the disk or the quota is full."""
    why = err.strerror or str(err)
    if err.errno in NO_SPACE:
        why += (f": needs {'about ' + size_text(needed) if needed else 'more'}, "
                f"{size_text(free_bytes(path))} free there")
    return ResourceProblem(f"cannot write {what} {path} ({why})")


def space_warning(what, path, err, then):
    """The warning for a diagnostic output (a TensorBoard event, a profiler trace) that could
    not be written: training goes on without it, ``then`` says what happens instead."""
    return f"WARNING: {space_problem(what, path, err)}; {then}"
