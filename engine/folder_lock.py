"""One run per checkpoint folder. The same job submitted twice with --resume=auto (what the
job scripts pass) would otherwise train twice in one folder, each overwriting and pruning the
other's checkpoints. Global rank 0 holds a lock on CHECKPOINT_DIR/.lock for the whole run;
a second run on the folder is refused in one line naming the holder (Slurm job, host, pid,
since when), exit status 1. The file is removed when the run ends.

The lock is flock(2): the kernel releases it when the holder dies, however it dies, so a
requeued job (its old processes are gone) takes the folder at once. Lustre and NFS honour
flock across nodes when mounted with it; where a file system refuses flock, the file is a
lease instead: the holder rewrites it every LEASE_RENEW_S, and a lease is taken over when it
is stale (older than LEASE_STALE_S), when its pid is gone from this host, or when it belongs
to this Slurm job (a requeue) and is not a live process of this host (two runs in one
allocation).
"""

import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from engine.errors import ResourceProblem

LOCK_NAME = ".lock"
LEASE_RENEW_S = 60
LEASE_STALE_S = 300
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL)  # a file system without flock


def holder_record():
    """Who holds the folder: this process, for the lock file and the refusal line."""
    return {"job": os.environ.get("SLURM_JOB_ID"), "host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def describe_holder(holder):
    """'Slurm job 123, pid 4567 on node1, since 2026-11-25 17:03:00' (what is known of it)."""
    if not isinstance(holder, dict):
        return "a process whose lock file is unreadable"
    job = f"Slurm job {holder['job']}, " if holder.get("job") else ""
    return f"{job}pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}"


def lease_is_free(holder, age_s, me):
    """Whether the lease of ``holder`` (its record, ``age_s`` seconds since it was renewed) may
    be taken by ``me`` (holder_record()) on a file system without flock."""
    if not isinstance(holder, dict) or age_s > LEASE_STALE_S:
        return True
    if holder.get("host") == me["host"] and holder.get("pid") != me["pid"] and _alive(holder.get("pid")):
        return False  # a live process here, of this job too: two runs in one allocation
    if holder.get("job") and holder.get("job") == me["job"]:
        return True  # a requeue of this job: its old processes are gone
    return holder.get("host") == me["host"]  # this host's holder, gone (or this process)


def _alive(pid):
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError) as err:
        return isinstance(err, PermissionError)  # someone else's process is still a process
    return True


class FolderLock:
    """``with FolderLock(directory):`` holds ``directory`` for this process (creating it), or
    raises ResourceProblem naming the run that holds it. Leaves no empty folder behind when
    this run wrote nothing in it."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.file = None
        self.created = []  # the folders made for the lock, deepest first
        self._stop = threading.Event()

    def __enter__(self):
        self.created = [folder for folder in (self.directory, *self.directory.parents) if not folder.exists()]
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            self.file = open(self.path, "a+")
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._refuse(self._read())
            except OSError as err:
                if err.errno not in NO_FLOCK:
                    raise
                self._take_lease()
            if self._still_there():
                break
            self.file.close()  # its holder removed it as we opened it: lock the file there now
        self._write(holder_record())
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self.path.unlink(missing_ok=True)  # while still held: a run that opened it retries on the new file
        self.file.close()  # releases the flock
        for folder in self.created:  # the run wrote nothing there: leave no empty folder behind
            if any(folder.iterdir()):
                break
            folder.rmdir()

    def _still_there(self):
        try:
            return os.stat(self.path).st_ino == os.fstat(self.file.fileno()).st_ino
        except FileNotFoundError:
            return False

    def _read(self):
        self.file.seek(0)
        try:
            return json.loads(self.file.read())
        except ValueError:
            return None

    def _write(self, holder):
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps(holder))
        self.file.flush()

    def _refuse(self, holder):
        self.file.close()
        raise ResourceProblem(f"--checkpoint-dir {self.directory} is in use by another run ({describe_holder(holder)}"
                              f"): two runs in one folder would overwrite each other's checkpoints; wait for it to "
                              "end, or give this run another --checkpoint-dir")

    def _take_lease(self):
        holder = self._read()
        if not lease_is_free(holder, time.time() - os.stat(self.path).st_mtime, holder_record()):
            self._refuse(holder)
        threading.Thread(target=self._renew, name="checkpoint-lease", daemon=True).start()

    def _renew(self):
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                os.utime(self.path)
            except OSError:  # a file system in trouble for a while: the next renewal tries again
                continue
