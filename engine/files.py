"""Files that are never half-written, and outputs checked before any work: a folder that
cannot be written (someone else's project area, a read-only mount) is one line at start,
not a traceback after hours of training. A write that fails for want of space says how much
it needed and how much was free.
"""

import errno
import json
import os
import tempfile
from pathlib import Path

import torch

from engine.errors import UserError, free_bytes, space_problem
from engine.processes import from_rank0

def tensor_bytes(obj):
    """The bytes of the tensors in a nested dict/list: about the size torch.save will write."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def atomic_save(obj, path, what="file", new=False):
    """torch.save to a temporary file, fsync, rename: a crash never leaves a truncated file, and
    a full disk is a ResourceProblem naming ``what``, the space needed and the space free (the
    older file of that name, if any, is untouched). A write that cannot fit is not started.
    ``new``: the file must not exist; one that another process wrote meanwhile is kept, and
    NameTaken raised (a hard link, not a rename, makes the name: atomic, never over a file)."""
    path = Path(path)
    needed = tensor_bytes(obj)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # the first write creates the folder
        if needed > free_bytes(path.parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if not new or not link_new(tmp, path):
            os.replace(tmp, path)
        tmp.unlink(missing_ok=True)
    except BaseException as err:  # disk full, Ctrl-C: leave no partial file behind
        tmp.unlink(missing_ok=True)
        interrupt = interrupt_behind(err)
        if interrupt is not None and interrupt is not err:
            raise interrupt from None
        if isinstance(err, OSError):
            raise space_problem(what, path, err, needed) from None
        raise


def interrupt_behind(err):
    """The KeyboardInterrupt (a second Ctrl-C: engine/stopping.py) ``err`` is, or was raised
    while handling; else None. torch.save's zip writer, interrupted within a record, fails
    again as it closes ("RuntimeError: ... unexpected pos"), which would hide the interrupt:
    a traceback and exit status 1 instead of its line and 130."""
    while err is not None and not isinstance(err, KeyboardInterrupt):
        err = err.__context__
    return err


class NameTaken(Exception):
    """atomic_save(new=True) found its file's name taken: the file there is another's, kept."""


def link_new(source, path):
    """Hard-link ``source`` as ``path`` when no file has that name (NameTaken if one has): True,
    or False on a file system without hard links (then a rename has to do)."""
    try:
        os.link(source, path)
    except FileExistsError:
        raise NameTaken(path) from None
    except OSError as err:
        if err.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            return False
        raise
    return True


def check_outputs(output_files, output_folders, group=None, json_lines=()):
    """Every output path of the command line ({flag: path or None} of files and of folders),
    checked by global rank 0 before any data is read or any step trained: a folder that cannot
    be written (someone else's project area, a read-only mount) is one line and exit status 2 at
    start, not a traceback after hours of training that loses the model. The files of the
    flags in ``json_lines`` are appended to: one that exists must be a file of JSON lines.
    Every rank gets rank 0's verdict (``group``: the gloo control group)."""
    def check():
        named = {}  # each file's flag, by its absolute path: two flags on one file would overwrite each other
        for flag, path in output_files.items():
            if path and named.setdefault(os.path.abspath(path), flag) != flag:
                raise UserError(f"{named[os.path.abspath(path)]} and {flag} name the same file, {path}: give each "
                                "its own")
        folders = {os.path.abspath(directory): flag for flag, directory in output_folders.items() if directory}
        for flag, path in output_files.items():  # a folder not made yet is no folder to check_writable
            if path and os.path.abspath(path) in folders:
                raise UserError(f"{flag} {path} is the folder of {folders[os.path.abspath(path)]}: give {flag} a "
                                "file's name (a file in that folder is fine)")
        for flag, directory in output_folders.items():  # first: a file in one (DIR/weights.pt) names the folder
            if directory:
                check_writable_dir(directory, flag)
        for flag, path in output_files.items():
            if path:
                check_writable(path, flag)
                if flag in json_lines:
                    check_json_lines(path, flag)

    from_rank0(check, group)


def check_writable(path, flag):
    """Fail at start, not after hours of training, when an output file cannot be written.
    Nothing is left behind: folders are made when the file is first written, so a command
    that fails leaves no empty folder. The folder must take new files even when the file
    exists: it is replaced through a temporary file beside it (atomic_save, reconcile_metrics).
    (os.path, not pathlib: a folder that cannot be entered is "not there", not a traceback.)"""
    if str(path).endswith(("/", os.sep)):  # Path() would make new/ the file new
        raise UserError(f"{flag} {path}: not a writable file path (it ends in {os.sep}, as a folder's name does)")
    path = Path(path)
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: not a writable file path (it is a folder)")
    if os.path.exists(path):
        try:
            open(path, "ab").close()  # opened for appending, nothing written: the file is unchanged
        except OSError as err:
            raise UserError(f"{flag} {path}: cannot write it ({err.strerror or err})") from None
    why = _why_not_creatable(path.parent)
    if why:
        verb = "write in" if os.path.isdir(path.parent) else "create its folder"
        raise UserError(f"{flag} {path}: cannot {verb} {path.parent} ({why})")


def check_json_lines(path, flag, probe_bytes=1 << 16):
    """A file that is appended to (--metrics-file) takes JSON lines after JSON lines: an
    existing file whose first line is not a JSON object (a script, a weights file: a name typed
    for another) is refused, as nothing the user wrote is changed."""
    if not os.path.isfile(path):  # none yet; or a pipe, a terminal: nothing to read, nothing to spoil
        return
    try:
        with open(path, "rb") as f:
            first, newline, _ = f.read(probe_bytes).lstrip().partition(b"\n")  # the first line that is not blank
    except OSError:  # unreadable (write-only): appending is what it allows
        return
    try:
        ok = not first or isinstance(json.loads(first), dict)
    except ValueError:  # not JSON, not text at all, or the half-written first line of a killed run
        ok = not newline and first.startswith(b"{")  # (reconcile_metrics drops that one)
    if not ok:
        raise UserError(f"{flag} {path} exists and is not a file of JSON lines (another file's name?): its lines "
                        "would be appended to it; give a new file name, or a metrics file of an earlier run")


def check_writable_dir(directory, flag):
    """The same for a folder that files will be written into (created by the first write)."""
    directory = Path(directory)
    why = _why_not_creatable(directory)
    if why:
        raise UserError(f"{flag} {directory}: cannot {'write in' if os.path.isdir(directory) else 'create'} it "
                        f"({why})")


def nearest_existing(path):
    """``path`` (absolute) or its nearest ancestor that exists: where a write of it begins to
    create folders. os.path.exists is False for a name too long or a folder that cannot be
    searched, so this never raises."""
    existing = Path(path).absolute()
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    return existing


def _why_not_creatable(directory):
    """Why ``directory`` cannot be (or become) a folder that files can be written into, or None.
    The nearest existing folder is probed with a real file, removed at once: permissions,
    ACLs, a read-only mount and root squash all show, which os.access misses for root."""
    existing = nearest_existing(directory)
    if not os.path.isdir(existing):
        return f"{existing} is a file" if existing != directory.absolute() else "a file of that name exists"
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".write-test-")
    except OSError as err:
        if err.errno == errno.ENOENT:  # the folder exists: a file system that makes no files, as /proc
            return f"{existing} takes no new files: it is not a folder for data"
        return f"{existing}: {err.strerror or err}"
    os.close(handle)
    os.unlink(probe)
    return None


