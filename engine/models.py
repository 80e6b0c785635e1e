"""The network of --model: built for the data's classes, channels and image size, probed with
two images so that a model that does not fit is one line at start, and given --weights.

NAME is a class or function. It is called with num_classes= and in_channels= (and
image_size=(H, W) when its signature takes it) and returns an nn.Module that maps images
(B, C, H, W) to logits (B, classes). A NAME without an in_channels parameter (torchvision's
models) is an RGB network: it gets none, and gray data is refused in one line.
"""

import inspect
import re
import warnings

import torch
import torch.nn as nn

from engine.errors import UserError, first_line, type_named
from engine.memory import is_out_of_memory, no_trace
from engine.plugins import call_user_code, load_plugin, own_file, raised_at

DEFAULT_MODEL = "model:WideResNet"  # the guide's network, in model.py beside the scripts
# An error of the first forward pass that is about the images' size: torchvision's ViT ("Wrong
# image height! Expected 224"), timm's ("Input height (64) doesn't match model (224)"), a Linear
# sized for other images ("mat1 and mat2 shapes cannot be multiplied"), a pool or kernel larger
# than the feature map ("Kernel size can't be greater than actual input size"). Not a device or
# dtype mismatch, nor channels ("weight of size [16, 3, 3, 3], expected input[2, 1, 64, 64] to have 3
# channels"), nor a bug in the model: those keep the line that names where they were raised.
SIZE_ERROR = re.compile(r"^(?!.*channel).*?(size|shape|height|width|resolution|dimension|expected:?\s*\(?\d)",
                        re.IGNORECASE)
# The size the model wants, where the message says it: "Expected 224", "expected (224, 224)",
# "Expected 224x224"; not "Expected 4D input" nor "expected 3 channels".
EXPECTED_SIZE = re.compile(r"expected:?\s*\(?(\d+)(?:\s*[x,]\s*(\d+))?\b(?!\)?\s*channel)", re.IGNORECASE)
# A linear layer whose input features are not what the layers before it give at this size:
# "mat1 and mat2 shapes cannot be multiplied (2x12288 and 6912x10)" (batch x given, wanted x out).
LINEAR_FEATURES = re.compile(r"mat1 and mat2 shapes cannot be multiplied \(\d+x(\d+) and (\d+)x\d+\)")


def build_model(ref, data, seed, device, layout, weights=None, evaluating=False):
    """(model, name): --model ``ref`` for the data's classes, channels and size (``data``: a
    task.DataInfo), on ``device`` in memory ``layout``, the same initial weights on every rank
    (seeded), with the --weights file ``weights`` loaded if given (``evaluating``: for
    --eval-only, which needs no gradients and whose refusals do not suggest --finetune)."""
    factory = load_plugin(ref, "--model")
    height, width, channels = data.prep.image_shape
    torch.manual_seed(seed)  # each epoch then reseeds per rank (seeds.epoch_seed)
    # The model's own warnings (torchvision's googlenet warns of its initialization) are shown once it
    # and its --weights are accepted: above the one line that refuses either they would only hide it.
    with warnings.catch_warnings(record=True) as said:
        model, name = make_model(factory, ref, num_classes=len(data.classes), in_channels=channels,
                                 image_size=(height, width))
        shape = (channels, height, width)
        # Probed on its device (a model may use operations only the GPU has), first in NCHW, which
        # gives lazy modules their shapes, then in the layout training feeds it (x.view fails on
        # channels_last).
        model = model.to(device)
        # --image-size sets the size of an image folder's images only (the only data with a data_dir).
        check_output(model, ref, shape, len(data.classes), device, resizable=data.data_dir is not None,
                     trains=not evaluating)
        model = model.to(memory_format=layout)
        if layout != torch.contiguous_format:
            check_output(model, ref, shape, len(data.classes), device, layout, trains=not evaluating)
        if weights:
            from engine.weights import load_weights  # --weights only
            load_weights(model, weights, name, expected=data.weights_metadata(), evaluating=evaluating)
    for warning in said:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return model, name


def make_model(factory, ref, num_classes, in_channels, image_size):
    """Call ``factory`` with the keyword arguments its signature takes; (model, name)."""
    label = ref.rpartition(":")[2]
    if not callable(factory):
        raise UserError(f"--model {ref}: {label} is not a class or function but a value of type "
                        f"{type(factory).__name__}")
    kwargs = {"num_classes": num_classes, "in_channels": in_channels}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some built-ins have no signature: just call it
        params = None
    if params is not None:
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [k for k in kwargs if not takes_any
                   and (k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY)]
        if missing == ["in_channels"] or (takes_any and "in_channels" not in params and ref.startswith("torchvision.")):
            # An RGB network: torchvision's models (resnet18(**kwargs)) and yours without in_channels.
            if in_channels != 3:
                raise UserError(f"--model {ref}: {label} takes no in_channels, so it expects RGB images, but the "
                                f"data has {in_channels} channel(s) (gray images); use a model with an in_channels "
                                "parameter, or RGB images")
            del kwargs["in_channels"]
            missing = []
        if "image_size" in params:
            kwargs["image_size"] = image_size
        required = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if missing or required:
            problem = (f"does not take {' and '.join(missing)}" if missing
                       else f"also requires {', '.join(required)} (give {'them' if len(required) > 1 else 'it'} a "
                            "default)")
            raise UserError(f"--model {ref}: {label}{inspect.signature(factory)} {problem}; it is called as "
                            f"{label}(num_classes=N, in_channels=C[, image_size=(H, W)])")
    model = call_user_code(lambda: factory(**kwargs), f"--model {ref}", ref)
    if not isinstance(model, nn.Module):
        raise UserError(f"--model {ref}: {label}(...) returned {type_named(model)}, not an nn.Module")
    shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return model, f"{label}({shown})" + ("" if ref == DEFAULT_MODEL else f" from {ref.rpartition(':')[0]}")


def check_output(model, ref, image_shape, num_classes, device="cpu", layout=torch.contiguous_format,
                 resizable=None, trains=True):
    """A forward pass of two zero images in eval mode (no statistics updated, nothing
    random): the output must be logits (2, num_classes), and, for a model that ``trains``,
    depend on its trainable parameters (else the first backward fails in a traceback), and be
    logits in training mode too (a model with auxiliary outputs returns more there: tried
    without a trace, memory.no_trace). Lazy modules get their shapes.

    ``resizable``: None where the size is not the user's choice (predict.py: the size the
    weights were trained at); else whether --image-size sets it, and then an error about the
    images' size is one line saying which size to give (wrong_size)."""
    images = torch.zeros(2, *image_shape, device=device).contiguous(memory_format=layout)

    def on(batch):  # the forward pass's words in a line about it
        return f"--model {ref} on images ({batch}, {', '.join(map(str, image_shape))})" + (
            "" if layout == torch.contiguous_format else " in channels_last layout (--no-channels-last avoids it)")
    what = on(2)
    model.eval()
    with torch.set_grad_enabled(trains):
        out = call_user_code(lambda: first_forward(model, images, ref, resizable), what, ref)
    check_logits(out, ref, image_shape, num_classes)
    with torch.no_grad():  # the last batch of an evaluation, or predict.py's, may hold one image
        one = call_user_code(lambda: model(images[:1]), on(1), ref)
    model.train()
    check_logits(one, ref, image_shape, num_classes, batch=1)
    if trains and not out.requires_grad and any(p.requires_grad for p in model.parameters()):
        raise UserError(f"--model {ref}'s output does not depend on its trainable parameters (torch.no_grad(), "
                        ".detach() or .item() in its forward?): nothing would train")
    if trains:
        with no_trace(model, images.device), torch.no_grad():
            out = call_user_code(lambda: model(images), f"{what} in training mode", ref)
        check_logits(out, ref, image_shape, num_classes, " in training mode")


def check_logits(out, ref, image_shape, num_classes, mode="", batch=2):
    """One line unless ``out``, the output for images (batch, *image_shape), is logits
    (batch, num_classes)."""
    shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
    if shape == (batch, num_classes):
        return
    auxiliary = (": a model with auxiliary outputs in training (torchvision's googlenet and inception_v3 take "
                 "aux_logits=False); return the logits alone" if mode and not torch.is_tensor(out) else "")
    if batch == 1:  # a batch of two passed: a squeeze() that takes the batch's dimension when it is 1
        auxiliary = (": a batch of one image (an evaluation's last, predict.py's) must keep its batch dimension "
                     "(.squeeze() in the forward? .flatten(1) or .squeeze(-1) keeps it)")
    raise UserError(f"--model {ref} maps images ({batch}, {', '.join(map(str, image_shape))}){mode} to {shape}, not "
                    f"to logits ({batch}, {num_classes}) for the data's {num_classes} classes{auxiliary}")


def first_forward(model, images, ref, resizable=None):
    """``model(images)``; with ``resizable`` given (check_output), an error about the images'
    size raised as wrong_size's line. Any other error, out of memory among them, is raised as
    it came (call_user_code then names where); KeyboardInterrupt is not an Exception."""
    try:
        return model(images)
    except Exception as err:
        if resizable is None or is_out_of_memory(err) or not SIZE_ERROR.search(first_line(err)):
            raise
        if not resizable and not EXPECTED_SIZE.search(first_line(err)):
            raise  # a bug in the model as likely as other images: the line that names where, not a guess
        raise UserError(wrong_size(ref, tuple(images.shape[1:]), err, resizable)) from None


def wrong_size(ref, image_shape, err, resizable):
    """'--model REF does not take images of 3 x 64 x 64 pixels (AssertionError: ...): give
    --image-size 224', for an image folder (``resizable``); for other data, use a model that
    takes its images."""
    message = " ".join(first_line(err).split())
    found = EXPECTED_SIZE.search(message)
    sides = [n for n in found.groups() if n] if found else []
    if resizable:
        fix = f"give --image-size {'x'.join(sides)}" if sides else "give the --image-size it was designed for"
        linear = LINEAR_FEATURES.search(message)
        if linear and not sides:  # a model made for another size, or a layer sized wrong: either fix works
            fix += (f", or make the layer take the {linear[1]} features these images give (not {linear[2]}; "
                    "nn.LazyLinear takes what comes)")
    else:  # a square size said once ("Expected 224") is both sides
        fix = (f"it takes {' x '.join(sides * (3 - len(sides)))} pixels; " if sides else "") + \
              "use a model that takes these images (--image-size resizes the images of --dataset folder only)"
    where = raised_at(err, own_file(ref), any_file=False) if own_file(ref) else ""  # your file's line, no library's
    return (f"--model {ref} does not take images of {' x '.join(map(str, image_shape))} pixels "
            f"({type(err).__name__}: {message}): {fix}{where}")
