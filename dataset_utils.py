"""CIFAR-100: fetch it once, read it safely, serve it as batches of (images, labels).

Compute nodes often have no internet, so fetch the data ahead of time on a login node:

    python dataset_utils.py --data-dir ./datasets

The training scripts download only when the data is missing, and then only global rank 0
downloads while the other ranks wait. Files are read from CIFAR-100's own on-disk format
(``cifar-100-python/{train,test,meta}``, Python pickles) by this module, which checks their
shape and size and names the file when one is truncated or corrupted.
"""

import argparse
import os
import pickle
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms as transforms
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from device_utils import UserError, broadcast_from_rank0

NUM_CLASSES = 100
IMAGE_SHAPE = (32, 32, 3)  # H, W, C as stored: uint8 RGB
SPLIT_SIZES = {"train": 50_000, "test": 10_000}
CIFAR100_MEAN = (0.5071, 0.4867, 0.4408)
CIFAR100_STD = (0.2675, 0.2565, 0.2761)
FOLDER = "cifar-100-python"  # what the official archive unpacks to
FILES = ("train", "test", "meta")


class DatasetError(UserError):
    """Data missing, not downloadable, truncated or corrupted."""


def default_data_dir() -> Path:
    """``datasets/`` beside the scripts, as in the guide."""
    return Path(__file__).resolve().parent / "datasets"


def fetch_hint(root) -> str:
    return f"python dataset_utils.py --data-dir {root}"


def is_downloaded(root) -> bool:
    return all((Path(root) / FOLDER / name).is_file() for name in FILES)


def download_cifar100(root):
    """Download the official archive (md5-checked by torchvision) and unpack it.

    The archive is unpacked into a temporary folder beside the data and moved into place
    file by file, so an interrupted run never leaves a folder that looks complete, and
    files already present are never overwritten.
    """
    from torchvision.datasets import CIFAR100
    from torchvision.datasets.utils import download_url

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    download_url(CIFAR100.url, str(root), CIFAR100.filename, CIFAR100.tgz_md5)
    target = root / FOLDER
    target.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".unpack-") as tmp:
        with tarfile.open(root / CIFAR100.filename, "r:gz") as archive:
            # filter="data" refuses links and paths outside tmp (Python >= 3.11.4 / 3.12).
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(tmp, **safe)
        for name in FILES:
            if not (target / name).exists():
                os.replace(Path(tmp) / FOLDER / name, target / name)


def prepare_cifar100(root, download=True):
    """Make sure the files are in ``root``, downloading them if allowed. One line on failure."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise DatasetError(f"--data-dir {root} is a file, not a directory")
    if is_downloaded(root):
        return
    if not download:
        raise DatasetError(f"CIFAR-100 not found in {root / FOLDER}; fetch it first with: {fetch_hint(root)}")
    try:
        download_cifar100(root)
    except (OSError, RuntimeError, tarfile.TarError, EOFError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise DatasetError(
            f"CIFAR-100 is not in {root / FOLDER} and downloading it failed ({reason}); "
            f"on a machine with internet (e.g. a login node) run: {fetch_hint(root)}") from None


def read_split(root, split):
    """Read one split: (images uint8 array (N, 32, 32, 3), labels int64 array (N,))."""
    path = Path(root) / FOLDER / split
    corrupted = f"delete it and fetch again with: {fetch_hint(root)}"
    try:
        with open(path, "rb") as f:
            # latin1: the files are Python 2 pickles (as torchvision reads them).
            entry = pickle.load(f, encoding="latin1")
        data = np.asarray(entry["data"])
        labels = np.asarray(entry["fine_labels"], dtype=np.int64)
    except FileNotFoundError:
        raise DatasetError(f"{path} is missing; {corrupted}", same_on_every_rank=False) from None
    except Exception as err:  # a damaged pickle can raise almost anything
        raise DatasetError(f"{path} is truncated or corrupted ({type(err).__name__}: {err}); {corrupted}",
                           same_on_every_rank=False) from None
    pixels = int(np.prod(IMAGE_SHAPE))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != pixels or len(labels) != len(data):
        raise DatasetError(f"{path} is corrupted: expected uint8 data of shape (N, {pixels}) with N labels, "
                           f"found {data.dtype} {data.shape} with {len(labels)} labels; {corrupted}",
                           same_on_every_rank=False)
    if len(labels) and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise DatasetError(f"{path} is corrupted: labels outside 0..{NUM_CLASSES - 1}; {corrupted}",
                           same_on_every_rank=False)
    # Stored channel-first per image (R plane, G plane, B plane); PIL wants (H, W, C).
    images = data.reshape(-1, IMAGE_SHAPE[2], *IMAGE_SHAPE[:2]).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def synthetic_split(split, seed=0):
    """Random images and labels of CIFAR-100's shape and size; the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 2 + (split == "test"))
    n = SPLIT_SIZES[split]
    images = torch.randint(0, 256, (n, *IMAGE_SHAPE), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return images.numpy(), labels.numpy()


def train_transform():
    """The guide's augmentation: flip, 32x32 crop of the 4-pixel zero-padded image, normalize."""
    return transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.RandomCrop(32, padding=4),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR100_MEAN, CIFAR100_STD),
    ])


def eval_transform():
    """Deterministic: normalize only (the guide evaluated on randomly cropped, flipped images)."""
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR100_MEAN, CIFAR100_STD)])


class CIFAR100Images(Dataset):
    """In-memory uint8 images (N, 32, 32, 3) and labels; items are (float tensor (3, 32, 32), int)."""

    def __init__(self, images, labels, transform):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.transform(Image.fromarray(self.images[index])), int(self.labels[index])


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


def build_datasets(data_dir=None, download=True, synthetic=False, seed=0, rank=0):
    """(train_set, test_set), each built once. Global rank 0 fetches missing files while the
    other ranks wait, so the download happens at most once and is never raced."""
    if synthetic:
        splits = {split: synthetic_split(split, seed) for split in SPLIT_SIZES}
    else:
        root = Path(data_dir).expanduser() if data_dir else default_data_dir()
        failure = None
        if rank == 0:
            try:
                prepare_cifar100(root, download)
            except DatasetError as err:
                failure = str(err)
        failure = broadcast_from_rank0(failure)
        if failure:
            raise DatasetError(failure)
        splits = {split: read_split(root, split) for split in SPLIT_SIZES}
    return (CIFAR100Images(*splits["train"], train_transform()),
            CIFAR100Images(*splits["test"], eval_transform()))


def load_cifar100(batch_size, num_workers=0, sampler=None, data_dir=None, *, rank=0, world_size=1,
                  seed=0, download=True, synthetic=False, pin_memory=None):
    """(train_loader, test_loader), as in the guide; ``batch_size`` is per process.

    Training: shuffled by a DistributedSampler seeded by (seed, epoch) and sharded by rank
    (with one rank it is a seeded shuffle), incomplete last batches dropped so every rank
    runs the same number of steps. Call ``set_loader_epoch`` before each epoch.
    Evaluation: every test image exactly once across ranks, in order, no augmentation.
    """
    train_set, test_set = build_datasets(data_dir, download, synthetic, seed, rank)
    if sampler is None:
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=seed, drop_last=True)
    # Workers are started anew each epoch (not persistent): they take their seeds from the
    # global RNG, which the loop reseeds per epoch, so a resumed run augments identically.
    common = dict(batch_size=batch_size, num_workers=num_workers,
                  pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)
    train_loader = DataLoader(train_set, sampler=sampler, drop_last=True, **common)
    test_loader = DataLoader(test_set, sampler=ShardSampler(len(test_set), rank, world_size), **common)
    return train_loader, test_loader


def set_loader_epoch(loader, epoch):
    """Reshuffle for ``epoch`` (0-based): the same order on every run with the same seed."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Download CIFAR-100 and check it can be read.")
    parser.add_argument("--data-dir", default=str(default_data_dir()),
                        help="directory that gets cifar-100-python/ (default: datasets/ beside this script)")
    args = parser.parse_args(argv)
    try:
        prepare_cifar100(args.data_dir, download=True)
        sizes = {split: len(read_split(args.data_dir, split)[1]) for split in SPLIT_SIZES}
    except DatasetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"CIFAR-100 ready in {Path(args.data_dir) / FOLDER}: "
          f"{sizes['train']} training and {sizes['test']} test images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
