"""--compile: torch.compile's mode, the CUDA graphs it replays, and its caches kept in the
checkpoint folder, so that a resumed or requeued job reuses the kernels its first start compiled
instead of compiling again.

The mode (--compile-mode auto): reduce-overhead for one process on CUDA. It records the compiled
forward and backward as CUDA graphs and replays them, so the host launches one graph where it
launched a few hundred kernels; the optimizer step stays eager (one fused kernel for all
parameters). PyTorch runs a graph without them where it cannot capture it (a host sync in the
model, an input it cannot keep in place) and says why only under TORCH_LOGS: the run counts the
graphs its first step skipped and says so in one line. The default mode where graphs are not
safe or not measured: on the CPU (no graphs), with --accumulate, under DDP (compile_mode).

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
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError
from engine.folder_lock import NO_FLOCK
from engine.private_torch import cudagraph_skips

GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that replay CUDA graphs

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


@dataclass(frozen=True)
class Compilation:
    """How --compile compiles this run: torch.compile's ``mode``, why that one, where the caches
    are (use_compile_cache's line), and the CUDA-graph skips PyTorch had counted before it."""
    mode: str
    why: str
    cache: str
    skips_before: int = 0

    @property
    def graphs(self):
        """The compiled step replays CUDA graphs: each step must begin with
        torch.compiler.cudagraph_mark_step_begin(), so that PyTorch may reuse the memory of the
        last step's outputs."""
        return self.mode in GRAPH_MODES

    def describe(self):
        """For the start-up block: 'torch.compile mode reduce-overhead (auto on CUDA: ...)'."""
        return f"torch.compile mode {self.mode} ({self.why})"

    def after_first_step(self, seconds, model):
        """The lines after the step that compiled ``model`` (what trains: DDP's wrapper or the
        model) in ``seconds``: its time and cache, and, where PyTorch skipped CUDA graphs for
        graphs it compiled in that step, how many and the likely cause."""
        lines = [f"torch.compile: the first step took {seconds:.1f}s, compiling included; {self.cache}"]
        skipped = cudagraph_skips() - self.skips_before
        if self.graphs and skipped:
            lines.append(f"torch.compile: PyTorch ran {skipped} compiled graph(s) without CUDA graphs, so those "
                         f"steps launch every kernel from the host{known_cause(model)}; "
                         "TORCH_LOGS=perf_hints,cudagraphs says why")
        return lines


def prepare_compile(requested, device_type, distributed, accumulate, checkpoint_dir, environ):
    """The run's Compilation for --compile-mode ``requested`` (compile_mode), with its caches in
    ``checkpoint_dir`` (use_compile_cache)."""
    mode, why = compile_mode(requested, device_type, distributed, accumulate)
    return Compilation(mode, why, use_compile_cache(checkpoint_dir, environ), cudagraph_skips())


def compile_mode(requested, device_type, distributed=False, accumulate=1):
    """(torch.compile's mode, why) for --compile-mode ``requested`` on ``device_type``;
    ``distributed``: the model trains in DDP; ``accumulate``: --accumulate's micro-batches per
    step. auto is reduce-overhead where CUDA graphs were measured and are safe: one process on
    CUDA, one micro-batch per step (24,607 img/s against 23,906 for the default mode on an H200,
    BENCHMARKS.md 2026-11-27). Else the default mode: the CPU has no CUDA graphs; with
    --accumulate the first micro-batches' gradients would live in the graphs' memory, which the
    next replay overwrites (pytorch/pytorch#169545, #96693), so a graph mode is refused there;
    under DDP, graphs with BatchNorm are a known slowdown (pytorch/pytorch#139207), not measured
    here: asked for, they run, and a graph PyTorch skips is said after the first step."""
    if requested in GRAPH_MODES and device_type != "cuda":
        instead = "max-autotune-no-cudagraphs" if requested == "max-autotune" else "default"
        raise UserError(f"--compile-mode {requested} replays CUDA graphs, which need a CUDA GPU; on the "
                        f"{device_type.upper()} use --compile-mode {instead}")
    if requested in GRAPH_MODES and accumulate > 1:
        raise UserError(f"--compile-mode {requested} replays CUDA graphs, whose next replay would overwrite the "
                        "gradients of --accumulate's first micro-batches; use --compile-mode default with --accumulate")
    if requested != "auto":
        return requested, "--compile-mode"
    if device_type != "cuda":
        return "default", "auto on the CPU, where there are no CUDA graphs"
    if accumulate > 1:
        return "default", "auto with --accumulate, whose micro-batches' gradients CUDA graphs would overwrite"
    if distributed:
        return "default", ("auto under DDP, where CUDA graphs are not measured (with BatchNorm a known slowdown, "
                           "pytorch/pytorch#139207); --compile-mode reduce-overhead tries them")
    return "reduce-overhead", "auto on CUDA: forward and backward replayed as CUDA graphs"


def known_cause(model):
    """', a known PyTorch limit with DDP and BatchNorm (pytorch/pytorch#139207)' when ``model``
    is DDP-wrapped and has BatchNorm layers, else ''."""
    from torch import nn

    batch_norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    if ddp and any(isinstance(m, batch_norms) for m in model.modules()):
        return ", a known PyTorch limit with DDP and BatchNorm (pytorch/pytorch#139207)"
    return ""
