"""recipe.make_scheduler's own LR scheduler (when it returns one instead of None), checked
at start: a scheduler the loop cannot step after every optimizer step is refused in one line,
and a length that is not the run's (epochs where steps were meant) gets a Note. Imported by a
run with a scheduler of its own alone; lr_factor's schedule is engine/optimization.py's.
"""

import torch

from engine.errors import UserError


def check_scheduler(scheduler, total_steps):
    """recipe.make_scheduler's return value (None: lr_factor's schedule), checked at start: a
    scheduler the loop can step with no argument after each of the run's ``total_steps``
    optimizer steps. Else one line, where the run would end in a traceback at its first step
    (or, for a OneCycleLR made too short, at its last)."""
    schedulers = torch.optim.lr_scheduler
    if scheduler is None:
        return
    if isinstance(scheduler, schedulers.ReduceLROnPlateau):  # its step() takes the metric
        raise UserError("recipe.make_scheduler returned ReduceLROnPlateau, which steps once per epoch on a validation "
                        "metric; the loop steps the scheduler after each optimizer step, with no argument: return "
                        "a scheduler of steps (OneCycleLR, MultiStepLR, LambdaLR, ...)")
    if not isinstance(scheduler, schedulers.LRScheduler):
        raise UserError(f"recipe.make_scheduler returned {type(scheduler).__name__}, not a torch.optim.lr_scheduler "
                        "scheduler (or None for lr_factor's schedule)")
    if not hasattr(scheduler, "last_epoch"):  # ChainedScheduler: the loop counts the run's steps by it
        raise UserError(f"recipe.make_scheduler returned {type(scheduler).__name__}, which keeps no step count "
                        "(last_epoch); chain schedulers with SequentialLR, or write the shape in lr_factor")
    if isinstance(scheduler, schedulers.OneCycleLR) and scheduler.total_steps < total_steps:
        raise UserError(f"recipe.make_scheduler's OneCycleLR has total_steps {scheduler.total_steps}, and the run takes "
                        f"{total_steps} optimizer steps: it would stop the run at step {scheduler.total_steps + 1}; "
                        "give it total_steps=total_steps")


def schedule_length_notes(scheduler, total_steps, steps_per_epoch):
    """Start-up notes for recipe.make_scheduler's ``scheduler`` (None: lr_factor's, none) whose
    length, in the optimizer steps the loop steps it by, is not the run's ``total_steps``: a
    length in epochs where steps were meant (T_max=epochs) makes a cosine rise and fall again
    every 2 x T_max steps, and a schedule longer than the run ends it before the LR anneals;
    a decay that torchvision's references count in epochs (StepLR, MultiStepLR, ExponentialLR)
    comes more than once in ``steps_per_epoch`` (decay_note). (A OneCycleLR shorter than the
    run is refused in check_scheduler; LinearLR's warm-up is meant to be shorter.)"""
    schedulers = torch.optim.lr_scheduler
    decay = decay_note(scheduler, total_steps, steps_per_epoch)
    if decay:
        return [decay]
    lengths = ((schedulers.OneCycleLR, "total_steps"), (schedulers.CosineAnnealingLR, "T_max"),
               (schedulers.PolynomialLR, "total_iters"), (schedulers.LinearLR, "total_iters"))
    attribute = next((name for kind, name in lengths if isinstance(scheduler, kind)), None)
    length = getattr(scheduler, attribute, None) if attribute else None
    if not length or length == total_steps:
        return []
    said = (f"Note: recipe.make_scheduler's {type(scheduler).__name__} has {attribute}={length} optimizer steps and "
            f"this run takes {total_steps}: ")
    if length > total_steps:
        return [said + f"the run ends {total_steps / length:.0%} of the way through the schedule, whose LR never "
                       "reaches its end (make_scheduler's total_steps is the run's length in optimizer steps)"]
    if isinstance(scheduler, schedulers.CosineAnnealingLR):
        return [said + f"the LR falls and rises again every {2 * length} steps (T_max=total_steps anneals it once "
                       "over the run)"]
    if isinstance(scheduler, schedulers.PolynomialLR):
        return [said + f"the LR stays at its final value for the last {total_steps - length} steps"]
    return []


def decay_note(scheduler, total_steps, steps_per_epoch):
    """The Note for a StepLR, MultiStepLR or ExponentialLR that decays the LR faster than an
    epoch's steps allow for a length in epochs: StepLR(step_size=30) or milestones=[30, 60] meant
    as epochs, which a per-step loop reaches within the first epoch, or an ExponentialLR whose
    gamma per step leaves less than a tenth of the LR after one epoch. None otherwise."""
    schedulers, name = torch.optim.lr_scheduler, type(scheduler).__name__
    per_epoch = "steps_per_epoch = total_steps // args.epochs"
    if isinstance(scheduler, schedulers.StepLR) and scheduler.step_size < steps_per_epoch:
        setting, decays = f"step_size={scheduler.step_size}", total_steps // scheduler.step_size
        fix = f"for epochs, multiply it by {per_epoch}"
    elif isinstance(scheduler, schedulers.MultiStepLR) and min(scheduler.milestones) < steps_per_epoch:
        setting = f"milestones={sorted(scheduler.milestones)}"
        decays = sum(n for milestone, n in scheduler.milestones.items() if milestone <= total_steps)
        fix = f"for epochs, multiply them by {per_epoch}"
    elif isinstance(scheduler, schedulers.ExponentialLR) and scheduler.gamma ** steps_per_epoch < 0.1:
        setting, decays = f"gamma={scheduler.gamma}", total_steps
        fix = f"for a gamma per epoch, give gamma ** (1 / steps_per_epoch), {per_epoch}"
    else:
        return None
    return (f"Note: recipe.make_scheduler's {name} ({setting}) counts optimizer steps, {steps_per_epoch} an epoch "
            f"here: the LR decays {decays} times over the run's {total_steps} steps, to {scheduler.gamma ** decays:.2g}"
            f" times its start ({fix})")
