"""--compile: torch.compile's caches kept in the checkpoint folder, so that a resumed or
requeued job reuses the kernels its first start compiled instead of compiling again.

Inductor keeps its FX-graph, AOTAutograd and autotuning caches, and Triton its GPU kernels,
under TORCHINDUCTOR_CACHE_DIR (the caches are on by default in every supported PyTorch, and
the variable is read when the first graph compiles). Its default, /tmp/torchinductor_USER, is
on the node: gone when the job ends, and elsewhere when a requeued job starts on another
node. The entries are keyed by the graph, the PyTorch version and the device, so a cache
written by another run or GPU is missed, never used wrongly; the ranks of a job share it
(entries are written atomically, under flock(2) locks: a file system mounted without flock,
some Lustre and NFS mounts, keeps PyTorch's default instead).
"""

import fcntl
import tempfile
from pathlib import Path

from engine.folder_lock import NO_FLOCK

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
CACHE_FOLDER = "compile_cache"  # inside --checkpoint-dir
DEFAULT = "compile cache in PyTorch's default folder on this node (/tmp/torchinductor_*)"


def use_compile_cache(checkpoint_dir, environ, temp_dir=None):
    """Point torch.compile's caches at ``checkpoint_dir``/compile_cache (an absolute path) by
    setting TORCHINDUCTOR_CACHE_DIR in ``environ`` (os.environ: read at each compile), unless
    the user set it. PyTorch writes its default there on first use (importing torchvision
    does), so a value that is that default, ``temp_dir``/torchinductor_USER, counts as unset.
    Returns where the caches are, for the start-up block."""
    value = environ.get(CACHE_VARIABLE)
    default = value and Path(value).parent == Path(temp_dir or tempfile.gettempdir()) and \
        Path(value).name.startswith("torchinductor_")
    if value and not default:
        return f"compile cache {value} (from {CACHE_VARIABLE})"
    if not checkpoint_dir:
        return f"{DEFAULT}: without --checkpoint-dir a requeued job compiles again"
    path = Path(checkpoint_dir).absolute() / CACHE_FOLDER
    path.mkdir(parents=True, exist_ok=True)
    if not takes_flock(path):
        return f"{DEFAULT}: the file system of {checkpoint_dir} takes no flock(2) locks, which the cache's need"
    environ[CACHE_VARIABLE] = str(path)
    if any(path.iterdir()):
        return f"compile cache {path}, with what an earlier start compiled: reused where it fits"
    return f"compile cache {path}: a resumed or requeued job reuses what this start compiles"


def takes_flock(directory):
    """Whether the file system of ``directory`` grants flock(2) locks (a temporary file's)."""
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in NO_FLOCK:
            raise
        return False
    return True
