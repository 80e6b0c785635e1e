"""The learning-rate schedule's cycles: recipe.lr_factor's shape (warm-up, then cosine or
constant) over the run's optimizer steps, stepped once per step. A run resumed with a larger
--epochs is extended by a warm restart, a second cycle; the cycles are kept in the
checkpoints, so every later resume follows the same schedule.

``factor(step, total_steps, warmup_steps)`` is the recipe's shape of one cycle (a multiplier
of --base-lr); nothing here knows its formula.
"""

import operator
from functools import partial
from typing import NamedTuple

import torch

from engine.log import count


class Cycle(NamedTuple):
    """One stretch of the LR schedule: from optimizer step ``start`` on, the factor of --base-lr
    rises linearly from ``start_factor`` to 1 over ``warmup`` steps, then follows the recipe's
    shape to step ``end``. A run has one; each extension (a resume with a larger --epochs) adds one."""
    start: int
    warmup: int
    end: int
    start_factor: float = 0.0


def first_cycle(epochs, warmup_epochs, steps_per_epoch):
    return Cycle(0, round(warmup_epochs * steps_per_epoch), epochs * steps_per_epoch)


def schedule_factor(step, cycles, factor):
    """Multiplier of --base-lr for optimizer step ``step`` (0-based) in the newest cycle that has
    begun. The first cycle is exactly ``factor``; an extension's warm-up starts from the factor
    the run had reached (nearly 0 at the end of a cosine), so the LR does not jump."""
    cycle = Cycle(*max((c for c in cycles if c[0] <= step), key=lambda c: c[0]))
    value = factor(step - cycle.start, cycle.end - cycle.start, cycle.warmup)
    if step - cycle.start < cycle.warmup:
        value = cycle.start_factor + (1 - cycle.start_factor) * value
    return value


def extend(cycles, epochs, warmup_epochs, steps_per_epoch, at_step, factor):
    """The cycles of a run resumed with a larger ``epochs`` at optimizer step ``at_step``: a warm
    restart, from the LR in use back up to --base-lr over ``warmup_epochs`` (at most a quarter
    of the added steps, so a short extension still decays), then the recipe's shape to the new
    last epoch (for a constant schedule the LR simply returns to --base-lr)."""
    end = epochs * steps_per_epoch
    warmup = min(round(warmup_epochs * steps_per_epoch), (end - at_step) // 4)
    return [*cycles, Cycle(at_step, warmup, end, schedule_factor(at_step, cycles, factor))]


def make_scheduler(optimizer, cycles, factor, total_steps=0):
    """Per-step LR schedule: LambdaLR multiplies each group's initial LR by ``schedule_factor``
    of ``cycles``, computed once for every optimizer step of the run (to the last cycle's end,
    or ``total_steps`` if more): a step looks its factor up in a list and runs no project code.
    About 32 bytes a step: a 450,000-step ImageNet run's list is 14 MB, made in under a second.
    A step past its end is an IndexError: a caller that steps further (tools/benchmark.py)
    gives the steps it will take as ``total_steps``."""
    cycles = [tuple(c) for c in cycles]
    last = max(total_steps, *(c[2] for c in cycles))
    factors = [schedule_factor(step, cycles, factor) for step in range(last + 1)]  # step 0 ... last, inclusive
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(operator.getitem, factors))


def describe_extension(planned, epochs, base_lr, schedule, cycle, steps_per_epoch):
    """The line of a run extended from ``planned`` to ``epochs`` by ``cycle``, of the recipe's
    --lr-schedule ``schedule`` and --base-lr ``base_lr``."""
    extending = f"Extending the run from {planned} to {epochs} epochs"
    if cycle.start_factor == 1 and schedule != "cosine":  # a constant LR: nothing to restart
        return f"{extending} at the constant learning rate {base_lr:g}"
    then = f"then {schedule} to 0 at epoch {epochs}" if schedule == "cosine" else "then constant"
    steps = count(cycle.warmup, 'step', 'steps')
    return (f"{extending}: warm restart of the learning rate from {cycle.start_factor * base_lr:.3g} back up to "
            f"{base_lr:g} over {steps} ({cycle.warmup / steps_per_epoch:g} epochs), {then}")
