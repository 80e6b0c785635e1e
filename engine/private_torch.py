"""The private PyTorch the project reads, in one place: no public API gives either value. Each
gives "unknown" (0, None) where a PyTorch release has removed it, and
tests/test_train_utils.py::test_the_private_pytorch_read_exists checks that each still exists on
the oldest supported PyTorch (2.7) and the newest."""

import torch


def cudagraph_skips():
    """How many compiled graphs PyTorch has run without CUDA graphs in this process so far,
    counted as each is compiled: a process that compiles the same model again (tools/benchmark.py)
    reuses the first compile and counts nothing new. Inductor's counter: PyTorch only logs a
    skip otherwise (under TORCH_LOGS). 0 where the counter is gone."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return counters["inductor"]["cudagraph_skips"]


def nccl_trace_dumper():
    """The function that returns this process's NCCL flight recorder (its last collectives) as
    bytes, the file NCCL's watchdog writes on its own timeout; None without NCCL, or where it is
    gone."""
    return getattr(getattr(torch._C, "_distributed_c10d", None), "_dump_nccl_trace", None)
