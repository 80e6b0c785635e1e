"""check_network.py's data: values whose all-reduced sums are exact in float32 in any order of
addition, each result compared on the device element by element, and the one line for a
wrong one (which iterations, ranks, hosts, the first wrong element)."""

from typing import NamedTuple

import torch

from engine.bandwidth import human_size
from engine.log import rank_list

DTYPE = torch.float32  # the gradients' dtype, what DDP all-reduces
PERIOD = 7  # element i holds ((i % PERIOD) + 1) * (rank + 1)
EXACT_LIMIT = 2**24  # float32 holds every integer up to this exactly


class Mismatch(NamedTuple):
    """One rank's wrong result in one iteration."""

    rank: int
    iteration: int  # 1-based, warm-up iterations first
    wrong: int  # elements that differ from the expected sum
    index: int  # the first of them
    got: float
    expected: float


def sum_of_ranks(world_size: int) -> int:
    """1 + 2 + ... + W: the factor of the expected sum."""
    return world_size * (world_size + 1) // 2


def max_world_size() -> int:
    """The most ranks whose sums stay exact in float32 (every partial sum below 2**24)."""
    world_size = 1
    while PERIOD * sum_of_ranks(world_size + 1) < EXACT_LIMIT:
        world_size += 1
    return world_size


def pattern(count: int, device) -> torch.Tensor:
    """(i % 7) + 1 for i in 0..count-1, as float32."""
    return (torch.arange(count, dtype=torch.int32, device=device) % PERIOD + 1).to(DTYPE)


def check_result(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """[wrong elements, index of the first, its value, the expected value] as a float64 tensor
    on the device: no wait for the device, so every iteration can be checked. All zero and
    the expected value at index 0 when the result is right."""
    wrong = got != expected
    first = wrong.to(torch.uint8).argmax().view(1)  # the first wrong element (0 when none)
    return torch.cat([wrong.sum().view(1).double(), first.double(), got.index_select(0, first).double(),
                      expected.index_select(0, first).double()])


def mismatches(rank: int, checks) -> list:
    """The iterations in which this rank's result was wrong, from the rows of check_result."""
    return [Mismatch(rank, iteration, int(row[0]), int(row[1]), float(row[2]), float(row[3]))
            for iteration, row in enumerate(checks, start=1) if row[0] > 0]


def mismatch_message(nbytes: int, count: int, iterations: int, found: list, hosts: list, library="",
                     what="all-reduce") -> str:
    """One line for every rank's wrong results of one size (``found``: Mismatch of all ranks;
    ``hosts``: each rank's host name): the iterations (1-based, warm-up first), the ranks and
    their hosts, the first wrong element, and ``library`` (the NCCL that ran, on GPUs)."""
    first = min(found, key=lambda m: (m.iteration, m.rank))
    numbers = sorted({m.iteration for m in found})
    which = f"iteration {numbers[0]}" if len(numbers) == 1 else f"iterations {rank_list(numbers)}"
    ranks = sorted({m.rank for m in found})
    on = sorted({hosts[rank] for rank in ranks})
    where = f"host{'s' if len(on) > 1 else ''} {', '.join(on)}"
    example = f"e.g. element {first.index}: got {first.got}, expected {first.expected}"
    return (f"{what} of {human_size(nbytes)} gave wrong values in {which} of {iterations} on ranks "
            f"{rank_list(ranks)} ({where}) ({first.wrong} of {count} elements on rank {first.rank} in iteration "
            f"{first.iteration}, {example}): data is corrupted between ranks{f' ({library})' if library else ''} "
            "(see docs/network.md)")
