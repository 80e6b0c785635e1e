"""Turning stored images into the model's input, as batched tensor operations on any device:
normalization as ToTensor + Normalize compute it (one multiply-add per value), the training augmentation
(recipe.py's operations, fed the per-image random numbers of ``augmentation_randoms``), and
``DeviceLoader``, which serves batches from a data set that lives on the GPU; then when the
data set goes there (``choose_loader``).

The torchvision loader (dataset_utils.InMemoryImages in DataLoader workers) calls the same
``model_view`` and ``normalize`` on a batch of one image, so both loaders serve the same
crops for the same seed.
"""

import math
from dataclasses import dataclass, replace

import torch

from engine.disk_space import size_text
from engine.errors import UserError
from engine.log import flag_value
from engine.memory import HEADROOM
from engine.seeds import derived_seed

AUGMENT_STREAM = 2  # the augmentation's seed is (seed, epoch, AUGMENT_STREAM): apart from dropout's
IMAGE_STREAM = 2**31 - 4  # the per-image transforms' seeds: (seed, epoch, IMAGE_STREAM), no rank's epoch_seed
DEVICE_DATA_FRACTION = 0.25  # --loader auto, where training cannot be measured: the data set's share of memory


@dataclass(frozen=True)
class Preprocessing:
    """How stored images become the model's input (dataset_utils.preprocessing makes one from
    recipe.py's augmentations)."""
    image_shape: tuple  # (H, W, C) the model's input
    mean: tuple         # per channel: of the pixels scaled to 0..1 (uint8 images), or as stored (float)
    std: tuple
    augment: str = "none"  # the training augmentation's name in recipe.AUGMENTATIONS
    ops: tuple = ()        # its operations, in order: (images (B, H, W, C), rand, prep) -> images
    padding: int = 0       # zero padding (pixels) around a training image before a random crop
    stored_size: tuple = None  # (H, W) of the stored images when larger than the input (resized-crop), else None
    per_op: int = 4        # uniform numbers each operation gets per image (recipe.RANDOM_PER_OP)
    per_image: object = None  # recipe.image_transforms: torchvision v2 on each uint8 (C, H, W) image, or None

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
        names = [op.__name__ for op in self.ops] + [f"per image {type(t).__name__}" for t in per_image]
        ops = ", ".join(names) or "nothing"
        padding = f", {self.padding}-pixel padding" if any(op.__name__.startswith("pad") for op in self.ops) else ""
        height, width, _ = self.image_shape
        sizes = (f"; stored {'x'.join(map(str, self.stored))}, trained on {height}x{width} crops, tested on the "
                 "centre crop" if self.stored != (height, width) else "")
        return f"{self.augment} ({ops}{padding}{sizes}), normalized with mean {self.mean} and std {self.std}"


def trained_preprocessing(prep, trained, weights):
    """(Preprocessing, the start-up block's line) of --eval-only: ``prep`` normalized as the
    --weights file ``weights`` records (``trained``: its metadata) that its training images
    were, after checking that their sizes agree; (``prep``, None) for a file that records none."""
    if "mean" not in trained:
        return prep, None
    stored = tuple(trained.get("stored_size") or trained["image_size"])
    if tuple(trained["image_size"]) != prep.image_shape[:2] or stored != prep.stored:
        raise UserError(f"--weights {weights} were trained on {flag_value(trained['image_size'])} images (stored at "
                        f"{flag_value(stored)}), these are {flag_value(prep.image_shape[:2])} (stored at "
                        f"{flag_value(prep.stored)}): evaluate them on the data they were trained on")
    prep = replace(prep, mean=tuple(trained["mean"]), std=tuple(trained["std"]))
    return prep, (f"Preprocessing: from --weights {weights}: {flag_value(prep.image_shape[:2])} input, stored "
                  f"{flag_value(prep.stored)}, trained with --augment {trained.get('augment', prep.augment)}; "
                  f"normalization mean {prep.mean}, std {prep.std}")


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


def transformed(image, transform, seed):
    """``transform`` (torchvision v2, per image) of one image (1, H, W, C) uint8, as the
    (C, H, W) tensor v2 expects, its draws from torch's global CPU generator seeded with
    ``seed`` and put back after (in a 0-worker DataLoader it is the training process's own)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return transform(image[0].permute(2, 0, 1)).permute(1, 2, 0)[None]


def augment(images, rand, ops, prep):
    """``ops`` (recipe.AUGMENTATIONS[...]) applied in order to images (B, H, W, C); rand
    (B, len(ops), per_op) on the images' device."""
    for i, op in enumerate(ops):
        images = op(images, rand[:, i], prep)
    return images


def centre_crop(images, size):
    """The central ``size`` (h, w) of images (B, H, W, C), offsets rounded as torchvision's
    CenterCrop rounds them: the test view of images stored larger than the model's input."""
    height, width = size
    top, left = round((images.shape[1] - height) / 2), round((images.shape[2] - width) / 2)
    return images[:, top:top + height, left:left + width]


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


def normalization(mean, std, dtype, device="cpu"):
    """(scale, shift), float32 (C,) on ``device``: stored images of ``dtype`` become the model's
    input as x * scale + shift, which is ToTensor + Normalize's (x / 255 - mean) / std for
    uint8 and (x - mean) / std for a data set of floats. Computed in float64, rounded once."""
    mean, std = torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)
    unit = 1 / 255 if dtype == torch.uint8 else 1.0
    return (unit / std).float().to(device), (-mean / std).float().to(device)


def normalize(images, scale, shift):
    """Stored images (B, H, W, C) -> float32 (B, C, H, W): one fused multiply-add per value
    (``normalization``'s scale and shift, on the images' device), uint8 read as it is. Within
    one float32 rounding (2.4e-7) of ToTensor + Normalize; the lookup table that matched them
    bit for bit cost 4.6x as much on a CPU and an int64 copy of the batch on a GPU. The result
    is channels-last in memory (the permute is a view), the layout the model wants on the GPU."""
    images = images if images.dtype == torch.uint8 else images.float()
    return torch.addcmul(shift, images, scale).permute(0, 3, 1, 2)


def normalizer(prep, dtype, device):
    """The function that makes stored images (B, H, W, C) of ``dtype`` on ``device`` the
    model's input (B, C, H, W) float32."""
    scale, shift = normalization(prep.mean, prep.std, dtype, device)
    return lambda images: normalize(images, scale, shift)


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

    def __len__(self):
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full + (rest > 0 and not self.drop_last)

    def __iter__(self):
        # One small host-to-device copy per epoch: this rank's indices (N / world_size int64).
        indices = torch.as_tensor(list(self.sampler), dtype=torch.int64).to(self.device)
        if self.augmented:
            # The whole data set's numbers, copied once per epoch (8 bytes each, 32 per operation
            # and image): each image's, whatever rank serves it.
            rand = self.prep.randoms(len(self.labels), self.seed, getattr(self.sampler, "epoch", 0)).to(self.device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
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
