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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms as transforms
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from data_formats import DatasetError  # noqa: F401 (raised by the functions here, part of this module's API)
from data_formats import DATASETS, data_root, default_data_dir, describe_augmentation, prepare, read_split
from device_utils import UserError, from_rank0

CIFAR100 = DATASETS["cifar100"]  # the guide's, and the default of every function here
LOADERS = ("device", "torchvision")
# Seeds: dropout (seed, epoch, rank) in train_utils.epoch_seed; device-loader augmentation
# (seed, epoch, rank, BATCH_STREAM); torchvision-loader augmentation (seed, epoch, 0,
# IMAGE_STREAM), the same on every rank. The non-zero last entries keep the three apart
# (SeedSequence ignores trailing zeros).
BATCH_STREAM, IMAGE_STREAM = 1, 2


@dataclass(frozen=True)
class Preprocessing:
    """How stored images become the model's input. A DataSpec has the same fields, so the
    functions here take either."""
    image_shape: tuple  # (H, W, C) of the stored images
    mean: tuple         # per channel: of the pixels scaled to 0..1 (uint8 images), or as stored (float)
    std: tuple
    padding: int = 0    # zero padding (pixels) around a training image before its random crop (0: no crop)
    flip: bool = False  # random horizontal flips of training images

    def augmentation(self):
        return describe_augmentation(self.image_shape, self.padding, self.flip, self.mean, self.std)


def preprocessing(image_shape, mean, std, augment="auto", padding=None, flip=True):
    """The Preprocessing for --augment. ``padding`` and ``flip`` are the data set's own (auto);
    padding defaults to 1/8 of the shorter side (4 pixels for 32x32, as CIFAR's). flip-crop
    and crop keep that padding with and without flips; none neither crops nor flips."""
    if padding is None:
        padding = max(1, round(min(image_shape[:2]) / 8))
    if augment == "flip-crop":
        flip = True
    elif augment == "crop":
        flip = False
    elif augment == "none":
        padding, flip = 0, False
    return Preprocessing(tuple(image_shape), tuple(mean), tuple(std), padding, flip)


def per_process_batch(global_batch, world_size):
    """Images per process per step; refuses to silently drop part of the global batch."""
    if global_batch % world_size:
        lower, upper = global_batch // world_size * world_size, -(-global_batch // world_size) * world_size
        examples = f"{lower} or {upper}" if lower else str(upper)
        raise UserError(f"--batch-size {global_batch} does not split evenly over {world_size} processes; "
                        f"use a multiple of {world_size} (e.g. {examples})")
    return global_batch // world_size


def synthetic_split(split, seed=0, spec=CIFAR100):
    """Random images and labels of the data set's shape and size; the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 2 + (split == "test"))
    n = spec.split_sizes[split]
    images = torch.randint(0, 256, (n, *spec.image_shape), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, spec.num_classes, (n,), generator=generator)
    return images.numpy(), labels.numpy()


def train_transform(prep=CIFAR100):
    """The guide's augmentation, per data set: flip (unless digits), crop of the zero-padded
    image, normalize."""
    flip = [transforms.RandomHorizontalFlip()] if prep.flip else []
    return transforms.Compose([*flip, transforms.RandomCrop(prep.image_shape[:2], padding=prep.padding),
                               transforms.ToTensor(), transforms.Normalize(prep.mean, prep.std)])


def eval_transform(prep=CIFAR100):
    """Deterministic: normalize only (the guide evaluated on randomly cropped, flipped images)."""
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(prep.mean, prep.std)])


def derived_seed(*values):
    """A 63-bit seed from integers such as (seed, epoch, rank): statistically independent
    streams for different tuples (numpy's SeedSequence), the same on every machine."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, dtype=np.uint64)[0] >> 1)


def to_pil(image):
    """uint8 (H, W, C) -> a PIL image: RGB, or grayscale ("L") for one channel."""
    return Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)


class InMemoryImages(Dataset):
    """Images (N, H, W, C), uint8 or float32, in memory (or memory-mapped), and labels (N,);
    items are (float tensor (C, H, W), int), prepared as ``prep`` (a Preprocessing) says.

    A key is an index (``transform`` applies to uint8 images, as in the guide) or, from
    CropFlipSampler, an (index, top, left, flip) tuple: the guide's flip and crop with
    exactly these parameters, then normalization. Then no worker process draws random
    numbers of its own. Float images (a FILE.py:NAME data set's) are cropped, flipped and
    normalized by the same tensor operations as on the device loader.
    """

    def __init__(self, images, labels, transform, prep=CIFAR100):
        self.images, self.labels, self.transform, self.prep = images, labels, transform, prep
        self.to_tensor = eval_transform(prep)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, key):
        index, crop = (key[0], key[1:]) if isinstance(key, tuple) else (key, None)
        label = int(self.labels[index])
        if self.images.dtype != np.uint8:
            image = torch.from_numpy(np.asarray(self.images[index], dtype=np.float32))[None]  # (1, H, W, C)
            if crop:
                top, left, flip = crop
                image = crop_flip(image, torch.tensor([[top, left]]), torch.tensor([flip]), self.prep.padding)
            return normalize_float(image, *float_stats(self.prep, image.device))[0], label
        if crop:
            image = crop_flip_pil(to_pil(self.images[index]), *crop, self.prep.padding)
            return self.to_tensor(image), label
        return self.transform(to_pil(self.images[index])), label


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

    def __init__(self, sampler, size, seed=0, prep=CIFAR100):
        self.sampler, self.size, self.seed, self.prep, self.epoch = sampler, size, seed, prep, 0

    def set_epoch(self, epoch):
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        generator = torch.Generator().manual_seed(derived_seed(self.seed, self.epoch, 0, IMAGE_STREAM))
        offsets, flips = draw_crop_flip(self.size, generator, "cpu", self.prep)  # (size, 2), (size,)
        offsets, flips = offsets.tolist(), flips.tolist()
        return ((index, *offsets[index], flips[index]) for index in self.sampler)

    def __len__(self):
        return len(self.sampler)


# ---------------------------------------------------------------------------------------------
# The device loader: augmentation as batched tensor operations.

def draw_crop_flip(n, generator, device, prep=CIFAR100):
    """Parameters of the guide's RandomHorizontalFlip + RandomCrop(size, padding) for n images:
    offsets int64 (n, 2) = (top, left) in the padded image, uniform over 0..2*padding, and
    flips bool (n,) with probability 0.5 (all False for a data set without flips)."""
    offsets = torch.randint(0, 2 * prep.padding + 1, (n, 2), generator=generator, device=device)
    if not prep.flip:
        return offsets, torch.zeros(n, dtype=torch.bool, device=device)
    flips = torch.randint(0, 2, (n,), generator=generator, device=device).bool()
    return offsets, flips


def crop_flip(images, offsets, flips, padding):
    """Flip, then crop from the zero-padded image, as the guide's transforms do, for a batch.

    images: (B, H, W, C), uint8 or float; offsets, flips: from draw_crop_flip. Returns the same type,
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


def float_stats(prep, device):
    """``prep``'s mean and std as float32 (C,) tensors on ``device``."""
    return (torch.tensor(prep.mean, dtype=torch.float32, device=device),
            torch.tensor(prep.std, dtype=torch.float32, device=device))


def normalize_float(images, mean, std):
    """Float images (B, H, W, C) -> float32 (B, C, H, W), (x - mean) / std per channel: the
    normalization of a data set that is float already (no uint8 scale to undo)."""
    return images.float().sub(mean).div(std).permute(0, 3, 1, 2)


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
        self.prep = dataset.prep
        self.augment = augment and bool(self.prep.padding or self.prep.flip)
        self.device, self.drop_last, self.seed, self.rank = device, drop_last, seed, rank
        self.images = torch.as_tensor(dataset.images).to(device)  # uint8 (N, H, W, C); a view on the CPU
        self.labels = torch.as_tensor(dataset.labels, dtype=torch.int64).to(device)  # (N,)
        if self.images.dtype == torch.uint8:
            table = normalization_table(self.prep.mean, self.prep.std).to(device)  # float32 (256, C)
            self.normalize = lambda images: normalize(images, table)
        else:  # float images: no lookup table
            stats = float_stats(self.prep, device)
            self.normalize = lambda images: normalize_float(images, *stats)

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
            offsets, flips = (t.to(self.device) for t in draw_crop_flip(len(indices), generator, "cpu", self.prep))
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            batch = indices[start:start + self.batch_size]
            images = self.images[batch]  # (B, H, W, C) uint8
            if self.augment:
                images = crop_flip(images, offsets[start:start + self.batch_size], flips[start:start + self.batch_size],
                                   self.prep.padding)
            yield self.normalize(images), self.labels[batch]


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


def build_datasets(data_dir=None, download=True, synthetic=False, seed=0, rank=0, spec=CIFAR100, augment="auto",
                   group=None):
    """(train_set, test_set) of data set ``spec``, each built once, augmented as --augment
    says. Global rank 0 fetches missing files while the other ranks wait (in ``group``: the
    gloo control group, so the wait is not an NCCL collective), so the download happens at
    most once and is never raced."""
    if synthetic:
        splits = {split: synthetic_split(split, seed, spec) for split in spec.split_sizes}
    else:
        root = data_root(Path(data_dir).expanduser() if data_dir else default_data_dir(), spec)
        # Global rank 0 fetches what is missing; the others wait, and get its error if any.
        from_rank0(lambda: prepare(root, spec, download) if rank == 0 else None, group, patient=True)
        splits = {split: read_split(root, split, spec) for split in spec.split_sizes}
    prep = preprocessing(spec.image_shape, spec.mean, spec.std, augment, spec.padding, spec.flip)
    return (InMemoryImages(*splits["train"], train_transform(prep), prep),
            InMemoryImages(*splits["test"], eval_transform(prep), prep))


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
    augmented = CropFlipSampler(sampler, len(train_set), seed, train_set.prep)
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
    parser = argparse.ArgumentParser(description="Download a data set (if missing) and check that it can be read; "
                                                 "decode an image folder into its cache; or write a small demo copy "
                                                 "of a data set (--write-demo).")
    parser.add_argument("--dataset", choices=(*DATASETS, "folder"), default="cifar100", help="which data set")
    parser.add_argument("--data-dir", default=None,
                        help="directory that gets the data set's folder, e.g. cifar-100-python/ or MNIST/raw/ "
                             "(default: datasets/ beside this script); for folder: the folder of train/ and test/")
    parser.add_argument("--image-size", metavar="PIXELS", default=None,
                        help="folder: resize to N or HxW pixels, as train.py's --image-size")
    parser.add_argument("--cache-dir", metavar="DIR", default=None,
                        help="folder: where the decoded images go, as train.py's --cache-dir")
    parser.add_argument("--write-demo", metavar="DIR", default=None,
                        help="write a small learnable copy of --dataset into DIR instead (each class a colour plus "
                             "noise): 512 training and 128 test images of 10 classes in the data set's format, or "
                             "for folder an image folder of 4 classes with PNG and JPEG, RGB and gray images of two "
                             "sizes; DIR must not hold that data set already")
    args = parser.parse_args(argv)
    if args.write_demo:
        return write_demo(Path(args.write_demo), args.dataset)
    try:
        if args.dataset == "folder":
            return prepare_image_folder(parser, args)
        spec = DATASETS[args.dataset]
        data_dir = data_root(Path(args.data_dir or default_data_dir()), spec)
        prepare(data_dir, spec, download=True)
        sizes = {split: len(read_split(data_dir, split, spec)[1]) for split in spec.split_sizes}
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a download or a decode in progress leaves no partial files behind
        print("Interrupted (Ctrl-C): no partial files were kept", file=sys.stderr)
        return 130
    print(f"{spec.title} ready in {data_dir / spec.folder}: {sizes['train']} training and {sizes['test']} test images")
    return 0


def prepare_image_folder(parser, args):
    """``python dataset_utils.py --dataset folder --data-dir DIR``: build the cache ahead of a
    job (on a login node, so that no allocation waits for it)."""
    import image_folder
    from flags import image_size

    if not args.data_dir:
        parser.error("--dataset folder needs --data-dir DIR, the folder holding train/CLASS/IMAGE and test/CLASS/IMAGE")
    try:
        size = image_size(args.image_size) if args.image_size else None
    except argparse.ArgumentTypeError as err:
        parser.error(f"--image-size: {err}")
    target = image_folder.prepare_folder(args.data_dir, args.cache_dir or image_folder.default_cache_dir(), size)
    data = image_folder.read_folder_cache(target)
    print(f"Image folder {args.data_dir} ready in {target}: {len(data.train[1])} training and {len(data.test[1])} "
          f"test images of {len(data.classes)} classes")
    return 0


def write_demo(root, dataset):
    """``python dataset_utils.py --write-demo DIR``: never writes over an existing copy."""
    import demo_data

    target = root / ("train" if dataset == "folder" else DATASETS[dataset].folder)
    if target.exists():
        print(f"error: {target} exists already; give --write-demo another folder", file=sys.stderr)
        return 2
    if dataset == "folder":
        demo_data.write_image_folder(root, classes=4, n_train=64, n_test=16)
        print(f"Wrote an image folder of 4 classes (64 training and 16 test images each; PNG and JPEG, RGB and "
              f"gray, 32x32 and 40x48) into {root}: train with --dataset folder --data-dir {root}")
    else:
        demo_data.write_dataset(root, dataset, learnable=True, n_train=512, n_test=128)
        print(f"Wrote a learnable 10-class copy of {DATASETS[dataset].title} (512 training and 128 test images) "
              f"into {root}: train with --dataset {dataset} --data-dir {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
