"""The data sets as batches of (images, labels): what each --dataset is, the samplers and the
loaders. How the files of the built-in data sets are fetched and read is in
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
  (engine/device_loader.py). No worker processes, no host-to-device copies and no CPU time
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

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from engine.data_formats import DatasetError  # noqa: F401 (raised by the functions here, part of this module's API)
from engine.data_formats import DATASETS, data_root, default_data_dir, prepare, read_split
from engine.dali_loader import DaliLoader, check_dali, choose_dali, dali_installed
from engine.device_loader import DeviceLoader
from engine.errors import UserError
from engine.flags import FOLDER, MAX_AUTO_WORKERS, OneLineParser, add_data_arguments, check_data_arguments
from engine.image_cache import (MOST_COMMON, SizeRequest, default_cache_dir, fixed_size, prepare_folder,
                                read_folder_cache)
from engine.image_folder import channel_stats
from engine.data_sets import FileImages, InMemoryImages
from engine.image_list import decoded_bytes, prepare_list, read_list
from engine.log import count, flag_value
from engine.plugins import plugin_key
from engine.preprocessing import Preprocessing, trained_preprocessing
from engine.processes import available_cores, from_rank0
from engine.samplers import AugmentSampler, ShardSampler
from engine.stopping import ignore_ctrl_c
from engine.task import DataInfo, data_fingerprint
from engine.splits import check_labels, describe_split, held_out_record, stratified_split
from engine.user_data import read_user_data
from engine.weights import read_weights
import recipe  # noqa: I001 (the user's file, after the engine's)

CIFAR100 = DATASETS["cifar100"]  # the guide's, and the default of every function here
LOADERS = ("device", "torchvision", "dali")


def spec_preprocessing(spec, augment="auto"):
    """A built-in data set's Preprocessing: its shape, normalization, augmentation and padding."""
    return preprocessing(spec.image_shape, spec.mean, spec.std, augment, spec.augment, spec.padding)


def preprocessing(image_shape, mean, std, augment="auto", own_augment="flip-crop", padding=None, stored_size=None):
    """The Preprocessing for --augment: ``own_augment`` and ``padding`` are the data set's own
    (auto); padding defaults to 1/8 of the shorter side (4 pixels for 32x32, as CIFAR's)."""
    if padding is None:
        padding = max(1, round(min(image_shape[:2]) / 8))
    augment = own_augment if augment == "auto" else augment
    return Preprocessing(tuple(image_shape), tuple(mean), tuple(std), augment, recipe.AUGMENTATIONS[augment], padding,
                         stored_size and tuple(stored_size), recipe.RANDOM_PER_OP)


def synthetic_split(split, seed=0, spec=CIFAR100):
    """Random images and labels of the data set's shape and size; the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 2 + (split == "test"))
    n = spec.split_sizes[split]
    images = torch.randint(0, 256, (n, *spec.image_shape), dtype=torch.uint8, generator=generator)
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
        root = data_root(Path(data_dir).expanduser() if data_dir else default_data_dir(), spec)
        # Global rank 0 fetches what is missing; the others wait, and get its error if any.
        from_rank0(lambda: prepare(root, spec, download) if rank == 0 else None, group, patient=True)
        splits = {split: read_split(root, split, spec) for split in spec.split_sizes}
    prep = spec_preprocessing(spec, augment)
    return InMemoryImages(*splits["train"], prep), InMemoryImages(*splits["test"], prep)


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
        common = dict(device=torch.device(device or "cpu"), rank=rank, world_size=world_size, seed=seed,
                      threads=max(1, num_workers))
        return (DaliLoader(train_set, batch_size, recipe.dali_images, augmented=True, **common),
                DaliLoader(test_set, batch_size, recipe.dali_images, augmented=False, **common))
    if sampler is None:
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=seed, drop_last=True)
    test_sampler = ShardSampler(len(test_set), rank, world_size)
    if loader == "device":
        device = torch.device(device or "cpu")
        return (DeviceLoader(train_set, batch_size, sampler, device, augmented=True, drop_last=True, seed=seed),
                DeviceLoader(test_set, batch_size, test_sampler, device, augmented=False, drop_last=False))
    # Workers persist across epochs (no restart cost); AugmentSampler hands them each image's seed.
    common = dict(batch_size=batch_size, num_workers=num_workers, persistent_workers=num_workers > 0,
                  pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
                  worker_init_fn=ignore_ctrl_c if num_workers else None)
    train_set = train_set.with_transform(recipe.loader_transforms(train_set.prep))
    # A private generator for the loader's base seed, so the global RNG (dropout) is not consumed.
    return (DataLoader(train_set, sampler=AugmentSampler(sampler, len(train_set), seed), drop_last=True,
                       generator=torch.Generator().manual_seed(seed), **common),
            DataLoader(test_set, sampler=test_sampler, **common))


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


def transform_names(transforms):
    """"recipe.py's per-image ColorJitter, TrivialAugmentWide" for a v2.Compose of them."""
    return f"recipe.py's per-image {', '.join(type(t).__name__ for t in transforms.transforms)}"


def set_loader_epoch(loader, epoch):
    """Reshuffle for ``epoch`` (0-based): the same order on every run with the same seed. The
    DataLoader's and the device loader's samplers take the epoch, a DaliLoader itself."""
    sampler = loader if hasattr(loader, "set_epoch") else getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


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
    if args.eval_only:
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
        split = stratified_split(train.labels, args.val_fraction, args.seed)
        unused = (f"; its {len(test)} test images are not used" if test is not None else "")
        record = held_out_record(args.val_fraction, args.seed, train.labels, info.skipped)
        train, test = train.subset(split.train), train.subset(split.val)
        info = replace(info, notes=(*info.notes, describe_split(split, args.val_fraction, args.seed,
                                                                 len(info.classes)) + unused), split=record)
    elif test is None:
        raise UserError(f"--dataset {args.dataset} has no test split: hold out part of the training images for "
                        "validation with --val-fraction 0.2 (20% of each class)")
    return train, test, info


def as_trained(train, test, info, weights):
    """--eval-only: the images normalized as the --weights file's training normalized its own
    (engine/flags.py took --image-size and --augment from the file); the start-up block says so."""
    prep, note = trained_preprocessing(info.prep, read_weights(weights, mmap=True).metadata, weights)
    if note is None:  # a plain state_dict: the data's own normalization
        return train, test, info
    return (train.with_prep(prep), test.with_prep(prep) if test is not None else None,
            replace(info, prep=prep, notes=(*info.notes, note)))


def builtin_data(args, ctx):
    spec = DATASETS[args.dataset]
    train, test = build_datasets(args.data_dir, args.download, args.synthetic, args.seed, ctx.rank, spec,
                                 args.augment, ctx.control_group)
    source = ("SYNTHETIC random images and labels: accuracy is meaningless" if args.synthetic
              else f"{spec.title} from {args.data_dir or 'datasets/ beside the scripts'}")
    classes = tuple(str(label) for label in range(spec.num_classes))
    return train, test, DataInfo(spec.name, spec.title, source, classes, train.prep,
                                 data_fingerprint(spec.name, args.synthetic, train.labels, len(test)),
                                 spec.split_sizes, read_sizes={"train": len(train), "test": len(test)})


def folder_size(augment, image_size):
    """The image_cache.SizeRequest of --augment and --image-size: the training images' most
    common size, or --image-size (8/7 of it for resized-crop); with --augment auto that
    depends on whether the images are photos, which the cache's header pass finds out."""
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
    return prepare_folder(args.data_dir, Path(args.cache_dir) if args.cache_dir else default_cache_dir(),
                          folder_size(args.augment, args.image_size), log, held_out=bool(args.val_fraction))


def folder_data(args, ctx):
    """The image folder, decoded into its cache by global rank 0 (the others wait), then
    memory-mapped by every rank. With resized-crop the cache keeps the images at 8/7 of the
    training size (recipe.stored_size); --augment auto looks at the images' own size."""
    target = from_rank0(lambda: str(prepare_folder_cache(args)), ctx.control_group, patient=True)
    folder = read_folder_cache(Path(target))
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
    shown = ", ".join(folder.classes[:8]) + (", ..." if len(folder.classes) > 8 else "")
    source = f"the image folder {args.data_dir} ({count(len(folder.classes), 'class', 'classes')}: {shown}){how}"
    return DataInfo(FOLDER, f"image folder {args.data_dir}", source, folder.classes, prep,
                    data_fingerprint(FOLDER, False, train_labels, test_size, folder.classes, prep.image_shape),
                    notes=notes, data_dir=str(Path(args.data_dir).expanduser().resolve()),
                    skipped=folder.skipped.get("train", ()))


def folder_list_data(args, ctx):
    """The image folder for --loader dali: checked and listed by global rank 0 (the others wait),
    its files decoded by DALI every epoch; sizes and augmentation chosen as folder_data's."""
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
    image folder, or with recipe.py's per-image transforms ``per_image``, a v2.Compose that runs
    in the DataLoader's workers), or auto for an image folder on a GPU with DALI installed that
    would not fit the device (choose_dali; global rank 0 reads the folder's headers, the others
    wait)."""
    if args.loader == "dali":
        if args.dataset != FOLDER:
            raise UserError(f"--loader dali reads image files: it takes --dataset {FOLDER}, not {args.dataset} "
                            "(use --loader device or torchvision)")
        if per_image:
            raise UserError(f"{transform_names(per_image)} transforms each image in the DataLoader's workers, which "
                            "DALI has no operator for: use --loader torchvision (or auto) with it, not dali")
        check_dali()
        return "dali", "--loader dali"
    if (args.loader != "auto" or args.dataset != FOLDER or device.type != "cuda" or per_image
            or not dali_installed()):
        return None, None
    request = folder_size(args.augment, args.image_size)
    decoded = from_rank0(lambda: decoded_bytes(args.data_dir, bool(args.val_fraction), request), group, patient=True)
    use, why = choose_dali(decoded, torch.cuda.mem_get_info(device)[1])
    return ("dali" if use else None), why


def plugin_data(args):
    """NAME(data_dir) of --dataset FILE.py:NAME, read whole into memory."""
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
                                                  prep.image_shape))


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
        spec = DATASETS[args.dataset]
        data_dir = data_root(Path(args.data_dir or default_data_dir()), spec)
        prepare(data_dir, spec, download=True)
        sizes = {split: len(read_split(data_dir, split, spec)[1]) for split in spec.split_sizes}
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # a download or a decode in progress leaves no partial files behind
        print("Interrupted (Ctrl-C): no partial files were kept", file=sys.stderr)
        return 130
    print(f"{spec.title} ready in {data_dir / spec.folder}: {sizes['train']} training and {sizes['test']} test images")
    return 0


def list_image_folder(args):
    """``python dataset_utils.py --dataset folder --data-dir DIR --loader dali``: the list train.py
    --loader dali with the same --data-dir and --cache-dir reuses, made ahead of a job."""
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
    target = prepare_folder_cache(args)
    data = read_folder_cache(target)
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
