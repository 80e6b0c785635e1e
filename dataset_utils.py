"""The data sets as batches of (images, labels): transforms, samplers and the two loaders.
Which files each data set has, how they are fetched and read is in data_formats.py.

Compute nodes often have no internet, so fetch the data ahead of time on a login node:

    python dataset_utils.py --dataset cifar100 --data-dir ./datasets    # or cifar10, fashion-mnist, mnist

The training scripts download only when the data is missing, and then only global rank 0
downloads while the other ranks wait.

Two loaders serve the same batches of (float32 images (B, C, H, W), int64 labels (B,)):

- ``device`` (the training scripts' default): the whole data set is copied to the device
  once as uint8 (150 MB for CIFAR's training set, 47 MB for MNIST's); each batch is a gather
  plus random crop, flip and normalization as batched tensor operations there. No worker
  processes, no host-to-device copies and no CPU time per image.
- ``torchvision``: the guide's DataLoader of PIL transforms, for data that does not fit on
  the device or for comparison; with ``num_workers`` persistent worker processes.

Both shuffle exactly as ``DistributedSampler`` does (by seed and epoch, sharded by rank),
and both draw their augmentation from generators seeded by (seed, epoch, rank) or (seed,
epoch), never from what ran before: a resumed run augments identically. The augmentation is
the data set's (DataSpec.augmentation): CIFAR pads 4 pixels and flips, Fashion-MNIST pads 2
and flips, MNIST pads 2 and never flips.
"""

import argparse
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms as transforms
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from data_formats import DATASETS, DatasetError, default_data_dir, prepare, read_split
from device_utils import from_rank0

CIFAR100 = DATASETS["cifar100"]  # the guide's, and the default of every function here
LOADERS = ("device", "torchvision")
# Seeds: dropout (seed, epoch, rank) in train_utils.epoch_seed; device-loader augmentation
# (seed, epoch, rank, BATCH_STREAM); torchvision-loader augmentation (seed, epoch, 0,
# IMAGE_STREAM), the same on every rank. The non-zero last entries keep the three apart
# (SeedSequence ignores trailing zeros).
BATCH_STREAM, IMAGE_STREAM = 1, 2


def synthetic_split(split, seed=0, spec=CIFAR100):
    """Random images and labels of the data set's shape and size; the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 2 + (split == "test"))
    n = spec.split_sizes[split]
    images = torch.randint(0, 256, (n, *spec.image_shape), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, spec.num_classes, (n,), generator=generator)
    return images.numpy(), labels.numpy()


def train_transform(spec=CIFAR100):
    """The guide's augmentation, per data set: flip (unless digits), crop of the zero-padded
    image, normalize."""
    flip = [transforms.RandomHorizontalFlip()] if spec.flip else []
    return transforms.Compose([*flip, transforms.RandomCrop(spec.image_shape[:2], padding=spec.padding),
                               transforms.ToTensor(), transforms.Normalize(spec.mean, spec.std)])


def eval_transform(spec=CIFAR100):
    """Deterministic: normalize only (the guide evaluated on randomly cropped, flipped images)."""
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(spec.mean, spec.std)])


def derived_seed(*values):
    """A 63-bit seed from integers such as (seed, epoch, rank): statistically independent
    streams for different tuples (numpy's SeedSequence), the same on every machine."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, dtype=np.uint64)[0] >> 1)


def to_pil(image):
    """uint8 (H, W, C) -> a PIL image: RGB, or grayscale ("L") for one channel."""
    return Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)


class InMemoryImages(Dataset):
    """In-memory uint8 images (N, H, W, C) and labels; items are (float tensor (C, H, W), int).

    A key is an index (``transform`` applies, as in the guide) or, from CropFlipSampler, an
    (index, top, left, flip) tuple: the guide's flip and crop with exactly these parameters,
    then normalization. Then no worker process draws random numbers of its own.
    """

    def __init__(self, images, labels, transform, spec=CIFAR100, expected_size=None):
        self.images, self.labels, self.transform, self.spec = images, labels, transform, spec
        self.expected_size = expected_size  # the official split's size, for a warning when it differs
        self.to_tensor = eval_transform(spec)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, top, left, flip = key
            image = crop_flip_pil(to_pil(self.images[index]), top, left, flip, self.spec.padding)
            return self.to_tensor(image), int(self.labels[index])
        return self.transform(to_pil(self.images[key])), int(self.labels[key])


def crop_flip_pil(image, top, left, flip, padding):
    """RandomHorizontalFlip, then RandomCrop(size, padding), with given parameters, on a PIL image."""
    width, height = image.size
    return TF.crop(TF.pad(TF.hflip(image) if flip else image, padding), top, left, height, width)


class CropFlipSampler(Sampler):
    """The indices of ``sampler``, as (index, top, left, flip) keys for InMemoryImages.

    The parameters of every image of the data set are drawn at the start of each epoch in one
    vectorized call, from a generator seeded by (seed, epoch): image i is augmented the same
    in epoch e whichever process or worker loads it and whatever ran before, and persistent
    workers, which never see ``set_epoch``, need no RNG of their own.
    """

    def __init__(self, sampler, size, seed=0, spec=CIFAR100):
        self.sampler, self.size, self.seed, self.spec, self.epoch = sampler, size, seed, spec, 0

    def set_epoch(self, epoch):
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        generator = torch.Generator().manual_seed(derived_seed(self.seed, self.epoch, 0, IMAGE_STREAM))
        offsets, flips = draw_crop_flip(self.size, generator, "cpu", self.spec)  # (size, 2), (size,)
        offsets, flips = offsets.tolist(), flips.tolist()
        return ((index, *offsets[index], flips[index]) for index in self.sampler)

    def __len__(self):
        return len(self.sampler)


# ---------------------------------------------------------------------------------------------
# The device loader: augmentation as batched tensor operations.

def draw_crop_flip(n, generator, device, spec=CIFAR100):
    """Parameters of the guide's RandomHorizontalFlip + RandomCrop(size, padding) for n images:
    offsets int64 (n, 2) = (top, left) in the padded image, uniform over 0..2*padding, and
    flips bool (n,) with probability 0.5 (all False for a data set without flips)."""
    offsets = torch.randint(0, 2 * spec.padding + 1, (n, 2), generator=generator, device=device)
    if not spec.flip:
        return offsets, torch.zeros(n, dtype=torch.bool, device=device)
    flips = torch.randint(0, 2, (n,), generator=generator, device=device).bool()
    return offsets, flips


def crop_flip(images, offsets, flips, padding):
    """Flip, then crop from the zero-padded image, as the guide's transforms do, for a batch.

    images: uint8 (B, H, W, C); offsets, flips: from draw_crop_flip. Returns uint8 (B, H, W, C),
    computed as one gather on the images' device (no loop over images, no host sync).
    """
    b, h, w, _ = images.shape
    padded = F.pad(images, (0, 0, padding, padding, padding, padding))  # (B, H + 2p, W + 2p, C), zeros
    rows = offsets[:, :1] + torch.arange(h, device=images.device)  # (B, H)
    cols = offsets[:, 1:] + torch.arange(w, device=images.device)  # (B, W)
    # Column c of the flipped padded image is column (W + 2p - 1 - c) of the unflipped one.
    cols = torch.where(flips[:, None], w + 2 * padding - 1 - cols, cols)
    batch = torch.arange(b, device=images.device)[:, None, None]
    return padded[batch, rows[:, :, None], cols[:, None, :]]


def normalization_table(mean, std):
    """float32 (256, C): what ToTensor + Normalize make of each uint8 value in each channel,
    computed once on the CPU with their operations (value / 255, - mean, / std). Normalizing by
    lookup in it gives the same bits on every device; computed on a GPU, the division by 255
    becomes a multiplication by 1/255, a bit off for some values."""
    values = torch.arange(256, dtype=torch.float32).div(255)[:, None]  # (256, 1)
    return values.sub(torch.tensor(mean)).div(torch.tensor(std))  # (256, C)


def normalize(images, table):
    """uint8 (B, H, W, C) -> float32 (B, C, H, W), bit for bit what ToTensor + Normalize compute:
    one lookup per value in ``table`` (normalization_table, on the images' device). The result
    is channels-last in memory (the permute is a view), which is the layout the model wants on
    the GPU."""
    channels = torch.arange(images.shape[-1], device=images.device)  # (C,), broadcast against (B, H, W, C)
    return table[images.long(), channels].permute(0, 3, 1, 2)


class DeviceLoader:
    """Batches of (images float32 (B, C, H, W), labels int64 (B,)) cut from a data set that
    lives on ``device`` as uint8. Indices come from ``sampler`` (a DistributedSampler for
    training, so the order and sharding are exactly the torchvision loader's); training
    batches are augmented with parameters drawn once per epoch from a generator seeded by
    (seed, epoch, rank), so batch k of an epoch is the same whether or not batches before it
    were drawn (mid-epoch resume skips them)."""

    num_workers = 0  # for describe_run: no worker processes

    def __init__(self, dataset, batch_size, sampler, device, augment, drop_last, seed=0, rank=0):
        self.dataset, self.batch_size, self.sampler = dataset, batch_size, sampler
        self.device, self.augment, self.drop_last, self.seed, self.rank = device, augment, drop_last, seed, rank
        self.spec = dataset.spec
        self.images = torch.as_tensor(dataset.images).to(device)  # uint8 (N, H, W, C); a view on the CPU
        self.labels = torch.as_tensor(dataset.labels, dtype=torch.int64).to(device)  # (N,)
        self.table = normalization_table(self.spec.mean, self.spec.std).to(device)  # float32 (256, C)

    def __len__(self):
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full + (rest > 0 and not self.drop_last)

    def __iter__(self):
        # One small host-to-device copy per epoch: this rank's indices (N / world_size int64).
        indices = torch.as_tensor(list(self.sampler), dtype=torch.int64).to(self.device)
        if self.augment:
            epoch = getattr(self.sampler, "epoch", 0)
            seed = derived_seed(self.seed, epoch, self.rank, BATCH_STREAM)
            # Drawn on the CPU (a CUDA generator draws other numbers from the same seed) and
            # copied once per epoch (3 x 8 bytes per image): every device serves the same crops,
            # so a run on a GPU repeats a CPU run's data, and a resume may change device type.
            generator = torch.Generator().manual_seed(seed)
            offsets, flips = (t.to(self.device) for t in draw_crop_flip(len(indices), generator, "cpu", self.spec))
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = indices[start:start + self.batch_size]
            images = self.images[batch]  # (B, H, W, C) uint8
            if self.augment:
                images = crop_flip(images, offsets[start:start + self.batch_size], flips[start:start + self.batch_size],
                                   self.spec.padding)
            yield normalize(images, self.table), self.labels[batch]


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


def build_datasets(data_dir=None, download=True, synthetic=False, seed=0, rank=0, spec=CIFAR100):
    """(train_set, test_set) of data set ``spec``, each built once. Global rank 0 fetches
    missing files while the other ranks wait, so the download happens at most once and is
    never raced."""
    if synthetic:
        splits = {split: synthetic_split(split, seed, spec) for split in spec.split_sizes}
    else:
        root = Path(data_dir).expanduser() if data_dir else default_data_dir()
        # Global rank 0 fetches what is missing; the others wait, and get its error if any.
        from_rank0(lambda: prepare(root, spec, download) if rank == 0 else None)
        splits = {split: read_split(root, split, spec) for split in spec.split_sizes}
    return (InMemoryImages(*splits["train"], train_transform(spec), spec, spec.split_sizes["train"]),
            InMemoryImages(*splits["test"], eval_transform(spec), spec, spec.split_sizes["test"]))


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
    """(train_loader, test_loader) over data sets from ``build_datasets``; see load_data."""
    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, not {loader!r}")
    if sampler is None:
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=seed, drop_last=True)
    test_sampler = ShardSampler(len(test_set), rank, world_size)
    if loader == "device":
        device = torch.device(device or "cpu")
        return (DeviceLoader(train_set, batch_size, sampler, device, augment=True, drop_last=True,
                             seed=seed, rank=rank),
                DeviceLoader(test_set, batch_size, test_sampler, device, augment=False, drop_last=False))
    # Workers persist across epochs (no restart cost); CropFlipSampler draws their augmentation.
    common = dict(batch_size=batch_size, num_workers=num_workers, persistent_workers=num_workers > 0,
                  pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
                  worker_init_fn=ignore_ctrl_c if num_workers else None)
    # A private generator for the loader's base seed, so the global RNG (dropout) is not consumed.
    augmented = CropFlipSampler(sampler, len(train_set), seed, train_set.spec)
    return (DataLoader(train_set, sampler=augmented, drop_last=True, generator=torch.Generator().manual_seed(seed),
                       **common),
            DataLoader(test_set, sampler=test_sampler, **common))


def ignore_ctrl_c(worker_id):
    """Loader workers leave Ctrl-C (SIGINT to the terminal's whole process group) to the
    training process, which checkpoints and stops; a worker killed by it would fail the
    next batch instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def set_loader_epoch(loader, epoch):
    """Reshuffle for ``epoch`` (0-based): the same order on every run with the same seed."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Download a data set (if missing) and check that it can be read.")
    parser.add_argument("--dataset", choices=DATASETS, default="cifar100", help="which data set")
    parser.add_argument("--data-dir", default=str(default_data_dir()),
                        help="directory that gets the data set's folder, e.g. cifar-100-python/ or MNIST/raw/ "
                             "(default: datasets/ beside this script)")
    args = parser.parse_args(argv)
    spec = DATASETS[args.dataset]
    try:
        prepare(args.data_dir, spec, download=True)
        sizes = {split: len(read_split(args.data_dir, split, spec)[1]) for split in spec.split_sizes}
    except DatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{spec.title} ready in {Path(args.data_dir) / spec.folder}: "
          f"{sizes['train']} training and {sizes['test']} test images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
