"""What the loop does with whatever optimizer recipe.py builds: the fused-kernel safety,
moving its state to this device after a resume, refusing a resume with another optimizer
class, and naming it (with its hyperparameters) from the object itself.
"""

import torch

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
    strides."""
    for group, chosen in zip(optimizer.param_groups, kernels):
        group.update(chosen)
        for param in group["params"]:
            state = optimizer.state[param]
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param).copy_(value)  # empty_like keeps param's strides


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
