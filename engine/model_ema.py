"""--model-ema's machinery: how AveragedModel averages (floating-point tensors only) and when
the loop updates it. recipe.make_model_ema builds the average; the loop calls update_model_ema.
"""

from torch.optim.swa_utils import get_ema_multi_avg_fn


def ema_of_floats(decay):
    """AveragedModel's multi_avg_fn: torch's moving average (get_ema_multi_avg_fn) of floating-point
    tensors, a copy of the others (BatchNorm's batch count, which torch's would round down until
    it stops growing); AveragedModel hands over one dtype per call."""
    average = get_ema_multi_avg_fn(decay)

    def update(averaged, current, count):
        if averaged[0].is_floating_point():
            average(averaged, current, count)
        else:
            for tensor, model_tensor in zip(averaged, current, strict=True):
                tensor.copy_(model_tensor)
    return update


def update_model_ema(ema, model, step, warmup_steps, every):
    """After optimizer step ``step`` (1-based): every ``every``-th step the average takes in
    ``model``. Up to the end of the LR warm-up (``warmup_steps``) it restarts after each update,
    so the next one copies the model, as torchvision's references do: the average never holds
    the random initial weights. One host sync per update: AveragedModel reads its count."""
    if step % every:
        return
    ema.update_parameters(model)
    if step <= warmup_steps:
        ema.n_averaged.fill_(0)
