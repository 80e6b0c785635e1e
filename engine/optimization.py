"""What the loop does with recipe.py's optimizer and learning-rate schedule, whatever they are.

The optimizer: the fused-kernel safety, its state moved to this device after a resume, and its
name and hyperparameters read from the object itself.

The loss, tried on two images' logits before the first step.

The schedule (when recipe.make_scheduler returns None; its own is checked in
engine/own_scheduler.py): recipe.lr_factor's shape (warm-up, then cosine or constant) over the
run's optimizer steps, stepped once per step. A run resumed with a larger --epochs is extended
by a warm restart, a second cycle; the cycles are kept in the checkpoints, so every later
resume follows the same schedule.
``factor(step, total_steps, warmup_steps)`` is the recipe's shape of one cycle (a multiplier
of --base-lr); nothing here knows its formula.
"""

import array
import operator
import warnings
from functools import partial
from typing import NamedTuple

import torch

from engine.errors import UserError, first_line, type_named
from engine.log import count

KERNEL_OPTIONS = ("fused", "foreach")  # param_group keys that choose an implementation, not a recipe
SHOWN = ("lr", "momentum", "dampening", "nesterov", "betas", "alpha", "eps", "weight_decay")  # in this order


def prefill_momentum(optimizer):
    """Momentum buffers of a fused SGD that exist from the start: zeros in each parameter's
    layout. The first step then computes what SGD's own first step does (buffer = gradient,
    as dampening is 0). Left to itself the fused kernel creates them with ``empty_like`` on
    its first call, and when the GradScaler skips that step (an fp16 overflow, common at the
    initial scale of 65536) it returns before filling them: training would go on from
    uninitialised memory. Only SGD's own state is written; every other optimizer is left as
    it is (AdamW's fused kernel, for one, starts from zeros itself)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return
    for group in optimizer.param_groups:
        if group.get("fused") and group["momentum"] and not group["dampening"]:
            for param in group["params"]:
                optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))


def kernel_choices(optimizer):
    """The implementation each param_group was built with (fused, foreach), to put back after
    ``load_state_dict``, which would take the saved run's (another device's) instead."""
    return [{key: group[key] for key in KERNEL_OPTIONS if key in group} for group in optimizer.param_groups]


def fit_optimizer_to_params(optimizer, kernels):
    """After ``load_state_dict`` of a checkpoint saved elsewhere: this device's kernels
    (``kernels`` from kernel_choices), and every state tensor in its parameter's memory
    layout. ``load_state_dict`` keeps the saved layout (NCHW from a CPU run or
    --no-channels-last), and fused CUDA kernels need parameters, gradients and state to share
    strides. It also placed each step count by the saved run's kernels (on the CPU for
    unfused ones); a fused or capturable kernel here wants it on the parameter's device, as a
    float32 (torch's own rule for them)."""
    for group, chosen in zip(optimizer.param_groups, kernels):
        group.update(chosen)
        on_device = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            state = optimizer.state[param]
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param).copy_(value)  # empty_like keeps param's strides
            if on_device and torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(dtype=torch.float32, device=param.device)


def _value(value):
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_optimizer(optimizer):
    """'SGD (lr 0.01, momentum 0.9, nesterov True, weight_decay 0.0005)': the class and the
    hyperparameters its param_groups hold; where groups differ, each group's value."""
    groups = optimizer.param_groups
    shown = []
    for key in SHOWN:
        values = [group.get("initial_lr", group["lr"]) if key == "lr" else group.get(key) for group in groups]
        if values[0] is None or (key in ("momentum", "dampening") and not any(values)):
            continue
        text = _value(values[0]) if all(v == values[0] for v in values) else " / ".join(map(_value, values))
        shown.append(f"{key} {text}")
    sizes = f", {len(groups)} parameter groups" if len(groups) > 1 else ""
    return f"{type(optimizer).__name__} ({', '.join(shown)}{sizes})"


def describe_loss(loss_fn):
    """'CrossEntropyLoss (label_smoothing 0.1)': the class and its real-valued settings."""
    settings = [f"{key} {_value(value)}" for key, value in vars(loss_fn).items() if isinstance(value, float)]
    return type(loss_fn).__name__ + (f" ({', '.join(settings)})" if settings else "")


def check_loss(loss_fn, num_classes, soft_labels, device):
    """recipe.make_loss's loss tried at start on logits (2, num_classes) and labels (2,), or soft
    labels (2, num_classes) under MixUp or CutMix, on ``device``: it must return a scalar that
    backpropagates to the logits. Else one line, where the first step would end in a
    traceback from backward() ("grad can be implicitly created only for scalar outputs")."""
    logits = torch.zeros(2, num_classes, device=device, requires_grad=True)
    labels = (torch.full((2, num_classes), 1 / num_classes, device=device) if soft_labels
              else torch.zeros(2, dtype=torch.int64, device=device))
    given = f"logits (2, {num_classes}) and {'soft ' if soft_labels else ''}labels {tuple(labels.shape)}"
    name = type(loss_fn).__name__
    try:
        with warnings.catch_warnings():  # said by the step again, if they are the loss's own
            warnings.simplefilter("ignore")  # MSELoss: "a target size that is different to the input size"
            loss = loss_fn(logits, labels)
    except Exception as err:
        raise UserError(f"recipe.make_loss's {name} fails on {given}: {type(err).__name__}: {first_line(err)}") from None
    if not (torch.is_tensor(loss) and loss.numel() == 1 and loss.requires_grad):
        got = (f"{'a constant' if not loss.requires_grad else 'a tensor'} of shape {tuple(loss.shape)}"
               if torch.is_tensor(loss) else type(loss).__name__)
        raise UserError(f"recipe.make_loss's {name} returns {got} for {given}: the loop needs a scalar that "
                        "backpropagates to the logits (reduction='mean' or 'sum')")


def check_optimizer(optimizer):
    """recipe.make_optimizer's result: a torch optimizer, else one line (the loop and the
    checkpoints read its param_groups and state_dict)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"recipe.make_optimizer returned {type_named(optimizer)}, not a torch.optim.Optimizer "
                        "(SGD, AdamW, ...) of the model's parameters")


def check_batch_transform(transform, image_shape, num_classes, device):
    """recipe.make_batch_transform's ``transform`` (None: none) tried at start on a batch of two
    images (2, C, H, W) of ``image_shape`` (H, W, C) and labels (2,) on ``device``, with torch's
    random state put back after: it must return (images of that shape, labels (2,) or soft
    labels (2, num_classes)). Else one line, where the first step would end in a traceback."""
    if transform is None:
        return
    height, width, channels = image_shape
    images = torch.zeros(2, channels, height, width, device=device)
    labels = torch.zeros(2, dtype=torch.int64, device=device)
    given = f"images {tuple(images.shape)} and labels (2,)"
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            out = transform(images, labels)
        except Exception as err:
            raise UserError(f"recipe.make_batch_transform's transform fails on {given}: {type(err).__name__}: "
                            f"{first_line(err)}") from None
    pair = isinstance(out, (tuple, list)) and len(out) == 2 and all(torch.is_tensor(part) for part in out)
    if not (pair and out[0].shape == images.shape and tuple(out[1].shape) in ((2,), (2, num_classes))):
        got = (f"({', '.join(shape_of(part) for part in out)})" if isinstance(out, (tuple, list)) else shape_of(out))
        raise UserError(f"recipe.make_batch_transform's transform returns {got} for {given}: the loop needs "
                        f"(images {tuple(images.shape)}, labels (2,) or soft labels (2, {num_classes}))")


def shape_of(value):
    """"float32 (2, 3)" for a tensor, "a list" for anything else: what a check says it got."""
    return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}" if torch.is_tensor(value) else (
        type_named(value))


# ---------------------------------------------------------------------------------------------
# The learning-rate schedule's cycles.

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


# The most optimizer steps make_scheduler tabulates: 80 MB and about 20 s at start on a 2-core
# x86 CPU (2 us a step), 22 times a 90-epoch ImageNet run at batch 256 (450,000 steps). A larger
# --epochs was minutes of start-up, gigabytes of memory growing, and no stop request taken.
MAX_SCHEDULE_STEPS = 10_000_000


def check_schedule_length(epochs, steps_per_epoch):
    """--epochs ``epochs`` refused in one line where lr_factor's schedule would be longer than
    MAX_SCHEDULE_STEPS optimizer steps (recipe.make_scheduler's own scheduler is not tabulated)."""
    total = epochs * steps_per_epoch
    if total > MAX_SCHEDULE_STEPS:
        raise UserError(f"--epochs {epochs}: {total:,} optimizer steps ({count(steps_per_epoch, 'step', 'steps')} per "
                        f"epoch), more than the {MAX_SCHEDULE_STEPS:,} lr_factor's schedule is computed for at start "
                        "(MAX_SCHEDULE_STEPS in engine/optimization.py); lower --epochs, or return a torch scheduler "
                        "of your own from recipe.make_scheduler")


def make_scheduler(optimizer, cycles, factor, total_steps=0):
    """Per-step LR schedule: LambdaLR multiplies each group's initial LR by ``schedule_factor``
    of ``cycles``, computed once for every optimizer step of the run (to the last cycle's end,
    or ``total_steps`` if more): a step looks its factor up in an array and runs no project
    code. 8 bytes a step: a 450,000-step ImageNet run's array is 3.6 MB, made in about a second
    (check_schedule_length bounds it). A step past its end is an IndexError: a caller that
    steps further (tools/benchmark.py) gives the steps it will take as ``total_steps``."""
    cycles = [tuple(c) for c in cycles]
    last = max(total_steps, *(c[2] for c in cycles))
    # Step 0 ... last, inclusive; an item is read back as a Python float.
    factors = array.array("d", (schedule_factor(step, cycles, factor) for step in range(last + 1)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(operator.getitem, factors))


def describe_extension(planned, epochs, base_lr, schedule, cycle, steps_per_epoch):
    """The line of a run extended from ``planned`` to ``epochs`` by ``cycle``, of the recipe's
    --lr-schedule ``schedule`` and --base-lr ``base_lr``."""
    extending = f"Extending the run from {planned} to {epochs} epochs"
    if cycle.start_factor == 1 and schedule != "cosine":  # a constant LR: nothing to restart
        return f"{extending} at the constant learning rate {base_lr:g}"
    then = f"then {schedule} to 0 at epoch {epochs}" if schedule == "cosine" else "then constant"
    if cycle.start_factor > 0.999:  # the run ended at its peak (a run no longer than its warm-up): no restart
        return f"{extending}: the learning rate is at its peak {base_lr:g} already, {then}"
    if not cycle.warmup:  # --warmup-epochs 0, or an extension too short for a warm-up step
        return (f"{extending}: the learning rate goes from {cycle.start_factor * base_lr:.3g} (the next step's on the "
                f"{planned}-epoch schedule) to {base_lr:g} at once (no warm-up steps), {then}")
    steps = count(cycle.warmup, 'step', 'steps')
    return (f"{extending}: warm restart of the learning rate from {cycle.start_factor * base_lr:.3g} back up to "
            f"{base_lr:g} over {steps} ({cycle.warmup / steps_per_epoch:g} epochs), {then}")
