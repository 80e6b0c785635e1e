"""Weights files (--weights, --save-weights): the plain state_dict, the guide's layout, with
what it was trained on (classes, image size, normalization) in its metadata, so that an
evaluation or a prediction maps outputs to the same labels.
"""

import pickle

import torch

from engine.errors import UserError
from engine.files import atomic_save

WEIGHTS_METADATA = "task"  # the key of a weights file's metadata (state_dict._metadata[""])


def save_weights(model, path, metadata=None):
    """The model's state_dict, written atomically, with ``metadata`` (the data's classes,
    image size, normalization) in its ``_metadata``: torch.load returns it with the tensors,
    and load_state_dict ignores it, so the file loads strictly into the model as the guide's did."""
    state = model.state_dict()
    if metadata is not None:
        state._metadata[""] = {**state._metadata.get("", {}), WEIGHTS_METADATA: metadata}
    atomic_save(state, path)


def load_weights(model, path, model_name=None, expected=None):
    """Load a state_dict file (or the model of a checkpoint) into ``model``. One line when it
    is not one, does not fit ``model``, or was trained on other classes than ``expected``'s."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--weights {path}: no such file", same_on_every_rank=False) from None
    except Exception as err:  # not a torch file, truncated, or pickled objects we refuse to run
        if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in str(err):  # weights_only refused a class
            raise UserError(f"--weights {path} holds pickled Python objects (a whole model saved with "
                            "torch.save(model)?), not a state_dict; save one with torch.save(model.state_dict(), PATH)",
                            same_on_every_rank=False) from None
        raise UserError(f"--weights {path} is not a readable state_dict ({type(err).__name__})",
                        same_on_every_rank=False) from None
    saved = {}
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # a checkpoint
        saved, state = state.get("data") or {}, state["model"]
    if not isinstance(state, dict):
        raise UserError(f"--weights {path} holds a {type(state).__name__}, not a state_dict")
    saved = getattr(state, "_metadata", {}).get("", {}).get(WEIGHTS_METADATA, saved)
    state = _strip_prefixes(state)
    check_state_fits(model, state, f"--weights {path}", model_name)
    classes, wanted = saved.get("classes"), (expected or {}).get("classes")
    if classes is not None and wanted is not None and list(classes) != list(wanted):
        if len(classes) == len(wanted):
            label = next(i for i, (a, b) in enumerate(zip(classes, wanted)) if a != b)
            detail = f"label {label} is {classes[label]!r} there and {wanted[label]!r} here"
        else:
            detail = f"{len(classes)} classes there, {len(wanted)} here"
        raise UserError(f"--weights {path} were trained on other classes ({detail}): their outputs would be "
                        "read as the wrong labels; use the data set they were trained on")
    model.load_state_dict(state)


def _strip_prefixes(state):
    """Accept state_dicts saved from a DDP-wrapped or torch.compile'd model too."""
    def clean(key):
        for prefix in ("module.", "_orig_mod."):
            key = key.removeprefix(prefix)
        return key
    return {clean(key): value for key, value in state.items()}


def check_state_fits(model, state, source, model_name=None):
    """One clear line instead of load_state_dict's multi-line error for another model shape."""
    own = model.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    reshaped = [k for k in own.keys() & state.keys() if tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or reshaped:
        example = sorted(missing or unexpected or reshaped)[0]
        raise UserError(f"{source} does not fit {model_name or type(model).__name__}: "
                        f"{len(missing)} missing, {len(unexpected)} unexpected and {len(reshaped)} "
                        f"differently shaped tensors (e.g. {example}): weights of another --model or --dataset?")


