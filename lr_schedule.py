"""The learning-rate schedule: linear warm-up to --base-lr, then cosine to 0 at the last step
of --epochs (or constant), stepped once per optimizer step. A run resumed with a larger
--epochs is extended by a warm restart, a second cycle; the cycles are kept in the
checkpoints, so every later resume follows the same schedule.
"""

import math
from functools import partial
from typing import NamedTuple

import torch


def lr_factor(step, total_steps, warmup_steps, schedule):
    """Multiplier of --base-lr for optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps`` (reaching 1 at the last warm-up step), then constant or cosine to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class Cycle(NamedTuple):
    """One stretch of the LR schedule: from optimizer step ``start`` on, the factor of --base-lr
    rises linearly from ``start_factor`` to 1 over ``warmup`` steps, then follows --lr-schedule
    to 0 at step ``end``. A run has one; each extension (a resume with a larger --epochs) adds one."""
    start: int
    warmup: int
    end: int
    start_factor: float = 0.0


def first_cycle(epochs, warmup_epochs, steps_per_epoch):
    return Cycle(0, round(warmup_epochs * steps_per_epoch), epochs * steps_per_epoch)


def schedule_factor(step, cycles, schedule):
    """Multiplier of --base-lr for optimizer step ``step`` (0-based) in the newest cycle that has
    begun. The first cycle is exactly ``lr_factor``; an extension's warm-up starts from the
    factor the run had reached (nearly 0 at the end of a cosine), so the LR does not jump."""
    cycle = Cycle(*max((c for c in cycles if c[0] <= step), key=lambda c: c[0]))
    factor = lr_factor(step - cycle.start, cycle.end - cycle.start, cycle.warmup, schedule)
    if step - cycle.start < cycle.warmup:
        factor = cycle.start_factor + (1 - cycle.start_factor) * factor
    return factor


def extend(cycles, args, steps_per_epoch, at_step, schedule):
    """The cycles of a run resumed with a larger --epochs at optimizer step ``at_step``: a warm
    restart, from the LR in use back up to --base-lr over --warmup-epochs (at most a quarter of
    the added steps, so a short extension still decays), then --lr-schedule to 0 at the new
    last epoch (for --lr-schedule constant the LR simply returns to --base-lr)."""
    end = args.epochs * steps_per_epoch
    warmup = min(round(args.warmup_epochs * steps_per_epoch), (end - at_step) // 4)
    return [*cycles, Cycle(at_step, warmup, end, schedule_factor(at_step, cycles, schedule))]


def make_scheduler(optimizer, args, steps_per_epoch, cycles=None):
    """Per-step LR schedule (LambdaLR multiplies --base-lr by ``schedule_factor``) of ``cycles``,
    by default the run's first and only one."""
    cycles = [tuple(c) for c in cycles] if cycles else [first_cycle(args.epochs, args.warmup_epochs, steps_per_epoch)]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(schedule_factor, cycles=cycles,
                                                                schedule=args.lr_schedule))


def describe_extension(planned, args, cycle, steps_per_epoch):
    then = f"then {args.lr_schedule} to 0 at epoch {args.epochs}" if args.lr_schedule == "cosine" else "then constant"
    return (f"Extending the run from {planned} to {args.epochs} epochs: warm restart of the learning rate from "
            f"{cycle.start_factor * args.base_lr:.3g} back up to {args.base_lr:g} over {cycle.warmup} steps "
            f"({cycle.warmup / steps_per_epoch:g} epochs), {then}")
