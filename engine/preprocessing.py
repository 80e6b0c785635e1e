"""How stored images become the model's input, the same for training, validation and
predict.py: Preprocessing (the input's shape, normalization and training augmentation),
normalization as one fused multiply-add per value, the centre crop of images stored larger than
the input, and each training image's random draws as a function of (seed, epoch, index) alone.
"""

from dataclasses import dataclass, replace

import torch

from engine.errors import UserError
from engine.log import flag_value
from engine.seeds import derived_seed

# The augmentation's streams: (seed, epoch, STREAM), above any rank's (seed, epoch, rank) of dropout.
AUGMENT_STREAM = 2**31 - 3  # the device loader's numbers for each image
IMAGE_STREAM = 2**31 - 4    # the DataLoader's seed for each image


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
