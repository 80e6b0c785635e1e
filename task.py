"""The task: which model learns from which data. This is where the engine (train_utils,
checkpoint_utils, log_utils, device_utils) meets the model and the data, as pytorch/examples'
``load_train_objs`` and torchtitan's TrainSpec do: ``build_task`` turns --model and
--dataset into a ``Task``, and the engine uses nothing else of them.

    --model model:WideResNet        the guide's network (model.py), the default
    --model my_net.py:Net           NAME in a file (a path, relative to the current directory)
    --model mypackage.nets:resnet   NAME in an importable module

NAME is a class or function. It is called with num_classes= and in_channels= (and
image_size=(H, W) when its signature takes it) and returns an nn.Module that maps images
(B, C, H, W) to logits (B, classes); a probe batch of two images checks that at start.

    --dataset cifar100|cifar10|fashion-mnist|mnist   torchvision's files (data_formats.py)
    --dataset folder --data-dir DIR                   DIR/train/CLASS/IMAGE, DIR/test/CLASS/IMAGE
    --dataset my_data.py:make                         make(data_dir) returns (train, test)

A FILE.py:NAME data set is two map-style data sets of (image, int label) items: the image a
tensor (C, H, W), uint8 or float, or a PIL image; a ``classes`` attribute names the labels
(torchvision's data sets have one). Global rank 0 calls NAME first, then the other ranks;
each reads it whole once into memory and serves it like the others: on the device when it
fits, else through the DataLoader.

A mistake in the user's file is the user's to see: a missing file or name, a signature that
does not fit, a wrong output shape, and an exception raised inside it are each one line,
the last naming the line of their file it came from.
"""

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

from checkpoint_utils import load_weights
from data_formats import DATASETS, default_data_dir
from dataset_utils import (InMemoryImages, build_datasets, build_loaders, eval_transform, per_process_batch,
                           preprocessing, train_transform)
from device_utils import UserError, available_cores, from_rank0, memory_format
from flags import DEFAULT_MODEL, FOLDER, MAX_AUTO_WORKERS
from image_folder import channel_stats, default_cache_dir, prepare_folder, read_folder_cache

DEVICE_DATA_FRACTION = 0.25  # --loader auto: the data set goes on the device when it fits this share of its memory


@dataclass(frozen=True)
class DataInfo:
    """What the engine knows of the data: names and numbers for the log, checkpoints and
    saved weights."""
    key: str               # the --dataset it was built from, as recorded in checkpoints
    title: str             # for people: CIFAR-100, image folder DIR, my_data.py:make
    source: str            # where the images come from, for the start-up block
    classes: tuple         # label i is classes[i]
    prep: object           # dataset_utils.Preprocessing: image shape, normalization, augmentation
    fingerprint: dict      # identifies images and labels: a resume on other data is refused
    expected_sizes: dict = None  # official images per split, for a warning when a copy differs
    notes: tuple = ()      # how the data was prepared, for the start-up block

    def weights_metadata(self):
        """What saved weights carry beside the tensors, so an evaluation maps labels the same way."""
        height, width, channels = self.prep.image_shape
        return {"dataset": self.key, "classes": list(self.classes), "image_size": [height, width],
                "in_channels": channels, "mean": list(self.prep.mean), "std": list(self.prep.std)}


@dataclass(frozen=True)
class Task:
    """What train_utils.fit trains. train_ddp.py replaces ``model`` by its DDP wrapper."""
    model: nn.Module       # on this rank's device, the same initial weights on every rank
    model_name: str        # as built, for people: WideResNet(num_classes=100, in_channels=3)
    model_key: str         # --model as recorded in checkpoints: a resume with another is refused
    train_loader: object   # this rank's batches of (float32 images (B, C, H, W), int64 labels (B,))
    test_loader: object
    data: DataInfo
    loader: str            # device or torchvision, as chosen
    loader_reason: str     # why, for the start-up block


def build_task(args, ctx):
    """The Task of the flags on this rank: its shard of the data, the model on its device."""
    train_set, test_set, data = build_data(args, ctx)
    loader, reason = choose_loader(args.loader, train_set.images.nbytes + test_set.images.nbytes,
                                   device_memory(ctx.device))
    workers = 0
    if loader == "torchvision":
        workers = args.num_workers if args.num_workers is not None else default_num_workers(ctx.local_world_size)
    train_loader, test_loader = build_loaders(
        train_set, test_set, per_process_batch(args.batch_size, ctx.world_size), loader=loader, num_workers=workers,
        device=ctx.device, rank=ctx.rank, world_size=ctx.world_size, seed=args.seed,
        pin_memory=ctx.device.type == "cuda")
    model, name = build_model(args, ctx, data)
    return Task(model, name, plugin_key(args.model), train_loader, test_loader, data, loader, reason)


# ---------------------------------------------------------------------------------------------
# The model.

def build_model(args, ctx, data):
    """(model, name): --model for the data's classes, channels and size, on this rank's
    device in its memory layout, the same initial weights on every rank (seeded), with
    --weights loaded if given."""
    factory = load_plugin(args.model, "--model")
    height, width, channels = data.prep.image_shape
    torch.manual_seed(args.seed)  # each epoch then reseeds per rank (checkpoint_utils.epoch_seed)
    model, name = make_model(factory, args.model, num_classes=len(data.classes), in_channels=channels,
                             image_size=(height, width))
    layout = memory_format(args.channels_last, ctx.device)
    shape = (channels, height, width)
    # Probed on its device (a model may use operations only the GPU has), first in NCHW, which
    # gives lazy modules their shapes, then in the layout training feeds it (x.view fails on
    # channels_last).
    model = model.to(ctx.device)
    check_output(model, args.model, shape, len(data.classes), ctx.device)
    model = model.to(memory_format=layout)
    if layout != torch.contiguous_format:
        check_output(model, args.model, shape, len(data.classes), ctx.device, layout)
    if args.weights:
        load_weights(model, args.weights, name, expected=data.weights_metadata())
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
        raise UserError(f"--model {ref}: {label}(...) returned a {type(model).__name__}, not an nn.Module")
    shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return model, f"{label}({shown})" + ("" if ref == DEFAULT_MODEL else f" from {ref.rpartition(':')[0]}")


def check_output(model, ref, image_shape, num_classes, device="cpu", layout=torch.contiguous_format):
    """A forward pass of two zero images in eval mode (no statistics updated, nothing
    random): the output must be logits (2, num_classes). Lazy modules get their shapes."""
    images = torch.zeros(2, *image_shape, device=device).contiguous(memory_format=layout)
    what = f"--model {ref} on images (2, {', '.join(map(str, image_shape))})" + (
        "" if layout == torch.contiguous_format else " in channels_last layout (--no-channels-last avoids it)")
    model.eval()
    with torch.no_grad():
        out = call_user_code(lambda: model(images), what, ref)
    model.train()
    shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
    if shape != (2, num_classes):
        raise UserError(f"--model {ref} maps images (2, {', '.join(map(str, image_shape))}) to {shape}, not to logits "
                        f"(2, {num_classes}) for the data's {num_classes} classes")


# ---------------------------------------------------------------------------------------------
# The data.

def build_data(args, ctx):
    """(train_set, test_set, DataInfo) of --dataset: InMemoryImages both."""
    if args.dataset in DATASETS:
        return builtin_data(args, ctx)
    if args.dataset == FOLDER:
        return folder_data(args, ctx)
    # Global rank 0 first, so that a NAME that downloads or unpacks does it once; then the others.
    loaded = {}
    from_rank0(lambda: loaded.update(data=plugin_data(args)), ctx.control_group, patient=True)
    return loaded["data"] if ctx.is_main else plugin_data(args)


def builtin_data(args, ctx):
    spec = DATASETS[args.dataset]
    train, test = build_datasets(args.data_dir, args.download, args.synthetic, args.seed, ctx.rank, spec,
                                 args.augment, ctx.control_group)
    source = ("SYNTHETIC random images and labels: accuracy is meaningless" if args.synthetic
              else f"{spec.title} from {args.data_dir or 'datasets/ beside the scripts'}")
    classes = tuple(str(label) for label in range(spec.num_classes))
    return train, test, DataInfo(spec.name, spec.title, source, classes, train.prep,
                                 data_fingerprint(spec.name, args.synthetic, train.labels, len(test)),
                                 spec.split_sizes)


def folder_data(args, ctx):
    """The image folder, decoded into its cache by global rank 0 (the others wait), then
    memory-mapped by every rank."""
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    target = from_rank0(lambda: str(prepare_folder(args.data_dir, cache_dir, args.image_size)), ctx.control_group,
                        patient=True)
    folder = read_folder_cache(Path(target))
    prep = preprocessing(folder.train[0].shape[1:], folder.mean, folder.std, args.augment)
    train = InMemoryImages(*folder.train, train_transform(prep), prep)
    test = InMemoryImages(*folder.test, eval_transform(prep), prep)
    shown = ", ".join(folder.classes[:8]) + (", ..." if len(folder.classes) > 8 else "")
    source = f"the image folder {args.data_dir} ({len(folder.classes)} classes: {shown})"
    return train, test, DataInfo(FOLDER, f"image folder {args.data_dir}", source, folder.classes, prep,
                                 data_fingerprint(FOLDER, False, train.labels, len(test), folder.classes,
                                                  prep.image_shape),
                                 notes=(*folder.notes,
                                        f"Normalization: from the training images, mean {prep.mean}, std {prep.std}"))


def plugin_data(args):
    """NAME(data_dir) of --dataset FILE.py:NAME, read whole into memory."""
    ref = args.dataset
    factory = load_plugin(ref, "--dataset")
    data_dir = args.data_dir or str(default_data_dir())
    result = call_user_code(lambda: factory(data_dir), f"--dataset {ref}", ref)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise UserError(f"--dataset {ref}: {ref.rpartition(':')[2]}(data_dir) returned a {type(result).__name__}, "
                        "not (train, test)")
    (train_images, train_labels), (test_images, test_labels) = (
        materialize(part, split, ref) for part, split in zip(result, ("training", "test")))
    if train_images.shape[1:] != test_images.shape[1:] or train_images.dtype != test_images.dtype:
        raise UserError(f"--dataset {ref}: training images are {train_images.dtype} {train_images.shape[1:]} (H, W, "
                        f"C), test images {test_images.dtype} {test_images.shape[1:]}: make them alike")
    classes = getattr(result[0], "classes", None)
    classes = tuple(map(str, classes)) if classes is not None else tuple(
        str(label) for label in range(int(max(train_labels.max(), test_labels.max())) + 1))
    for labels, split in ((train_labels, "training"), (test_labels, "test")):
        if labels.min() < 0 or labels.max() >= len(classes):
            raise UserError(f"--dataset {ref}: {split} labels run from {labels.min()} to {labels.max()}, outside "
                            f"0..{len(classes) - 1} of its {len(classes)} classes")
    mean, std = channel_stats(train_images, 255 if train_images.dtype == np.uint8 else 1)
    prep = preprocessing(train_images.shape[1:], mean, std, args.augment)
    train = InMemoryImages(train_images, train_labels, train_transform(prep), prep)
    test = InMemoryImages(test_images, test_labels, eval_transform(prep), prep)
    return train, test, DataInfo(plugin_key(ref), ref, f"{ref}({data_dir}), {len(classes)} classes", classes, prep,
                                 data_fingerprint(plugin_key(ref), False, train_labels, len(test), classes,
                                                  prep.image_shape),
                                 notes=(f"Normalization: from the training images, mean {prep.mean}, std {prep.std}",))


def materialize(dataset, split, ref):
    """(images (N, H, W, C) uint8 or float32, labels int64 (N,)) of a map-style data set."""
    what = f"--dataset {ref}: the {split} set"
    try:
        count = len(dataset)
    except TypeError:
        raise UserError(f"{what} is a {type(dataset).__name__}, not a map-style data set (with len and [i])") from None
    if count == 0:
        raise UserError(f"{what} is empty")
    images, labels = None, np.empty(count, dtype=np.int64)
    for i in range(count):
        item = call_user_code(lambda: dataset[i], f"{what}[{i}]", ref)
        if not (isinstance(item, (tuple, list)) and len(item) >= 2):
            raise UserError(f"{what}[{i}] is a {type(item).__name__}, not (image, label)")
        image = as_hwc(item[0], f"{what}[{i}]")
        if images is None:
            images = np.empty((count, *image.shape), dtype=image.dtype)
        elif image.shape != images.shape[1:] or image.dtype != images.dtype:
            raise UserError(f"{what}[{i}] is {image.dtype} {image.shape} (H, W, C), item 0 {images.dtype} "
                            f"{images.shape[1:]}: every image must have one size and type (resize them in "
                            f"{ref.rpartition(':')[2]})")
        images[i] = image
        try:
            labels[i] = int(item[1])
        except (TypeError, ValueError):
            raise UserError(f"{what}[{i}] has the label {item[1]!r}, not a class index") from None
    return images, labels


def as_hwc(image, what):
    """A tensor (C, H, W) or (H, W), or a PIL image, as a numpy (H, W, C) uint8 or float32."""
    if isinstance(image, Image.Image):
        array = np.array(image if image.mode in ("L", "RGB") else image.convert("RGB"), dtype=np.uint8)
        return array[:, :, None] if array.ndim == 2 else array
    if not torch.is_tensor(image) or image.ndim not in (2, 3):
        shape = f" of shape {tuple(image.shape)}" if hasattr(image, "shape") else ""
        raise UserError(f"{what}: the image is a {type(image).__name__}{shape}, not a tensor (C, H, W) or a PIL "
                        "image (for a numpy (H, W, C) array: torch.from_numpy(a).permute(2, 0, 1))")
    image = image.detach().cpu()
    image = image[None] if image.ndim == 2 else image
    if image.dtype == torch.uint8:
        return image.permute(1, 2, 0).numpy()
    if image.is_floating_point():
        return image.permute(1, 2, 0).float().numpy()
    raise UserError(f"{what}: the image is {image.dtype}; give uint8 (0..255) or floating point")


def data_fingerprint(key, synthetic, train_labels, test_size, classes=None, image_shape=None):
    """Identifies the data in a checkpoint, so that a resume on other data is refused."""
    labels = np.asarray(train_labels, dtype=np.int64)
    fingerprint = {"dataset": key, "synthetic": synthetic, "train_images": len(labels), "test_images": test_size,
                   "train_labels_sha256": hashlib.sha256(labels.tobytes()).hexdigest()}
    if classes is not None:
        fingerprint.update(classes=list(classes), image_shape=list(image_shape))
    return fingerprint


def choose_loader(requested, data_bytes, memory_bytes):
    """(loader, why) for --loader: auto puts the data set on the device when it fits
    DEVICE_DATA_FRACTION of the device's memory, else streams it through the DataLoader."""
    if requested != "auto":
        return requested, f"--loader {requested}"
    budget = DEVICE_DATA_FRACTION * memory_bytes
    fits = data_bytes <= budget
    return ("device" if fits else "torchvision",
            f"auto: the data set ({size_text(data_bytes)}) {'fits' if fits else 'does not fit'} in "
            f"{DEVICE_DATA_FRACTION:.0%} of the device's {size_text(memory_bytes)}")


def size_text(nbytes):
    """Bytes for people: 620.3 MB, 2.41 GB, 80 GB."""
    if nbytes < 1e9:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e9:.{2 if nbytes < 1e10 else 0}f} GB"


def device_memory(device):
    """Bytes of memory of ``device``: the GPU's, or the node's for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_num_workers(local_world_size):
    """One loader worker per spare CPU core of this process's share, capped."""
    return max(0, min(MAX_AUTO_WORKERS, available_cores() // local_world_size - 1))


# ---------------------------------------------------------------------------------------------
# The user's code: FILE.py:NAME or module:NAME.

def is_file(source):
    """Whether the part before NAME is a file (my_net.py, nets/my_net.py) or a module (my_net)."""
    return source.endswith(".py") or "/" in source or os.sep in source


def plugin_key(ref):
    """What identifies --model or --dataset across runs: my_net.py:Net, ./my_net.py:Net and
    my_net:Net are one (a checkpoint may move between folders and machines)."""
    source, _, name = ref.rpartition(":")
    return f"{Path(source).stem if is_file(source) else source}:{name}"


def load_plugin(ref, flag):
    """The object NAME of FILE.py:NAME (a path) or module:NAME (importable)."""
    source, _, name = ref.rpartition(":")
    if is_file(source):
        module = import_file(Path(source).expanduser(), flag, ref)
    else:
        try:
            module = importlib.import_module(source)
        except ModuleNotFoundError as err:
            if err.name != source.split(".")[0] and err.name != source:
                raise user_error(err, f"{flag} {ref}: importing {source}", None) from None
            raise UserError(f"{flag} {ref}: no module named {source} (for a file give its path: "
                            f"{source}.py:{name})") from None
        except Exception as err:
            raise user_error(err, f"{flag} {ref}: importing {source}", None) from None
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        shown = ", ".join(public[:12]) + (", ..." if len(public) > 12 else "")
        raise UserError(f"{flag} {ref}: {getattr(module, '__file__', source)} has no {name} "
                        f"(it defines: {shown or 'nothing'})") from None


def import_file(path, flag, ref):
    """Import a Python file as the module of its stem (so that DataLoader workers and
    torch.compile find its classes again); its folder joins sys.path for its own imports."""
    if not path.is_file():
        raise UserError(f"{flag} {ref}: no such file {path.absolute()}")
    path = path.resolve()
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
        return loaded
    if loaded is not None:  # another module of that name is imported already: keep both
        name = f"{name}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise user_error(err, f"{flag} {ref}: importing {path.name}", path) from None
    return module


def call_user_code(call, what, ref):
    """``call()``, with an exception from the user's code turned into one line that names
    where in their file it was raised."""
    try:
        return call()
    except UserError:
        raise
    except Exception as err:
        raise user_error(err, what, plugin_file(ref)) from None


def plugin_file(ref):
    """The file FILE.py:NAME or module:NAME lives in, or None."""
    source = ref.rpartition(":")[0]
    if is_file(source):
        return Path(source).expanduser().resolve()
    module = sys.modules.get(source)
    return Path(module.__file__).resolve() if getattr(module, "__file__", None) else None


def user_error(err, what, path):
    """One line: what failed, the exception, and the innermost line of the user's file (or
    of any file, when the user's is unknown) in its traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    if isinstance(err, SyntaxError) and err.filename:
        frames.append(traceback.FrameSummary(err.filename, err.lineno or 0, "<module>", line=err.text or ""))
    mine = [f for f in frames if path is None or Path(f.filename).resolve() == path] or frames[-1:]
    message = " ".join(str(err).split())
    where = ""
    if mine:
        frame = mine[-1]
        code = f": {frame.line.strip()}" if frame.line and frame.line.strip() else ""
        where = f" (at {frame.filename}, line {frame.lineno}, in {frame.name}{code})"
    return UserError(f"{what} raised {type(err).__name__}{f': {message}' if message else ''}{where}")
