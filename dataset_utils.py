"""The data sets as batches of (images, labels): what each --dataset is, the samplers and the
loaders, and how stored images become the model's input (``Preprocessing``, the normalization,
the same for predict.py). How the files of the built-in data sets are fetched and read is in
engine/data_formats.py, the image folder's cache in engine/image_cache.py, the training
augmentations in recipe.py.

Compute nodes often have no internet, so fetch the data ahead of time on a login node, and
decode a large image folder there too (with train.py's data flags: the cache it then reuses):

    python dataset_utils.py --dataset cifar100 --data-dir ./datasets    # or cifar10, fashion-mnist, mnist
    python dataset_utils.py --dataset folder --data-dir my_photos --val-fraction 0.2 --image-size 224
    python dataset_utils.py --dataset folder --data-dir my_photos --val-fraction 0.2 --loader dali  # checked, listed

The training scripts download only when the data is missing, and then only global rank 0
downloads while the other ranks wait.

Three loaders serve batches of (float32 images (B, C, H, W), int64 labels (B,)):

- ``device`` (the training scripts' default): the whole data set is copied to the device
  once as uint8 (150 MB for CIFAR's training set, 47 MB for MNIST's); each batch is a gather
  plus the augmentation and normalization as batched tensor operations there
  (``DeviceLoader`` below). No worker processes, no host-to-device copies and no CPU time
  per image.
- ``torchvision``: the guide's DataLoader, for data that does not fit on the device or for
  comparison; with ``num_workers`` persistent worker processes, each applying torchvision's
  transforms (recipe.loader_transforms) to one image at a time.
- ``dali`` (--dataset folder): NVIDIA DALI reads and decodes the files every epoch, on the GPU,
  and crops them (recipe.dali_images; engine/dali_loader.py): no decoded copy, any folder size.

All shuffle exactly as ``DistributedSampler`` does (by seed and epoch, sharded by rank). The
first two augment image i of epoch e from (seed, epoch, i) alone: the same crops on every rank,
with any number of workers and after a resume; DALI seeds each epoch's pipeline by (seed, epoch,
rank). They draw the same distribution of crops, not the same crops.
"""

import math
import mmap
import multiprocessing
import os
import pickle
import sys
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from engine.cli import OneLineParser
from engine.errors import DatasetError, UserError, first_line, size_text, stop_request_held, type_named
from engine.flags import FOLDER, MAX_AUTO_WORKERS, add_data_arguments, check_data_arguments
from engine.log import count, flag_value, sizes_warning
from engine.memory import DEVICE_DATA_FRACTION, HEADROOM
from engine.plugins import plugin_key
from engine.processes import available_cores, from_rank0
from engine.seeds import derived_seed
from engine.stopping import ignore_ctrl_c
from engine.task import (DATASETS, DataInfo, check_labels, data_fingerprint, describe_split, held_out_record,
                         stratified_split)
import recipe  # noqa: I001 (the user's file, after the engine's)

CIFAR100 = DATASETS["cifar100"]  # the guide's, and the default of every function here
LOADERS = ("device", "torchvision", "dali")


# ---------------------------------------------------------------------------------------------
# How stored images become the model's input, the same for training, validation and predict.py:
# Preprocessing (the input's shape, normalization and training augmentation), normalization as one
# fused multiply-add per value, the centre crop of images stored larger than the input, and each
# training image's random draws as a function of (seed, epoch, index) alone.

# The augmentation's streams: (seed, epoch, STREAM), above any rank's (seed, epoch, rank) of dropout.
# The others: engine/dali_loader.DALI_STREAM (2**31 - 5), engine/task.SPLIT_STREAM.
AUGMENT_STREAM = 2**31 - 3  # the device loader's numbers for each image
IMAGE_STREAM = 2**31 - 4    # the DataLoader's seed for each image


@dataclass(frozen=True)
class Preprocessing:
    """How stored images become the model's input (``preprocessing`` below makes one from
    recipe.py's augmentations)."""
    image_shape: tuple  # (H, W, C) the model's input
    mean: tuple         # per channel: of the pixels scaled to 0..1 (uint8 images), or as stored (float)
    std: tuple
    augment: str = "none"  # the training augmentation's name in recipe.AUGMENTATIONS
    ops: tuple = ()        # its operations, in order: (images (B, H, W, C), rand, prep) -> images
    padding: int = 0       # zero padding (pixels) around a training image before a random crop
    stored_size: tuple = None  # (H, W) of the stored images when larger than the input (resized-crop), else None
    per_op: int = 4        # uniform numbers each operation gets per image (recipe.RANDOM_PER_OP)
    per_image: object = None  # recipe.image_transforms: a v2.Compose on each uint8 (C, H, W) image, or None

    @property
    def stored(self):
        """(H, W) of the stored images: test images are centre-cropped from it to image_shape."""
        return tuple(self.stored_size or self.image_shape[:2])

    def randoms(self, size, seed, epoch):
        """Each image's random numbers for the augmentation in ``epoch``: (size, ops, per_op)."""
        return augmentation_randoms(size, self.ops, seed, epoch, self.per_op)

    def describe(self):
        """What happens to a training image, in words (the start-up block)."""
        per_image = getattr(self.per_image, "transforms", [self.per_image] if self.per_image else [])  # a v2.Compose
        names = [op.__name__ + (f" with {self.padding}-pixel padding" if op.__name__.startswith("pad") else "")
                 for op in self.ops] + [f"per image {type(t).__name__}" for t in per_image]
        ops = ", ".join(names) or "nothing"
        height, width, _ = self.image_shape
        sizes = (f"; stored {'x'.join(map(str, self.stored))}, trained on {height}x{width} crops, tested on the "
                 "centre crop" if self.stored != (height, width) else "")
        return f"{self.augment} ({ops}{sizes}), normalized with mean {self.mean} and std {self.std}"


def augmentation_randoms(size, ops, seed, epoch, per_op):
    """float64 (size, len(ops), per_op): uniform numbers in [0, 1) for every image of a data set of
    ``size`` and every operation, from (seed, epoch) alone. Drawn on the CPU (a CUDA generator
    draws other numbers from the same seed): every device, rank and worker sees the same
    numbers for the same image, whatever ran before."""
    generator = torch.Generator().manual_seed(derived_seed(seed, epoch, AUGMENT_STREAM))
    return torch.rand((size, len(ops), per_op), generator=generator, dtype=torch.float64)


def augmentation_seeds(size, seed, epoch):
    """int64 (size,): a seed for every image of a data set of ``size`` for its per-image
    transforms in ``epoch``, from (seed, epoch) alone, as augmentation_randoms."""
    generator = torch.Generator().manual_seed(derived_seed(seed, epoch, IMAGE_STREAM))
    return torch.randint(0, 2**62, (size,), generator=generator)


def centre_crop(images, size):
    """The central ``size`` (h, w) of images (B, H, W, C), offsets rounded as torchvision's
    CenterCrop rounds them: the test view of images stored larger than the model's input."""
    height, width = size
    top, left = round((images.shape[1] - height) / 2), round((images.shape[2] - width) / 2)
    return images[:, top:top + height, left:left + width]


def normalization(mean, std, dtype, device="cpu"):
    """(scale, shift), float32 (C,) on ``device``, for stored images of ``dtype``: uint8 images
    become x * scale + shift = (x / 255 - mean) / std, ToTensor + Normalize's; a data set of
    floats (x + shift) * scale = (x - mean) / std, subtracting first, so that a mean far from 0
    (in units of std) loses no precision. Computed in float64, rounded once."""
    mean, std = torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)
    if dtype == torch.uint8:
        return (1 / (255 * std)).float().to(device), (-mean / std).float().to(device)
    return (1 / std).float().to(device), (-mean).float().to(device)


def normalize(images, scale, shift):
    """Stored images (B, H, W, C) -> float32 (B, C, H, W), with ``normalization``'s scale and
    shift on the images' device: uint8 read as it is, one fused multiply-add per value, within
    one float32 rounding (2.4e-7) of ToTensor + Normalize (the lookup table that matched them
    bit for bit cost 4.6x as much on a CPU and an int64 copy of the batch on a GPU); floats
    shifted, then scaled. The result is channels-last in memory (the permute is a view), the
    layout the model wants on the GPU."""
    if images.dtype == torch.uint8:
        return torch.addcmul(shift, images, scale).permute(0, 3, 1, 2)
    return ((images.float() + shift) * scale).permute(0, 3, 1, 2)


def spec_preprocessing(spec, augment="auto"):
    """A built-in data set's Preprocessing: its shape, normalization, augmentation and padding."""
    return preprocessing(spec.image_shape, spec.mean, spec.std, augment, spec.augment, spec.padding)


def preprocessing(image_shape, mean, std, augment="auto", own_augment="flip-crop", padding=None, stored_size=None):
    """The Preprocessing for --augment: ``own_augment`` and ``padding`` are the data set's own
    (auto); padding defaults to 1/8 of the shorter side (4 pixels for 32x32, as CIFAR's)."""
    if padding is None:
        padding = max(1, round(min(image_shape[:2]) / 8))
    augment = own_augment if augment == "auto" else augment
    return Preprocessing(tuple(image_shape), tuple(mean), tuple(std), augment, recipe.augmentation_ops(augment), padding,
                         stored_size and tuple(stored_size), recipe.RANDOM_PER_OP)


# ---------------------------------------------------------------------------------------------
# The data sets and their loaders from plain arguments (the guide's load_cifar100 among them).

def synthetic_split(split, seed=0, spec=CIFAR100):
    """Random images and labels of the data set's shape and size; the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 2 + (split == "test"))
    n = spec.split_sizes[split]
    # The pixels as random 64-bit words seen as bytes: 8 bytes a draw, a third of the time of
    # one uint8 draw a pixel (0.6 s for CIFAR-100's 150 MB on a CPU core, paid by every start).
    size = n * math.prod(spec.image_shape)
    words = torch.randint(-2**63, 2**63 - 1, (-(-size // 8),), dtype=torch.int64, generator=generator)
    images = words.view(torch.uint8)[:size].view(n, *spec.image_shape)
    labels = torch.randint(0, spec.num_classes, (n,), generator=generator)
    return images.numpy(), labels.numpy()


def to_pil(image):
    """uint8 (H, W, C) -> a PIL image: RGB, or grayscale ("L") for one channel."""
    return Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)


def build_datasets(data_dir=None, download=True, synthetic=False, seed=0, rank=0, spec=CIFAR100, augment="auto",
                   group=None):
    """(train_set, test_set) of data set ``spec``, each built once, augmented as --augment
    says. Global rank 0 fetches missing files while the other ranks wait (in ``group``: the
    gloo control group, so the wait is not an NCCL collective), so the download happens at
    most once and is never raced."""
    if synthetic:
        splits = {split: synthetic_split(split, seed, spec) for split in spec.split_sizes}
    else:
        from engine.data_formats import read_split  # the files' readers: not for random images
        root = builtin_root(data_dir, spec)
        # Global rank 0 fetches what is missing; the others wait, and get its error if any.
        from_rank0(lambda: fetch(root, spec, download) if rank == 0 else None, group, patient=True)
        splits = {split: read_split(root, split, spec) for split in spec.split_sizes}
    prep = spec_preprocessing(spec, augment)
    return InMemoryImages(*splits["train"], prep), InMemoryImages(*splits["test"], prep)


def fetch(root, spec, download=True):
    """The files of data set ``spec`` in ``root``, fetched when missing (engine/data_formats.py);
    but never into an image folder: that is --dataset folder forgotten."""
    from engine.data_formats import missing_files, prepare
    if len(missing_files(root, spec)) == len(spec.all_files()):
        from engine.image_folder import image_folder_layout  # only when the data set is not there
        layout = image_folder_layout(root)
        if layout:
            raise DatasetError(f"{root} is an image folder ({layout.replace('DIR', str(root))}), not "
                               f"{spec.title} (--dataset {spec.name}): for your own images add --dataset folder")
    prepare(root, spec, download)


def builtin_root(data_dir, spec):
    """Where the files of data set ``spec`` are under --data-dir ``data_dir`` (None: datasets/)."""
    from engine.data_formats import data_root, default_data_dir
    return data_root(Path(data_dir).expanduser() if data_dir else default_data_dir(), spec)


def load_data(batch_size, num_workers=0, sampler=None, data_dir=None, *, dataset="cifar100", loader="torchvision",
              device=None, rank=0, world_size=1, seed=0, download=True, synthetic=False, pin_memory=None):
    """(train_loader, test_loader) of ``dataset`` (a DATASETS name); ``batch_size`` is per process.

    ``loader``: "torchvision" (the guide's DataLoader, the default of this function) or
    "device" (data set and augmentation on ``device``, the training scripts' default).
    Training: shuffled by a DistributedSampler seeded by (seed, epoch) and sharded by rank
    (with one rank it is a seeded shuffle), incomplete last batches dropped so every rank
    runs the same number of steps. Call ``set_loader_epoch`` before each epoch.
    Evaluation: every test image exactly once across ranks, in order, no augmentation.
    """
    train_set, test_set = build_datasets(data_dir, download, synthetic, seed, rank, DATASETS[dataset])
    return build_loaders(train_set, test_set, batch_size, loader=loader, num_workers=num_workers,
                         sampler=sampler, device=device, rank=rank, world_size=world_size, seed=seed,
                         pin_memory=pin_memory)


def load_cifar100(batch_size, num_workers=0, sampler=None, data_dir=None, **options):
    """The guide's call: ``load_data`` of CIFAR-100."""
    return load_data(batch_size, num_workers, sampler, data_dir, dataset="cifar100", **options)


def build_loaders(train_set, test_set, batch_size, *, loader="torchvision", num_workers=0, sampler=None,
                  device=None, rank=0, world_size=1, seed=0, pin_memory=None):
    """(train_loader, test_loader) over data sets from ``build_datasets`` (FileImages for "dali",
    whose ``num_workers`` are DALI's threads); see load_data."""
    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, not {loader!r}")
    if loader == "dali":
        from engine.dali_loader import DaliLoader  # imported where DALI runs: the other loaders never need it
        common = dict(device=torch.device(device or "cpu"), rank=rank, world_size=world_size, seed=seed,
                      threads=max(1, num_workers))
        return (DaliLoader(train_set, batch_size, recipe.dali_images, augmented=True, **common),
                DaliLoader(test_set, batch_size, recipe.dali_images, augmented=False, **common))
    if sampler is None:
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=seed, drop_last=True)
    test_sampler = ShardSampler(len(test_set), rank, world_size)
    check_augmentation(train_set)
    if loader == "device":
        device = torch.device(device or "cpu")
        return (DeviceLoader(train_set, batch_size, sampler, device, augmented=True, drop_last=True, seed=seed),
                DeviceLoader(test_set, batch_size, test_sampler, device, augmented=False, drop_last=False))
    # Workers persist across epochs (no restart cost); AugmentSampler hands them each image's seed.
    common = dict(batch_size=batch_size, num_workers=num_workers, persistent_workers=num_workers > 0,
                  pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
                  worker_init_fn=ignore_ctrl_c if num_workers else None)
    transform = recipe.loader_transforms(train_set.prep)
    if train_set.prep.per_image is not None:
        check_image_transforms(train_set, transform)
    train_set = train_set.with_transform(transform)
    if num_workers:
        # The start method the DataLoader will use (the first listed is the default), without fixing it.
        start_method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        check_sendable(transform, num_workers, start_method)
    # A private generator for the loader's base seed, so the global RNG (dropout) is not consumed.
    return (WorkerLoader(train_set, sampler=AugmentSampler(sampler, len(train_set), seed), drop_last=True,
                         generator=torch.Generator().manual_seed(seed), **common),
            WorkerLoader(test_set, sampler=test_sampler, **common))


class WorkerLoader(DataLoader):
    """A DataLoader whose worker processes, started by its first iterator, do not take the
    stop request meant for the training process (engine.errors.stop_request_held)."""

    def __iter__(self):
        with stop_request_held():
            return super().__iter__()


def check_sendable(transform, num_workers, start_method):
    """The DataLoader's workers that are not forked (``start_method`` forkserver, Python 3.14's
    default, or spawn) receive the training set pickled, recipe.py's transforms with it: a lambda
    or a function defined inside another among them failed as the first epoch began, in a
    traceback."""
    if start_method == "fork":
        return
    try:
        pickle.dumps(transform)
    except Exception as err:
        raise UserError(f"the DataLoader's {num_workers} worker processes (--num-workers) receive recipe.py's "
                        f"per-image transforms pickled (Python's start method {start_method!r}), and they cannot be: "
                        f"{type(err).__name__}: {first_line(err)}; define each function at the top of recipe.py, not "
                        "as a lambda or inside another function, or give --num-workers 0") from None


def with_image_transforms(train_set, transforms):
    """(``train_set`` whose DataLoader items get ``transforms`` (recipe.image_transforms: a
    v2.Compose, or None) per image, those transforms in words for --loader's choice, or None)."""
    if not transforms:
        return train_set, None
    channels = train_set.source.shape[-1]
    if train_set.source.dtype != np.uint8 or channels not in (1, 3):  # what torchvision's image transforms take
        raise UserError(f"{transform_names(transforms)} works on 8-bit images of 1 or 3 channels; these are "
                        f"{train_set.source.dtype} with {channels}: drop --auto-augment (or the transforms)")
    return train_set.with_prep(replace(train_set.prep, per_image=transforms)), transform_names(transforms)


def check_image_transforms(train_set, transform, draws=16):
    """The DataLoader's per-image ``transform`` (recipe.loader_transforms, with recipe.py's own
    transforms) tried on the first training image, at start, with the draws of ``draws`` seeds
    (a RandomResize that shrinks one image in five shows): it must return what the loader
    takes next (loader_mistake). Else one line naming the transforms, where the run would train
    silently on other images (a float image scaled as an 8-bit one) or fail later, in a
    DataLoader worker (InMemoryImages checks every image, a draw missed here included)."""
    names = transform_names(train_set.prep.per_image)
    image = torch.from_numpy(np.array(train_set.source[0])).permute(2, 0, 1)  # (C, H, W), as __getitem__ reads it
    # What recipe.py's transforms are given: the image after --augment's crop, not as stored.
    augment = recipe.loader_transforms(replace(train_set.prep, per_image=None))
    given = f"{image.dtype} {tuple((transformed(image, augment, seed=0) if augment else image).shape)}"
    for seed in range(draws):
        try:
            out = transformed(image, transform, seed)
        except Exception as err:
            raise UserError(f"{names} failed on a training image ({given}): {type(err).__name__}: "
                            f"{first_line(err)}") from None
        mistake = loader_mistake(out, train_set.prep.image_shape)
        if mistake:
            raise UserError(f"{names} returned {mistake} for a {given} image{'' if seed == 0 else ' in one draw'}; "
                            + LOADER_TAKES.format(*train_set.prep.image_shape))


LOADER_TAKES = ("the loader takes 8-bit (C, H, W) images of at least the model's input ({2}, {0}, {1}), "
                "then crops and normalizes them itself: leave out v2.ToDtype, v2.Normalize and crops or resizes "
                "smaller than the input (--image-size sets it for an image folder)")


def loader_mistake(image, image_shape, dtype=torch.uint8):
    """What is wrong with ``image``, a per-image transform's output, for the loader that crops
    its centre to ``image_shape`` (H, W, C) and normalizes it as stored (``dtype``: 8-bit for
    recipe.py's transforms): "float32 (3, 2, 2)"; None when it is a (C, H, W) image of that
    dtype, C channels and at least H x W (a smaller one would be cropped to a corner of itself,
    not refused)."""
    height, width, channels = image_shape
    if (torch.is_tensor(image) and image.dtype == dtype and image.ndim == 3 and image.shape[0] == channels
            and image.shape[1] >= height and image.shape[2] >= width):
        return None
    return f"{image.dtype} {tuple(image.shape)}" if torch.is_tensor(image) else type(image).__name__


def check_augmentation(train_set):
    """--augment's batched operations (recipe.AUGMENTATIONS) tried on two stored training images
    at start, as the device loader runs them (the DataLoader runs a user's on one image at a
    time): they must keep the images' dtype, as normalization scales them as stored (a uint8
    image made float would be scaled 255 times too much), and leave the model's input size.
    Else one line naming them, where the run would train silently on other images."""
    prep = train_set.prep
    if not prep.ops:
        return
    images = torch.from_numpy(np.array(train_set.source[:2]))  # (2, H, W, C), as stored
    rand, out = prep.randoms(len(images), 0, 0), images
    for i, op in enumerate(prep.ops):  # as augment() runs them, then centre-cropped to the input
        out = op(out, rand[:, i], prep)
        if not torch.is_tensor(out):
            raise UserError(f"--augment {prep.augment}: recipe.py's {op.__name__} returned {type_named(out)}, not "
                            "images: each operation returns the images (B, H, W, C) it is given, changed (is its "
                            "return missing?)")
    height, width, channels = prep.image_shape
    if not (out.dtype == images.dtype and out.ndim == 4 and out.shape[0] == len(images) and out.shape[3] == channels
            and out.shape[1] >= height and out.shape[2] >= width):
        names = ", ".join(op.__name__ for op in prep.ops)
        raise UserError(f"--augment {prep.augment} ({names}) returned {str(out.dtype).removeprefix('torch.')} "
                        f"{tuple(out.shape)} for stored {str(images.dtype).removeprefix('torch.')} "
                        f"{tuple(images.shape)} images (B, H, W, C): each operation of recipe.py must return images "
                        f"of the dtype it is given (they are normalized as stored) and of at least the model's input "
                        f"size {height}x{width}")


def as_compose(transforms):
    """recipe.image_transforms' result as one v2.Compose, or None for none: a list of v2
    transforms, or one transform, is taken as their Compose; anything else is one line."""
    if transforms is None or isinstance(transforms, (list, tuple)) and not transforms:
        return None
    from torchvision.transforms import v2  # recipe.py imported it already to make them
    if isinstance(transforms, (list, tuple)) and all(callable(t) for t in transforms):
        transforms = v2.Compose(list(transforms))
    elif callable(transforms) and not isinstance(transforms, v2.Compose):
        transforms = v2.Compose([transforms])
    if not isinstance(transforms, v2.Compose):
        raise UserError(f"recipe.image_transforms returned {type_named(transforms)}: return a v2.Compose of the "
                        "per-image transforms, a list of them, or None for none")
    return transforms


def transform_names(transforms):
    """"recipe.py's per-image ColorJitter, TrivialAugmentWide" for a v2.Compose of them."""
    return f"recipe.py's per-image {', '.join(type(t).__name__ for t in transforms.transforms)}"


def set_loader_epoch(loader, epoch):
    """Reshuffle for ``epoch`` (0-based): the same order on every run with the same seed. The
    DataLoader's sampler takes the epoch, the device loader and a DaliLoader themselves."""
    sampler = loader if hasattr(loader, "set_epoch") else getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def skip_batches(loader, batches):
    """Begin ``loader``'s next iteration (the epoch set_loader_epoch set) after its first
    ``batches`` batches, without reading, decoding or augmenting them: a mid-epoch resume.
    Each image's augmentation is drawn from (seed, epoch, index) alone, so the batches that
    follow are the uninterrupted epoch's. True, or False for a loader that cannot (the caller
    draws them and drops them)."""
    if isinstance(loader, DeviceLoader):
        loader.skip = batches
    elif isinstance(getattr(loader, "sampler", None), AugmentSampler):  # the DataLoader's: images, not batches
        loader.sampler.skip = batches * loader.batch_size
    else:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# What the loaders serve: the data sets, the DataLoader's samplers, and the device loader, which
# make stored images the model's input as Preprocessing above says (the same for predict.py).

def transformed(image, transform, seed):
    """``transform`` (torchvision v2, per image) of one image (C, H, W), its draws from torch's
    global CPU generator seeded with ``seed`` and put back after (in a 0-worker DataLoader it is
    the training process's own): the image's draws depend on nothing that ran before."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return transform(image)


def normalizer(prep, dtype, device):
    """The function that makes stored images (B, H, W, C) of ``dtype`` on ``device`` the
    model's input (B, C, H, W) float32."""
    scale, shift = normalization(prep.mean, prep.std, dtype, device)
    return lambda images: normalize(images, scale, shift)


class InMemoryImages(Dataset):
    """Images (N, H, W, C), uint8 or float32, in memory (or memory-mapped), and labels (N,);
    items are (float32 tensor (C, H, W), int), prepared as ``prep`` (a Preprocessing) says.

    A key is an index (no augmentation: test images, the guide's plain use) or, from
    AugmentSampler, (index, seed): ``transform`` (recipe.loader_transforms) with the image's
    draws seeded by ``seed``. No worker process draws random numbers of its own.
    """

    def __init__(self, images, labels, prep, rows=None, transform=None):
        self.source, self.source_labels, self.prep, self.transform = images, labels, prep, transform
        self.rows = rows  # None, or the indices into ``images`` of a subset (a held-out split)
        self.labels = labels if rows is None else np.asarray(labels)[rows]
        self.dtype = torch.uint8 if images.dtype == np.uint8 else torch.float32  # as stored
        self.scale_shift = normalization(prep.mean, prep.std, self.dtype)  # float32 (C,) each
        self.mapped = MappedImages.of(images)  # an image cache's file: what a worker that is not forked maps

    @property
    def images(self):
        """The images (N, H, W, C): the array itself, or a copy of a subset's rows."""
        return self.source if self.rows is None else self.source[self.rows]

    @property
    def nbytes(self):
        return len(self) * self.source[0].nbytes

    def with_prep(self, prep):
        """The same images, prepared as ``prep`` says (no copy)."""
        return InMemoryImages(self.source, self.source_labels, prep, self.rows)

    def with_transform(self, transform):
        """The same images, training keys (index, seed) transformed by ``transform`` (no copy)."""
        return InMemoryImages(self.source, self.source_labels, self.prep, self.rows, transform)

    def subset(self, rows):
        """The images at ``rows`` (indices into this set) of a held-out split, without a copy."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows if self.rows is None else self.rows[rows]
        return InMemoryImages(self.source, self.source_labels, self.prep, rows)

    def __len__(self):
        return len(self.labels)

    def __getstate__(self):
        """What a DataLoader worker that is not forked receives (forkserver, Python 3.14's default
        start method; spawn): a memory-mapped image cache as its file (MappedImages), which the
        worker maps again, where pickle would copy every image into each worker of each loader.
        A file removed or replaced since it was mapped (another job rebuilt the cache) goes as
        the images themselves."""
        state = dict(self.__dict__)
        if self.mapped is not None and file_identity(self.mapped.path) == self.mapped.identity:
            state["source"] = self.mapped
        return state

    def __getitem__(self, key):
        if isinstance(self.source, MappedImages):  # in a worker, sent the file (__getstate__): mapped once
            self.source = self.source.open()
        index, seed = key if isinstance(key, tuple) else (key, None)
        row = index if self.rows is None else self.rows[index]
        image = torch.from_numpy(np.array(self.source[row])).permute(2, 0, 1)  # (C, H, W): a copy, out of the map
        if seed is not None and self.transform is not None:  # a training image
            stored = tuple(image.shape)
            image = transformed(image, self.transform, seed)
            mistake = loader_mistake(image, self.prep.image_shape, self.dtype)
            if mistake:  # a draw the start-up check missed: one line (engine.cli.worker_error), not a collate error
                per_image = self.prep.per_image
                names = transform_names(per_image) if per_image else f"--augment {self.prep.augment}"
                raise UserError(f"{names} returned {mistake} for training image "
                                f"{index} (stored {stored}); " + LOADER_TAKES.format(*self.prep.image_shape))
        image = centre_crop(image.permute(1, 2, 0)[None], self.prep.image_shape[:2])  # (1, h, w, C); test images
        return normalize(image, *self.scale_shift)[0].contiguous(), int(self.labels[index])


class MappedImages(NamedTuple):
    """A read-only memory map of a whole file of images (an image cache's .npy), as InMemoryImages
    sends it to a worker that is not forked: where it is in the file, and the file's identity."""
    path: str
    dtype: str
    mode: str  # np.memmap's "r" or "c" (copy-on-write): never one that writes the file
    offset: int  # bytes: the .npy header
    shape: tuple
    order: str  # "C" or "F"
    identity: tuple  # file_identity when it was mapped

    @classmethod
    def of(cls, array):
        """``array``'s MappedImages, or None where it is not a read-only map of a whole file (a view
        of one, an array in memory)."""
        if not (isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.mode in ("r", "c")):
            return None
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        return cls(array.filename, array.dtype.str, array.mode, array.offset, array.shape, order,
                   file_identity(array.filename))

    def open(self):
        """The images mapped again, in a worker: refused in one line (through the worker's error)
        when the file is no longer the one the training process mapped."""
        if file_identity(self.path) != self.identity:
            raise DatasetError(f"{self.path} was removed or replaced while training read it (another run rebuilt "
                               "the image cache?); start the run again", same_on_every_rank=False)
        return np.memmap(self.path, np.dtype(self.dtype), self.mode, self.offset, self.shape, self.order)


def file_identity(path):
    """(device, inode, size, modification time in ns) of the file ``path``, or None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class FileImages:
    """Image files (absolute paths) and int64 labels (N,), prepared as ``prep`` (a Preprocessing)
    says: what InMemoryImages is to the other loaders, for --loader dali, which reads
    and decodes the files itself."""

    def __init__(self, files, labels, prep):
        self.files, self.labels, self.prep = [str(f) for f in files], np.asarray(labels, dtype=np.int64), prep

    @property
    def nbytes(self):
        """What the images would take decoded at their stored size (uint8): what the cache would hold."""
        return len(self) * int(np.prod(self.prep.stored)) * self.prep.image_shape[2]

    def with_prep(self, prep):
        return FileImages(self.files, self.labels, prep)

    def subset(self, rows):
        """The images at ``rows`` (indices into this set) of a held-out split."""
        return FileImages([self.files[i] for i in rows], self.labels[np.asarray(rows, dtype=np.int64)], self.prep)

    def __len__(self):
        return len(self.labels)


class AugmentSampler(Sampler):
    """The indices of ``sampler``, as (index, seed) keys for InMemoryImages: the
    seed of the image's per-image transforms in this epoch (augmentation_seeds, a function of
    (seed, epoch, index) alone), drawn at the start of the epoch in one call, so persistent
    workers, which never see ``set_epoch``, need no RNG of their own and a resumed run, with any
    number of workers, draws what the uninterrupted one drew."""

    def __init__(self, sampler, size, seed):
        self.sampler, self.size, self.seed, self.epoch = sampler, size, seed, 0
        self.skip = 0  # indices the next iteration leaves out (skip_batches), then 0 again

    def set_epoch(self, epoch):
        self.epoch, self.skip = epoch, 0  # a skip is for the epoch it was asked in
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        seeds = augmentation_seeds(self.size, self.seed, self.epoch).tolist()
        skip, self.skip = self.skip, 0
        return ((index, seeds[index]) for index in islice(self.sampler, skip, None))

    def __len__(self):
        return len(self.sampler)


class ShardSampler(Sampler):
    """Indices rank, rank + world_size, ...: across all ranks every index exactly once.

    Unlike DistributedSampler it never pads the shards with repeated samples, so an
    evaluation summed over ranks counts each test image once. Shards may differ in length
    by one: evaluation only all-reduces sums, so that is fine.
    """

    def __init__(self, length, rank=0, world_size=1):
        self.indices = range(rank, length, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def augment(images, rand, ops, prep):
    """``ops`` (recipe.AUGMENTATIONS[...]) applied in order to images (B, H, W, C); rand
    (B, len(ops), per_op) on the images' device."""
    for i, op in enumerate(ops):
        images = op(images, rand[:, i], prep)
    return images


def model_view(images, rand, prep):
    """What the model sees of stored images (B, H, W, C): the training augmentation
    (``prep.ops``) with each image's random numbers ``rand`` (None for test images: none),
    then the centre of the model's input size ``prep.image_shape`` if still larger (images
    stored 8/7 of it for resized-crop: the usual resize 256, centre crop 224)."""
    if rand is not None:
        images = augment(images, rand, prep.ops, prep)
    if tuple(images.shape[1:3]) != tuple(prep.image_shape[:2]):
        images = centre_crop(images, prep.image_shape[:2])
    return images


def batch_temporaries(prep, batch, dtype, device):
    """Bytes of the GPU ``device`` that the device loader takes, beyond the batch it returns, to
    make one training batch of ``batch`` stored images: the gathered images and the
    augmentation's intermediates (a resized crop's are float32).
    Measured on zeros by the allocator's peak (host-side counts: no sync). 0 on the CPU."""
    if device.type != "cuda":
        return 0
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    images = torch.zeros((batch, *prep.stored, prep.image_shape[2]), dtype=dtype, device=device)
    rand = prep.randoms(batch, 0, 1).to(device) if prep.ops else None
    out = normalizer(prep, dtype, device)(model_view(images, rand, prep))
    peak = torch.cuda.max_memory_allocated(device) - before - out.nbytes
    del images, rand, out
    torch.cuda.empty_cache()
    return peak


class DeviceLoader:
    """Batches of (images float32 (B, C, H, W), labels int64 (B,)) cut from a data set that
    lives on ``device`` as uint8 (or float). Indices come from ``sampler`` (a
    DistributedSampler for training, so the order and sharding are exactly the torchvision
    loader's); training batches get the data set's augmentation (``dataset.prep.ops``) with
    each image's random numbers of the epoch, so batch k of an epoch is the same whether or
    not batches before it were drawn (mid-epoch resume skips them)."""

    num_workers = 0  # for the start-up block: no worker processes

    def __init__(self, dataset, batch_size, sampler, device, augmented, drop_last, seed=0):
        self.dataset, self.batch_size, self.sampler = dataset, batch_size, sampler
        self.prep = dataset.prep
        self.augmented = augmented and bool(self.prep.ops)
        self.device, self.drop_last, self.seed = device, drop_last, seed
        self.images = torch.as_tensor(dataset.images).to(device)  # uint8 (N, H, W, C); a view on the CPU
        self.labels = torch.as_tensor(dataset.labels, dtype=torch.int64).to(device)  # (N,)
        self.normalize = normalizer(self.prep, self.images.dtype, device)
        self.skip = 0  # batches the next iteration leaves out (skip_batches), then 0 again

    def set_epoch(self, epoch):
        """Reshuffle for ``epoch`` (the sampler's order); a skip is for the epoch it was asked in."""
        self.skip = 0
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self):
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full + (rest > 0 and not self.drop_last)

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return self.batches(skip)

    def batches(self, skip):
        """The epoch's batches after its first ``skip``."""
        # One small host-to-device copy per epoch: this rank's indices (N / world_size int64).
        indices = torch.as_tensor(list(self.sampler), dtype=torch.int64).to(self.device)
        if self.augmented:
            # The whole data set's numbers, copied once per epoch (8 bytes each, 32 per operation
            # and image): each image's, whatever rank serves it.
            rand = self.prep.randoms(len(self.labels), self.seed, getattr(self.sampler, "epoch", 0)).to(self.device)
        for start in range(skip * self.batch_size, len(self) * self.batch_size, self.batch_size):
            batch = indices[start:start + self.batch_size]
            images = model_view(self.images[batch], rand[batch] if self.augmented else None, self.prep)
            yield self.normalize(images), self.labels[batch]  # (B, C, H, W) float32, (B,) int64


def choose_loader(requested, data_bytes, memory_bytes, measured=None, loader_bytes=0, per_image=None):
    """(loader, why) for --loader. auto puts the data set on the device when it fits beside
    training and the device loader's own ``loader_bytes`` per batch (batch_temporaries) in
    HEADROOM of the device's free memory (``measured``: engine.memory.Measured), or, where
    nothing is measured (the CPU), in DEVICE_DATA_FRACTION of its ``memory_bytes``; else the
    DataLoader streams it from host memory. ``per_image`` (the per-image transforms, in words)
    needs the DataLoader's workers: the device loader transforms whole batches."""
    if per_image and requested != "torchvision":
        if requested == "device":
            raise UserError(f"{per_image} transforms each image on its own, in the DataLoader's workers: --loader "
                            "device transforms whole batches; use --loader torchvision (or auto)")
        return "torchvision", f"auto: {per_image} transforms each image, in the DataLoader's workers"
    if requested != "auto":
        return requested, f"--loader {requested}"
    data = size_text(data_bytes)
    if measured is None:
        fits = data_bytes <= DEVICE_DATA_FRACTION * memory_bytes
        return ("device" if fits else "torchvision",
                f"auto: the data set ({data}) {'fits' if fits else 'does not fit'} in {DEVICE_DATA_FRACTION:.0%} "
                f"of the device's {size_text(memory_bytes)}")
    fits = data_bytes + measured.training + loader_bytes <= HEADROOM * measured.free
    training = ("out of memory on its own" if math.isinf(measured.training)
                else f"{size_text(measured.training)}, measured")
    return ("device" if fits else "torchvision",
            f"auto: the data set ({data}), training ({training}) and the device loader's batch "
            f"({size_text(loader_bytes)}) {'fit' if fits else 'do not fit'} together in {HEADROOM:.0%} of the "
            f"device's free {size_text(measured.free)} (of {size_text(measured.total)})")


# ---------------------------------------------------------------------------------------------
# --dataset of the command line: the data and what the engine knows of it (engine/task.py).

def build_data(args, ctx, listed=False, normalization=None):
    """(train_set, test_set, DataInfo) of --dataset: InMemoryImages both (FileImages for an image
    folder ``listed`` for --loader dali); with --val-fraction the test set is the part of the
    training images held out. --eval-only prepares the images as the --weights file records (the
    normalization of the images it was trained on); a resumed run as its checkpoints record
    (``normalization``: {"mean", "std"}), whichever loader measured them first."""
    if args.dataset in DATASETS:
        train, test, info = builtin_data(args, ctx)
    elif args.dataset == FOLDER:
        if args.eval_only:
            from engine.weights import check_evaluable, check_folder_classes  # --eval-only only
            if not args.val_fraction:  # a folder the weights were not validated on
                check_evaluable(args.data_dir, args.weights)
            check_folder_classes(args.data_dir, args.weights)  # before the images are decoded
        train, test, info = (folder_list_data if listed else folder_data)(args, ctx)
    else:  # global rank 0 first, so that a NAME that downloads or unpacks does it once; then the others
        loaded = {}
        from_rank0(lambda: loaded.update(data=plugin_data(args)), ctx.control_group, patient=True)
        train, test, info = loaded["data"] if ctx.is_main else plugin_data(args)
    if len(info.classes) < 2:  # an image folder says so as it is scanned; a FILE.py:NAME here
        raise UserError(f"{info.title} has {count(len(info.classes), 'class', 'classes')}: a classifier needs at "
                        "least two")
    for images, split in ((train, "training"), (test, "test")):  # a damaged file or cache, a data set's mistake
        if images is not None:
            check_labels(images.labels, len(info.classes), f"{info.title} {split}")
    present = np.unique(np.asarray(train.labels))
    if len(present) == 1:  # of more classes by name: it would learn one answer, to 100% (a FILE.py:NAME's labels)
        raise UserError(f"every training image of {info.title} has the label {present[0]} ({info.classes[present[0]]}) "
                        f"of its {len(info.classes)} classes: a classifier needs images of at least two")
    if test is not None and not args.val_fraction:  # a class folder missing or empty in test/, say
        unseen = [info.classes[c] for c in np.setdiff1d(np.arange(len(info.classes)), np.asarray(test.labels))]
        if unseen:
            shown = ", ".join(map(str, unseen[:3])) + (", ..." if len(unseen) > 3 else "")
            info = replace(info, notes=(*info.notes, (
                f"Warning: the test images hold none of {count(len(unseen), 'class', 'classes')} of the "
                f"{len(info.classes)} ({shown}): the accuracy is over the others; add test images of each class, "
                "or validate on part of the training images with --val-fraction 0.2")))
    if args.eval_only:  # the images prepared as the --weights' training prepared its own
        from engine.weights import as_trained, as_trained_split  # --eval-only only
        train, test, info = as_trained(train, test, info, args.weights)
    elif normalization and (tuple(normalization["mean"]), tuple(normalization["std"])) != (info.prep.mean,
                                                                                          info.prep.std):
        prep = replace(info.prep, mean=tuple(normalization["mean"]), std=tuple(normalization["std"]))
        train, test = train.with_prep(prep), (test.with_prep(prep) if test is not None else None)
        info = replace(info, prep=prep, notes=(*info.notes, (
            f"Normalization: the run's own, from its checkpoint: mean {prep.mean}, std {prep.std} (measured here: "
            f"mean {info.prep.mean}, std {info.prep.std}; --loader dali measures the whole photos, the other "
            "loaders their stored crops)")))
    elif args.dataset not in DATASETS:
        info = replace(info, notes=(*info.notes, f"Normalization: from the training images, mean {info.prep.mean}, "
                                                 f"std {info.prep.std}"))
    if args.val_fraction:
        if args.eval_only:  # the images the weights' training held out, or one line
            train, info = as_trained_split(train, info, args.weights)
        split = stratified_split(train.labels, args.val_fraction, args.seed)
        if not len(split.val):  # every class of one image, kept for training: each accuracy would be nan
            raise UserError(f"--val-fraction {args.val_fraction:g} holds out no image of {info.title}: each of its "
                            f"{len(info.classes)} classes has a single training image, which stays in training; add "
                            "images (two or more per class), or a test/ folder to validate on")
        unused = (f"; its {len(test)} test images are not used" if test is not None else "")
        record = held_out_record(args.val_fraction, args.seed, train.labels, info.skipped, info.names_sha256)
        described = describe_split(split, args.val_fraction, args.seed, info.classes, train.labels) + unused
        train, test = train.subset(split.train), train.subset(split.val)
        info = replace(info, notes=(*info.notes, described), split=record)
    elif test is None:
        raise UserError(f"--dataset {args.dataset} has no test split: hold out part of the training images for "
                        "validation with --val-fraction 0.2 (20% of each class)")
    return train, test, info


def builtin_data(args, ctx):
    spec = DATASETS[args.dataset]
    train, test = build_datasets(args.data_dir, args.download, args.synthetic, args.seed, ctx.rank, spec,
                                 args.augment, ctx.control_group)
    source = ("SYNTHETIC random images and labels: accuracy is meaningless" if args.synthetic
              else f"{spec.title} from {args.data_dir or 'datasets/ beside the scripts'}")
    if args.synthetic:
        classes = tuple(str(label) for label in range(spec.num_classes))
    else:  # CIFAR's: read in its meta
        from engine.data_formats import class_names
        classes = class_names(builtin_root(args.data_dir, spec), spec)
    return train, test, DataInfo(spec.name, spec.title, source, classes, train.prep,
                                 data_fingerprint(spec.name, args.synthetic, train.labels, len(test),
                                                  images=None if args.synthetic else train.source),
                                 spec.split_sizes, read_sizes={"train": len(train), "test": len(test)})


def folder_size(augment, image_size):
    """The image_cache.SizeRequest of --augment and --image-size: the training images' most
    common size, or --image-size (8/7 of it for resized-crop); with --augment auto that
    depends on whether the images are photos, which the cache's header pass finds out."""
    from engine.image_cache import MOST_COMMON, SizeRequest, fixed_size
    if not image_size:
        return MOST_COMMON

    def stored(augment):
        return recipe.stored_size(augment, image_size)

    def why(augment):
        asked = f"--image-size {flag_value(image_size)}"
        return asked if stored(augment) == tuple(image_size) else f"8/7 of {asked} for {augment}"

    def chosen(stats):  # --augment auto: resized-crop when the images are photos
        return recipe.auto_augment(stats.median_short_side)

    if augment != "auto":
        return fixed_size(stored(augment), why(augment))
    return SizeRequest(f"{flag_value(image_size)}-auto", lambda stats: stored(chosen(stats)),
                       lambda stats: why(chosen(stats)))


def prepare_folder_cache(args, log=print):
    """The cache of --data-dir for the data flags ``args`` (--cache-dir, --image-size, --augment,
    --val-fraction), built if missing: train.py and ``python dataset_utils.py --dataset folder``
    both call this, so training reuses what the pre-decoding built."""
    from engine.image_cache import default_cache_dir, prepare_folder
    return prepare_folder(args.data_dir, Path(args.cache_dir) if args.cache_dir else default_cache_dir(),
                          folder_size(args.augment, args.image_size), log, held_out=bool(args.val_fraction))


def folder_data(args, ctx):
    """The image folder, decoded into its cache by global rank 0 (the others wait), then
    memory-mapped by every rank. With resized-crop the cache keeps the images at 8/7 of the
    training size (recipe.stored_size); --augment auto looks at the images' own size."""
    from engine.image_cache import read_folder_cache
    target = from_rank0(lambda: str(prepare_folder_cache(args)), ctx.control_group, patient=True)
    folder = read_folder_cache(Path(target), args.data_dir)
    prep, notes = folder_preprocessing(args, folder.stats, folder.train[0].shape[3], folder.mean, folder.std,
                                       tuple(folder.train[0].shape[1:3]))
    train = InMemoryImages(*folder.train, prep)
    test = InMemoryImages(*folder.test, prep) if folder.test is not None else None
    return train, test, folder_info(args, folder, prep, train.labels, len(test or ()), folder.notes + notes)


def folder_preprocessing(args, stats, channels, mean, std, stored=None):
    """(Preprocessing, notes) of an image folder whose training images' sizes are ``stats``
    (image_folder.FolderStats): --augment auto resized-crop for photos, the training size
    --image-size or that of images ``stored`` at (H, W) (default: as the cache would store them)."""
    augment, notes = args.augment, ()
    if augment == "auto":
        side = stats.median_short_side
        augment = recipe.auto_augment(side)
        photos = augment == "resized-crop"
        notes = (f"--augment auto: {augment}, as the images are {'photos' if photos else 'small'} (median shorter "
                 f"side {side} pixels, {'' if photos else 'not '}larger than {recipe.PHOTO_PIXELS})",)
    stored = stored or tuple(folder_size(augment, args.image_size).choose(stats))
    size = tuple(args.image_size or recipe.training_size(augment, stored))
    return preprocessing((*size, channels), mean, std, augment, stored_size=stored if stored != size else None), notes


def folder_info(args, folder, prep, train_labels, test_size, notes, how=""):
    """The DataInfo of image folder --data-dir (FolderData or FolderList ``folder``)."""
    from engine.image_folder import validation_note
    notes = (*notes, *([] if args.val_fraction else validation_note(args.data_dir)))
    shown = ", ".join(folder.classes[:8]) + (", ..." if len(folder.classes) > 8 else "")
    source = f"the image folder {args.data_dir} ({count(len(folder.classes), 'class', 'classes')}: {shown}){how}"
    names = folder.names_sha256.get("train")  # None for a cache built before they were recorded
    return DataInfo(FOLDER, f"image folder {args.data_dir}", source, folder.classes, prep,
                    data_fingerprint(FOLDER, False, train_labels, test_size, folder.classes, prep.image_shape,
                                     mean=folder.mean, mean_of="stored" if hasattr(folder, "cache") else "files",
                                     names=names if args.val_fraction else None),  # the split goes by their order
                    notes=notes, data_dir=str(Path(args.data_dir).expanduser().resolve()),
                    skipped=folder.skipped.get("train", ()), names_sha256=names)


def folder_list_data(args, ctx):
    """The image folder for --loader dali: checked and listed by global rank 0 (the others wait),
    its files decoded by DALI every epoch; sizes and augmentation chosen as folder_data's."""
    from engine.image_cache import default_cache_dir
    from engine.image_list import prepare_list, read_list
    root, cache_dir = Path(args.data_dir).expanduser(), Path(args.cache_dir or default_cache_dir())
    target = from_rank0(lambda: str(prepare_list(root, cache_dir, held_out=bool(args.val_fraction))),
                        ctx.control_group, patient=True)
    folder = read_list(target, root)
    prep, notes = folder_preprocessing(args, folder.stats, 1 if folder.gray else 3, folder.mean, folder.std)
    train = FileImages(*folder.train, prep)
    test = FileImages(*folder.test, prep) if folder.test is not None else None
    return train, test, folder_info(args, folder, prep, train.labels, len(test or ()), folder.notes + notes,
                                    ", decoded by DALI")


def dali_choice(args, device, group=None, per_image=None):
    """("dali" or None, why) for --loader: dali (one line without DALI, for data that is not an
    image folder, with recipe.py's per-image transforms ``per_image``, a v2.Compose that runs
    in the DataLoader's workers, or with an --augment operation DALI lacks), or auto for an
    image folder on a GPU with DALI installed that would not fit the device (choose_dali; global
    rank 0 reads the folder's headers, the others wait)."""
    # The training operations DALI must run: --augment auto's are those of either of its choices.
    candidates = recipe.AUGMENT_AUTO if args.augment == "auto" else (args.augment,)
    named = () if args.eval_only else sum((recipe.augmentation_ops(name) for name in candidates), ())
    if args.loader == "dali":
        from engine.dali_loader import check_dali
        if args.dataset != FOLDER:
            raise UserError(f"--loader dali reads image files: it takes --dataset {FOLDER}, not {args.dataset} "
                            "(use --loader device or torchvision)")
        if per_image:
            raise UserError(f"{transform_names(per_image)} transforms each image in the DataLoader's workers, which "
                            "DALI has no operator for: use --loader torchvision (or auto) with it, not dali")
        recipe.check_dali_ops(named)
        check_dali()
        return "dali", "--loader dali"
    own_ops = recipe.dali_lacks(named)  # the DataLoader runs them
    if args.loader != "auto" or args.dataset != FOLDER or device.type != "cuda" or per_image or own_ops:
        return None, None
    from engine.dali_loader import choose_dali, dali_installed
    from engine.image_list import decoded_bytes
    if not dali_installed():
        return None, None
    request = folder_size(args.augment, args.image_size)
    decoded = from_rank0(lambda: decoded_bytes(args.data_dir, bool(args.val_fraction), request), group, patient=True)
    use, why = choose_dali(decoded, torch.cuda.mem_get_info(device)[1])
    return ("dali" if use else None), why


def plugin_data(args):
    """NAME(data_dir) of --dataset FILE.py:NAME, read whole into memory."""
    from engine.data_formats import default_data_dir
    from engine.image_folder import channel_stats
    from engine.user_data import read_user_data
    ref, data_dir = args.dataset, args.data_dir or str(default_data_dir())
    data = read_user_data(ref, data_dir)
    images = data.train[0]
    mean, std = channel_stats(images, 255 if images.dtype == np.uint8 else 1)
    prep = preprocessing(images.shape[1:], mean, std, args.augment, recipe.auto_augment(min(images.shape[1:3])))
    train = InMemoryImages(*data.train, prep)
    test = InMemoryImages(*data.test, prep) if data.test is not None else None
    key = plugin_key(ref)
    return train, test, DataInfo(key, ref, f"{ref}({data_dir}), {len(data.classes)} classes", data.classes, prep,
                                 data_fingerprint(key, False, train.labels, len(test or ()), data.classes,
                                                  prep.image_shape, images=train.source))


def default_num_workers(local_world_size):
    """One loader worker per spare CPU core of this process's share, capped."""
    return max(0, min(MAX_AUTO_WORKERS, available_cores() // local_world_size - 1))


def build_parser():
    parser = OneLineParser(description="Download a data set (if missing) and check that it can be read, or decode an "
                                       "image folder into the cache train.py with the same flags reuses. A small demo "
                                       "copy of a data set to try things on: python tools/demo_data.py --help")
    add_data_arguments(parser)  # train.py's own definitions
    recipe.add_augment_argument(parser)
    parser.add_argument("--loader", choices=("cache", "dali"), default="cache",
                        help="--dataset folder: cache = decode the images into the cache (train.py's device and "
                             "torchvision loaders); dali = check each image once and list the readable ones for "
                             "train.py --loader dali, which decodes them itself (no decoded copy)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_data_arguments(args, parser.error)
    if args.loader == "dali" and args.dataset != FOLDER:
        parser.error(f"--loader dali lists an image folder (--dataset {FOLDER}); {args.dataset} needs no list")
    if args.dataset not in DATASETS and args.dataset != FOLDER:
        parser.error(f"--dataset {args.dataset} is your own code, which reads its data itself; this script fetches "
                     f"{', '.join(DATASETS)} and decodes image folders")
    try:
        if args.dataset == FOLDER:
            return prepare_image_folder(args) if args.loader == "cache" else list_image_folder(args)
        from engine.data_formats import class_names, prepare, read_split
        spec = DATASETS[args.dataset]
        data_dir = builtin_root(args.data_dir, spec)
        prepare(data_dir, spec, download=True)
        sizes = {split: len(read_split(data_dir, split, spec)[1]) for split in spec.split_sizes}
        class_names(data_dir, spec)  # CIFAR's class-name file, read and checked as a training run reads it
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # a download or a decode in progress leaves no partial files behind
        print("Interrupted (Ctrl-C): no partial files were kept", file=sys.stderr)
        return 130
    print(f"{spec.title} ready in {data_dir / spec.folder}: {sizes['train']} training and {sizes['test']} test images")
    for line in sizes_warning(spec.title, spec.split_sizes, sizes):  # tools/demo_data.py's small copy, say
        print(line)
    return 0


def list_image_folder(args):
    """``python dataset_utils.py --dataset folder --data-dir DIR --loader dali``: the list train.py
    --loader dali with the same --data-dir and --cache-dir reuses, made ahead of a job."""
    from engine.image_cache import default_cache_dir
    from engine.image_list import prepare_list, read_list
    root, cache_dir = Path(args.data_dir).expanduser(), Path(args.cache_dir or default_cache_dir())
    target = prepare_list(root, cache_dir, held_out=bool(args.val_fraction))
    folder = read_list(target, root)
    for note in folder.notes:
        print(note)
    print(f"Image folder {args.data_dir} ready for --loader dali: {len(folder.train[1])} training images"
          + (f" and {len(folder.test[1])} test images" if folder.test is not None else "")
          + f" of {len(folder.classes)} classes")
    return 0


def prepare_image_folder(args):
    """``python dataset_utils.py --dataset folder --data-dir DIR [train.py's data flags]``: build
    the cache train.py with these flags reuses, ahead of a job (on a login node, so that no
    allocation waits for it), and say what it holds, the unreadable images first."""
    from engine.image_cache import read_folder_cache
    target = prepare_folder_cache(args)
    data = read_folder_cache(target, args.data_dir)
    for note in data.notes[:-1]:  # the last names the cache, which the summary does
        print(note)
    train = f"{count(len(data.train[1]), 'training image', 'training images')}"
    if args.val_fraction:
        held = len(stratified_split(data.train[1], args.val_fraction, 0).val)  # how many does not depend on the seed
        train += f" ({held} of them held out for validation by --val-fraction {args.val_fraction:g})"
    test = f" and {len(data.test[1])} test images" if data.test is not None and not args.val_fraction else ""
    print(f"Image folder {args.data_dir} ready in {target}: {train}{test} of {len(data.classes)} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
