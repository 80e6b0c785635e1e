"""--finetune: start from weights trained for something else, typically an ImageNet network
for your own classes. Every tensor whose name and shape fit is loaded; the rest (the new
classifier head, or one trained on other classes, as the file records them) keeps its fresh
initialization. Only the last layers may be new: weights
that differ earlier belong to another network, and are refused in one line, as is a file of
which more is left unused than a new head explains (a deeper network of the same family).
--freeze-backbone then trains only the new layers.
"""

from typing import NamedTuple

from engine.errors import UserError
from engine.weights import read_weights

# The file's tensors left unused beyond those a new head explains (as many as the model's new
# ones): more than this fraction of the file is another network, resnet34's weights for a resnet18
# say (96 of 218 tensors unused), whose first layers fit by name and shape alone.
MAX_UNUSED = 0.1


class Finetuned(NamedTuple):
    loaded: tuple   # names of the model's tensors loaded from the file, in state_dict order
    new: tuple      # names of those initialized fresh: the last ones
    ignored: tuple  # names of the file's tensors the model has no place for (an old head of another name)
    note: str       # for the start-up block


def finetune(model, path, freeze, model_name, classes):
    """--finetune PATH [--freeze-backbone] on ``model`` for the data's ``classes`` (names): the
    start-up block's line."""
    tuned = load_fitting(model, path, model_name, classes)
    if not freeze:
        return tuned.note
    return f"{tuned.note}; --freeze-backbone: only {', '.join(freeze_loaded(model, tuned, path))} train"


def load_fitting(model, path, model_name, classes):
    """Load every tensor of ``path`` (a state_dict or a checkpoint) that fits ``model`` by name
    and shape; returns Finetuned. A file that records other classes than ``classes`` (the
    data's names), as many of them, gives no head: its rows belong to its own classes. One line
    when nothing fits, or when a tensor that does not fit comes before one that does (not just
    a new head)."""
    weights = read_weights(path, "--finetune")
    saved, trained_on = weights.state, weights.metadata.get("classes")
    own = model.state_dict()
    other_classes = trained_on is not None and list(trained_on) != list(classes)
    head = head_names(own, len(classes)) if other_classes else ()
    fits = [name for name, tensor in own.items()
            if name in saved and tuple(saved[name].shape) == tuple(tensor.shape) and name not in head]
    new = [name for name in own if name not in fits]
    if not fits:
        first = next(iter(own))
        raise UserError(f"--finetune {path}: none of its {len(saved)} tensors fits {model_name} (the model's first, "
                        f"{first}, is {_shape(saved.get(first))} in the file, {_shape(own[first])} in the model): "
                        "weights of another --model?")
    position = {name: i for i, name in enumerate(own)}  # state_dict order: the head comes last
    last_fit = max(position[name] for name in fits)
    early = [name for name in new if position[name] < last_fit]
    if early:
        raise UserError(f"--finetune {path} does not fit {model_name} beyond its last layers: {early[0]} is "
                        f"{_shape(saved.get(early[0]))} in the file, {_shape(own[early[0]])} in the model"
                        + (f" (and {len(early) - 1} more)" if len(early) > 1 else "")
                        + ": weights of another --model?")
    unused = [name for name in saved if name not in fits]  # no place in the model, or another shape
    if len(unused) > max(len(new), MAX_UNUSED * len(saved)):
        share = len(fits) / len(saved)
        raise UserError(f"--finetune {path}: only {len(fits)} of its {len(saved)} tensors ({share:.0%}) fit "
                        f"{model_name}, and {len(unused)} have no place in it (e.g. {unused[0]}): the weights of "
                        "another network (another depth or width?); use weights of the --model you train")
    model.load_state_dict({name: saved[name] for name in fits}, strict=False)
    ignored = tuple(name for name in saved if name not in own)
    others = trained_on if head else None
    note = _note(path, fits, new, saved, own, len(classes), ignored, others)
    return Finetuned(tuple(fits), tuple(new), ignored, note)


def head_names(state, num_classes):
    """The names of the last tensors of ``state`` (a state_dict, in order) that hold one row per
    class: the classifier head's weight and bias, which state_dict lists last."""
    names = []
    for name in reversed(list(state)):
        if state[name].ndim == 0 or state[name].shape[0] != num_classes:
            break
        names.append(name)
    return names[::-1]


def freeze_loaded(model, finetuned, path):
    """--freeze-backbone: only the new parameters train. One line when there is none."""
    trained = [name for name, param in model.named_parameters() if name in finetuned.new]
    if not trained:
        raise UserError(f"--freeze-backbone: every parameter of the model was loaded from --finetune {path}, none is "
                        "new, so nothing would train; drop --freeze-backbone")
    for name, param in model.named_parameters():
        param.requires_grad_(name in finetuned.new)
    return trained


def _note(path, fits, new, saved, own, num_classes, ignored, other_classes=None):
    head = ""
    for name in new:
        if other_classes is not None:  # the file records its classes, not these: its head is not theirs
            shown = ", ".join(map(str, other_classes[:4])) + (", ..." if len(other_classes) > 4 else "")
            head = (f" (the file's {num_classes} classes are others: {shown})" if len(other_classes) == num_classes
                    else f" ({len(other_classes)} -> {num_classes} classes; the file's were {shown})")
            break
        if name in saved and saved[name].ndim and own[name].shape[0] == num_classes:
            head = f" ({saved[name].shape[0]} -> {num_classes} classes)"
            break
    shown = ", ".join(new[:4]) + (f" and {len(new) - 4} more" if len(new) > 4 else "")
    return (f"fine-tuning from {path}: {len(fits)} of {len(own)} tensors loaded"
            + (f"; new: {shown}{head}" if new else "; none new")
            + (f"; {len(ignored)} of the file's tensors unused" if ignored else ""))


def _shape(tensor):
    return "missing" if tensor is None else f"({', '.join(map(str, tensor.shape))})"
