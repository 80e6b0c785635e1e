"""A small network without BatchNorm or dropout (so micro-batches change nothing but rounding)
that records the size of the last batch it trained on (the buffer last_batch: what
--accumulate made of the batch) and can run out of memory on purpose: OOM_AT=train:N or
eval:N raises at its N-th training or evaluation forward in this process (OOM_RANK=R: in
global rank R's alone); OOM_KIND=cuda raises torch.OutOfMemoryError as CUDA's allocator
does, cpu the CPU allocator's RuntimeError (--model tests/oom_net.py:Net)."""

import os

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                                    nn.Flatten(), nn.Linear(128, num_classes))
        self.calls = {"train": 0, "eval": 0}
        self.register_buffer("last_batch", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        phase = "train" if self.training else "eval"
        if self.training:
            self.last_batch.fill_(x.shape[0])
        self.calls[phase] += bool(x.abs().sum() > 0)  # not the two zero images that probe the model at start
        this_rank = os.environ.get("OOM_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0")
        if os.environ.get("OOM_AT") == f"{phase}:{self.calls[phase]}" and this_rank:
            if os.environ.get("OOM_KIND") == "cpu":
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                                   "memory: you tried to allocate 2684354560 bytes. Error code 12")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.layers(x)
