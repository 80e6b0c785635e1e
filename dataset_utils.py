"""CIFAR-100: fetch it once, read it safely, serve it as batches of (images, labels).

Compute nodes often have no internet, so fetch the data ahead of time on a login node:

    python dataset_utils.py --data-dir ./datasets

The training scripts download only when the data is missing, and then only global rank 0
downloads while the other ranks wait. Files are read from CIFAR-100's own on-disk format
(``cifar-100-python/{train,test,meta}``, Python pickles) by this module, which checks their
shape and size and names the file when one is truncated or corrupted.

Two loaders serve the same batches of (float32 images (B, 3, 32, 32), int64 labels (B,)):

- ``device`` (the training scripts' default): the whole data set is copied to the device
  once as uint8 (150 MB for the training set); each batch is a gather plus random crop,
  flip and normalization as batched tensor operations there. No worker processes, no
  host-to-device copies and no CPU time per image.
- ``torchvision``: the guide's DataLoader of PIL transforms, for data that does not fit on
  the device or for comparison; with ``num_workers`` persistent worker processes.

Both shuffle exactly as ``DistributedSampler`` does (by seed and epoch, sharded by rank),
and both draw their augmentation from generators seeded by (seed, epoch, rank) or (seed,
epoch), never from what ran before: a resumed run augments identically.
"""

import argparse
import os
import pickle
import signal
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms as transforms
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from device_utils import UserError, from_rank0

DATA_NAME = "CIFAR-100"
NUM_CLASSES = 100
IMAGE_SHAPE = (32, 32, 3)  # H, W, C as stored: uint8 RGB
SPLIT_SIZES = {"train": 50_000, "test": 10_000}
CIFAR100_MEAN = (0.5071, 0.4867, 0.4408)
CIFAR100_STD = (0.2675, 0.2565, 0.2761)
PADDING = 4  # pixels of zero padding around the image before the random 32x32 crop
LOADERS = ("device", "torchvision")
# Seeds: dropout (seed, epoch, rank) in train_utils.epoch_seed; device-loader augmentation
# (seed, epoch, rank, BATCH_STREAM); torchvision-loader augmentation (seed, epoch, 0,
# IMAGE_STREAM), the same on every rank. The non-zero last entries keep the three apart
# (SeedSequence ignores trailing zeros).
BATCH_STREAM, IMAGE_STREAM = 1, 2
FOLDER = "cifar-100-python"  # what the official archive unpacks to
FILES = ("train", "test", "meta")


class DatasetError(UserError):
    """Data missing, not downloadable, truncated or corrupted."""


def default_data_dir() -> Path:
    """``datasets/`` beside the scripts, as in the guide."""
    return Path(__file__).resolve().parent / "datasets"


def fetch_hint(root) -> str:
    return f"python dataset_utils.py --data-dir {root}"


def missing_files(root) -> list:
    return [name for name in FILES if not (Path(root) / FOLDER / name).is_file()]


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
    """Make sure the files are in ``root``, downloading them if allowed. One line on failure,
    naming what is missing; a failed download leaves nothing behind that was not there."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise DatasetError(f"--data-dir {root} is a file, not a directory")
    missing = missing_files(root)
    if not missing:
        return
    what = (f"CIFAR-100 not found in {root / FOLDER}" if len(missing) == len(FILES)
            else f"CIFAR-100 in {root / FOLDER} is incomplete: {', '.join(missing)} missing")
    if not download:
        raise DatasetError(f"{what}; fetch it first with: {fetch_hint(root)}")
    before = _new_paths(root)
    try:
        download_cifar100(root)
    except (OSError, RuntimeError, tarfile.TarError, EOFError) as err:
        _remove_new(before)
        reason = " ".join(str(err).split()) or type(err).__name__
        raise DatasetError(f"{what} and downloading it failed ({reason}); on a machine with internet (e.g. a "
                           f"login node) run: {fetch_hint(root)}") from None


def _new_paths(root):
    """What a download into ``root`` may create that does not exist yet, deepest first."""
    from torchvision.datasets import CIFAR100

    root = root.absolute()
    folders = [p for p in (root / FOLDER, root, *root.parents) if not p.exists()]
    archive = root / CIFAR100.filename
    return ([archive] if not archive.exists() else []) + folders


def _remove_new(paths):
    """Undo a failed download: its partial archive and the folders it made, when empty."""
    for path in paths:
        try:
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass  # not empty: something else is in there now; keep it


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


def derived_seed(*values):
    """A 63-bit seed from integers such as (seed, epoch, rank): statistically independent
    streams for different tuples (numpy's SeedSequence), the same on every machine."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, dtype=np.uint64)[0] >> 1)


class CIFAR100Images(Dataset):
    """In-memory uint8 images (N, 32, 32, 3) and labels; items are (float tensor (3, 32, 32), int).

    A key is an index (``transform`` applies, as in the guide) or, from CropFlipSampler, an
    (index, top, left, flip) tuple: the guide's flip and crop with exactly these parameters,
    then normalization. Then no worker process draws random numbers of its own.
    """

    def __init__(self, images, labels, transform, expected_size=None):
        self.images, self.labels, self.transform = images, labels, transform
        self.expected_size = expected_size  # the official split's size, for a warning when it differs
        self.to_tensor = eval_transform()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, key):
        if isinstance(key, tuple):
            index, top, left, flip = key
            image = crop_flip_pil(Image.fromarray(self.images[index]), top, left, flip)
            return self.to_tensor(image), int(self.labels[index])
        return self.transform(Image.fromarray(self.images[key])), int(self.labels[key])


def crop_flip_pil(image, top, left, flip, padding=PADDING):
    """RandomHorizontalFlip, then RandomCrop(32, padding), with given parameters, on a PIL image."""
    width, height = image.size
    return TF.crop(TF.pad(TF.hflip(image) if flip else image, padding), top, left, height, width)


class CropFlipSampler(Sampler):
    """The indices of ``sampler``, as (index, top, left, flip) keys for CIFAR100Images.

    The parameters of every image of the data set are drawn at the start of each epoch in one
    vectorized call, from a generator seeded by (seed, epoch): image i is augmented the same
    in epoch e whichever process or worker loads it and whatever ran before, and persistent
    workers, which never see ``set_epoch``, need no RNG of their own.
    """

    def __init__(self, sampler, size, seed=0):
        self.sampler, self.size, self.seed, self.epoch = sampler, size, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        generator = torch.Generator().manual_seed(derived_seed(self.seed, self.epoch, 0, IMAGE_STREAM))
        offsets, flips = draw_crop_flip(self.size, generator, "cpu")  # (size, 2), (size,)
        offsets, flips = offsets.tolist(), flips.tolist()
        return ((index, *offsets[index], flips[index]) for index in self.sampler)

    def __len__(self):
        return len(self.sampler)


# ---------------------------------------------------------------------------------------------
# The device loader: augmentation as batched tensor operations.

def draw_crop_flip(n, generator, device, padding=PADDING):
    """Parameters of the guide's RandomHorizontalFlip + RandomCrop(32, padding) for n images:
    offsets int64 (n, 2) = (top, left) in the padded image, uniform over 0..2*padding, and
    flips bool (n,) with probability 0.5."""
    offsets = torch.randint(0, 2 * padding + 1, (n, 2), generator=generator, device=device)
    flips = torch.randint(0, 2, (n,), generator=generator, device=device).bool()
    return offsets, flips


def crop_flip(images, offsets, flips, padding=PADDING):
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


def normalization_table(mean=CIFAR100_MEAN, std=CIFAR100_STD):
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
    """Batches of (images float32 (B, 3, 32, 32), labels int64 (B,)) cut from a data set that
    lives on ``device`` as uint8. Indices come from ``sampler`` (a DistributedSampler for
    training, so the order and sharding are exactly the torchvision loader's); training
    batches are augmented with parameters drawn once per epoch from a generator seeded by
    (seed, epoch, rank), so batch k of an epoch is the same whether or not batches before it
    were drawn (mid-epoch resume skips them)."""

    num_workers = 0  # for describe_run: no worker processes

    def __init__(self, dataset, batch_size, sampler, device, augment, drop_last, seed=0, rank=0):
        self.dataset, self.batch_size, self.sampler = dataset, batch_size, sampler
        self.device, self.augment, self.drop_last, self.seed, self.rank = device, augment, drop_last, seed, rank
        self.images = torch.as_tensor(dataset.images).to(device)  # uint8 (N, 32, 32, 3); a view on the CPU
        self.labels = torch.as_tensor(dataset.labels, dtype=torch.int64).to(device)  # (N,)
        self.table = normalization_table().to(device)  # float32 (256, 3)

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
            offsets, flips = (t.to(self.device) for t in draw_crop_flip(len(indices), generator, "cpu"))
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = indices[start:start + self.batch_size]
            images = self.images[batch]  # (B, 32, 32, 3) uint8
            if self.augment:
                images = crop_flip(images, offsets[start:start + self.batch_size], flips[start:start + self.batch_size])
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


def build_datasets(data_dir=None, download=True, synthetic=False, seed=0, rank=0):
    """(train_set, test_set), each built once. Global rank 0 fetches missing files while the
    other ranks wait, so the download happens at most once and is never raced."""
    if synthetic:
        splits = {split: synthetic_split(split, seed) for split in SPLIT_SIZES}
    else:
        root = Path(data_dir).expanduser() if data_dir else default_data_dir()
        # Global rank 0 fetches what is missing; the others wait, and get its error if any.
        from_rank0(lambda: prepare_cifar100(root, download) if rank == 0 else None)
        splits = {split: read_split(root, split) for split in SPLIT_SIZES}
    return (CIFAR100Images(*splits["train"], train_transform(), SPLIT_SIZES["train"]),
            CIFAR100Images(*splits["test"], eval_transform(), SPLIT_SIZES["test"]))


def load_cifar100(batch_size, num_workers=0, sampler=None, data_dir=None, *, loader="torchvision", device=None,
                  rank=0, world_size=1, seed=0, download=True, synthetic=False, pin_memory=None):
    """(train_loader, test_loader), as in the guide; ``batch_size`` is per process.

    ``loader``: "torchvision" (the guide's DataLoader, the default of this function) or
    "device" (data set and augmentation on ``device``, the training scripts' default).
    Training: shuffled by a DistributedSampler seeded by (seed, epoch) and sharded by rank
    (with one rank it is a seeded shuffle), incomplete last batches dropped so every rank
    runs the same number of steps. Call ``set_loader_epoch`` before each epoch.
    Evaluation: every test image exactly once across ranks, in order, no augmentation.
    """
    train_set, test_set = build_datasets(data_dir, download, synthetic, seed, rank)
    return build_loaders(train_set, test_set, batch_size, loader=loader, num_workers=num_workers,
                         sampler=sampler, device=device, rank=rank, world_size=world_size, seed=seed,
                         pin_memory=pin_memory)


def build_loaders(train_set, test_set, batch_size, *, loader="torchvision", num_workers=0, sampler=None,
                  device=None, rank=0, world_size=1, seed=0, pin_memory=None):
    """(train_loader, test_loader) over data sets from ``build_datasets``; see load_cifar100."""
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
    return (DataLoader(train_set, sampler=CropFlipSampler(sampler, len(train_set), seed), drop_last=True,
                       generator=torch.Generator().manual_seed(seed), **common),
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
