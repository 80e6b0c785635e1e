"""The device loader: batches served from a data set that lives on the GPU (or the CPU),
augmented a whole batch at a time by recipe.py's batched operations, fed each image's random
numbers of the epoch (engine/preprocessing.py); and --loader auto's choice of where the data
set goes (``choose_loader``).
"""

import math

import torch

from engine.disk_space import size_text
from engine.errors import UserError
from engine.memory import HEADROOM
from engine.preprocessing import centre_crop, normalizer

DEVICE_DATA_FRACTION = 0.25  # --loader auto, where training cannot be measured: the data set's share of memory


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
