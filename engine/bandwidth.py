"""Message sizes and the bandwidth of an all-reduce, as nccl-tests defines them: algbw = bytes /
time, busbw = algbw * 2(W - 1)/W (what each rank's link carries in a ring), in GB/s = 1e9
bytes/s. check_network.py measures with them.
"""

import argparse
import re

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
ELEMENT_BYTES = 4  # float32, the gradients' dtype: what DDP all-reduces


def parse_size(text: str) -> int:
    """'1K', '64M', '1G', '256MiB' or '4096' as bytes (K = 1024): an argparse type."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", str(text), re.I)
    if not match or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes such as 4096, 1K, 64M or 1G")
    nbytes = int(match.group(1)) * UNITS[match.group(2).upper()]
    if nbytes % ELEMENT_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of float32 elements (a multiple of 4 bytes)")
    return nbytes


def human_size(nbytes: int) -> str:
    """1024 -> '1 KiB', 67108864 -> '64 MiB', 1536 -> '1.5 KiB', 12 -> '12 B'."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.4g} {unit}"
    return f"{nbytes} B"


def message_sizes(min_size: int, max_size: int) -> list:
    """Bytes per all-reduce: doubling from ``min_size``, ending at ``max_size`` (included even
    when it is not min_size times a power of two, so that --min-busbw judges the size asked for)."""
    sizes = [min_size]
    while sizes[-1] * 2 <= max_size:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == max_size else sizes + [max_size]


def bus_factor(world_size: int) -> float:
    """busbw / algbw of an all-reduce (nccl-tests): each rank sends and receives 2(W-1)/W of
    the buffer in a ring; 0 for one process, which sends nothing."""
    return 2 * (world_size - 1) / world_size


def bandwidths(nbytes: int, time_s: float, world_size: int):
    """(algbw, busbw) in GB/s (1e9 bytes/s); busbw is None for one process."""
    algbw = nbytes / time_s / 1e9
    return algbw, (algbw * bus_factor(world_size) if world_size > 1 else None)


