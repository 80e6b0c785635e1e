"""Where the engine meets the model and the data, as pytorch/examples' ``load_train_objs`` and
torchtitan's TrainSpec do: a ``Task`` is what train_utils.fit trains, and the loop,
checkpoints and logging use nothing else of the model or the data. train_utils.build_task
makes one from --model and --dataset; what each built-in --dataset is (its shape, classes,
normalization and files) is ``DATASETS``, read from disk by engine/data_formats.py.

Then the labels: checked against the classes, for every kind of data set, and split by
--val-fraction, a validation set held out of the training images for data that comes without a
test split (an image folder of train/ alone, a FILE.py:NAME set). The split is stratified (each
class gives the same fraction) and a pure function of the labels, the fraction and --seed: the
same on every rank, and the same after a resume, which keeps both flags (a resume with others is
refused).
"""

import hashlib
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from engine.errors import UserError

# In the metadata a weights file or checkpoint records (Task.weights_metadata; engine/weights.py):
MODEL_FILE = "model_file"  # the absolute path of --model FILE.py:NAME's file
MODEL_FILE_NEAR = "model_file_near"  # that path relative to the weights file's folder (engine/weights.py adds it)


@dataclass(frozen=True)
class DataSpec:
    """One data set: its files, shape, classes and the augmentation and normalization used."""
    name: str                 # the --dataset value
    title: str                # for people
    folder: str               # under --data-dir, as torchvision lays it out
    num_classes: int
    image_shape: tuple        # (H, W, C) of the stored uint8 images
    split_sizes: dict         # images per split in the official files
    mean: tuple               # per channel, of the training images scaled to 0..1
    std: tuple
    augment: str              # --augment auto: flip-crop, or crop for digits (a mirrored 3 is no 3)
    padding: int              # zero padding (pixels) around the image before the random crop
    files: dict               # split -> the files it is read from (names inside ``folder``)
    source: str               # torchvision's class for it: where the files are downloaded from
    label_key: str = ""       # CIFAR pickles: the key of the labels ("" for idx files)
    extra_files: tuple = ()   # CIFAR: the file of the class names (read by class_names)
    names: tuple = ()         # idx files: the class names, which no file holds (torchvision's)

    @property
    def channels(self):
        return self.image_shape[2]

    @property
    def is_idx(self):
        """MNIST's idx files (else CIFAR's pickles)."""
        return not self.label_key

    def all_files(self):
        return [name for split in ("train", "test") for name in self.files[split]] + list(self.extra_files)


_IDX = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

DATASETS = {spec.name: spec for spec in (
    DataSpec("cifar100", "CIFAR-100", "cifar-100-python", 100, (32, 32, 3), {"train": 50_000, "test": 10_000},
             (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761), augment="flip-crop", padding=4,
             files={"train": ("train",), "test": ("test",)}, source="CIFAR100", label_key="fine_labels",
             extra_files=("meta",)),
    DataSpec("cifar10", "CIFAR-10", "cifar-10-batches-py", 10, (32, 32, 3), {"train": 50_000, "test": 10_000},
             (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), augment="flip-crop", padding=4,
             files={"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
             source="CIFAR10", label_key="labels", extra_files=("batches.meta",)),
    DataSpec("fashion-mnist", "Fashion-MNIST", "FashionMNIST/raw", 10, (28, 28, 1), {"train": 60_000, "test": 10_000},
             (0.2860,), (0.3530,), augment="flip-crop", padding=2, files=_IDX, source="FashionMNIST",
             names=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                    "Ankle boot")),
    DataSpec("mnist", "MNIST", "MNIST/raw", 10, (28, 28, 1), {"train": 60_000, "test": 10_000},
             (0.1307,), (0.3081,), augment="crop", padding=2, files=_IDX, source="MNIST",
             names=tuple(str(digit) for digit in range(10))),
)}


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
    read_sizes: dict = None  # images per split as read, before --val-fraction held any out
    split: dict = None     # --val-fraction: which training images the test loader serves (held_out_record)
    data_dir: str = None   # an image folder's absolute path
    skipped: tuple = ()    # training images left out as unreadable, paths within data_dir
    names_sha256: str = None  # an image folder's training images by name, in order (names_sha256)

    @property
    def held_out(self):
        """The test loader serves training images held out (--val-fraction)."""
        return self.split is not None

    def weights_metadata(self):
        """What saved weights carry beside the tensors, so an evaluation or predict.py maps labels
        and prepares images the same way (images are scaled to cover ``stored_size`` (H, W),
        centre-cropped to it, then to ``image_size``, and normalized with ``mean`` and ``std``),
        and finds the images validation held out (``split``, ``data_dir``); ``synthetic`` when
        they learnt random images (predict.py says their predictions mean nothing)."""
        height, width, channels = self.prep.image_shape
        optional = {"split": self.split, "data_dir": self.data_dir,
                    "synthetic": self.fingerprint.get("synthetic") or None}
        return {"dataset": self.key, "classes": list(self.classes), "image_size": [height, width],
                "stored_size": list(self.prep.stored), "in_channels": channels, "mean": list(self.prep.mean),
                "std": list(self.prep.std), "augment": self.prep.augment,
                **{key: value for key, value in optional.items() if value is not None}}


@dataclass(frozen=True)
class Task:
    """What train_utils.fit trains. train_ddp.py replaces ``model`` by its DDP wrapper."""
    model: object          # the nn.Module, on this rank's device, the same initial weights on every rank
    model_name: str        # as built, for people: WideResNet(num_classes=100, in_channels=3)
    model_key: str         # --model as recorded in checkpoints: a resume with another is refused
    train_loader: object   # this rank's batches of (float32 images (B, C, H, W), int64 labels (B,))
    test_loader: object
    data: DataInfo
    loader: str            # device, torchvision or dali, as chosen
    loader_reason: str     # why, for the start-up block
    weights_note: str = ""  # where the initial weights come from, when not --weights or random (--finetune)
    model_file: str = None  # --model FILE.py:NAME's file, absolute (None for module:NAME)

    def weights_metadata(self):
        """What weights files and checkpoints record beside the tensors: the model (its key and
        file) and the data's DataInfo.weights_metadata."""
        own = {MODEL_FILE: self.model_file} if self.model_file else {}
        return {"model": self.model_key, **own, **self.data.weights_metadata()}


SAMPLED_IMAGES = 256  # training images whose bytes a fingerprint hashes, evenly spread: milliseconds


def data_fingerprint(key, synthetic, train_labels, test_size, classes=None, image_shape=None, images=None,
                     mean=None, mean_of="stored", names=None):
    """Identifies the data in a checkpoint, so that a resume on other data is refused: the
    counts, the labels, and what the pixels can say cheaply. ``images``: the training images
    as stored (N, H, W, C), files' bytes read as they are (a built-in data set, yours): a
    sample of them is hashed. ``mean``: per channel, of an image folder's decoded training
    images, compared within MEAN_TOLERANCE (a decoder's version may move it a little) with a
    mean measured the same way (``mean_of``: "stored", the cache's crops; "files", DALI's whole
    images), and not compared with the other (a resume with another --loader). ``names``: the
    training images' names_sha256, where --val-fraction holds images out by their place in
    that order (a photo renamed would move others between training and validation)."""
    labels = np.asarray(train_labels, dtype=np.int64)
    fingerprint = {"dataset": key, "synthetic": synthetic, "train_images": len(labels), "test_images": test_size,
                   "train_labels_sha256": hashlib.sha256(labels.tobytes()).hexdigest()}
    if classes is not None:
        fingerprint.update(classes=list(classes), image_shape=list(image_shape))
    if images is not None and len(images):
        rows = np.unique(np.linspace(0, len(images) - 1, min(len(images), SAMPLED_IMAGES)).round().astype(np.int64))
        digest = hashlib.sha256()
        for row in rows:  # one image at a time: a memory-mapped data set reads only these
            digest.update(np.ascontiguousarray(images[row]).tobytes())
        fingerprint["train_sample_sha256"] = digest.hexdigest()
    if mean is not None:
        fingerprint[f"train_mean_{mean_of}"] = [round(float(m), 4) for m in mean]
    if names is not None:
        fingerprint["train_names_sha256"] = names
    return fingerprint


MEAN_TOLERANCE = 0.01  # of the 0..1 pixel scale: about 2.5 grey levels on average


def fingerprints_differ(old, new):
    """The keys of two fingerprints (data_fingerprint) that both hold and that differ; a
    folder's mean only beyond MEAN_TOLERANCE."""
    def differs(key):
        if key.startswith("train_mean"):
            return (len(old[key]) != len(new[key])
                    or any(abs(a - b) > MEAN_TOLERANCE for a, b in zip(old[key], new[key])))
        return old[key] != new[key]
    return [key for key in old.keys() & new.keys() if differs(key)]


# ---------------------------------------------------------------------------------------------
# The labels: checked, and split by --val-fraction.

SPLIT_STREAM = 3  # the split's random stream: apart from the weights', shuffling's and augmentation's


class Split(NamedTuple):
    train: np.ndarray  # int64 indices into the training images, ascending
    val: np.ndarray    # int64 indices of the held-out ones, ascending


def check_labels(labels, num_classes, what):
    """One line naming the first label outside 0..num_classes-1 of ``what`` (e.g. "CIFAR-100
    training"): a damaged file or a data set's mistake, an IndexError deep in the loss otherwise."""
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        more = f" ({len(bad)} such labels)" if len(bad) > 1 else ""
        raise UserError(f"{what} image {bad[0]} has the label {labels[bad[0]]}, outside 0..{num_classes - 1} of its "
                        f"{num_classes} classes{more}")


def stratified_split(labels, fraction, seed):
    """Split(train, val) of images with ``labels`` (N,): round(fraction x n) images of each class
    of n images go to validation, at least one and at most n - 1 (a class of one image stays in
    training), chosen at random from (seed, class)."""
    labels = np.asarray(labels, dtype=np.int64)
    val = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = min(max(1, round(fraction * len(members))), len(members) - 1)
        rng = np.random.default_rng([int(seed), SPLIT_STREAM, int(label)])
        val.append(rng.permutation(members)[:count])
    val = np.sort(np.concatenate(val)) if val else np.empty(0, dtype=np.int64)
    return Split(np.setdiff1d(np.arange(len(labels)), val), val.astype(np.int64))


def describe_split(split, fraction, seed, classes, labels):
    """The start-up block's line (``classes``: the names; ``labels``: of every image split),
    naming the classes of one image, which stratified_split leaves in training alone: their
    validation accuracy is never measured."""
    labels = np.asarray(labels)
    unseen = [classes[label] for label in np.setdiff1d(np.unique(labels), labels[split.val])]
    alone = (f"; {len(unseen)} {'class has' if len(unseen) == 1 else 'classes have'} a single image, kept for "
             f"training, so none validated (e.g. {unseen[0]})" if unseen else "")
    return (f"Validation: {len(split.val)} of the {len(split.train) + len(split.val)} training images held out "
            f"(--val-fraction {fraction:g} of each of the {len(classes)} classes, chosen by --seed {seed}); the "
            f"training split is the other {len(split.train)}{alone}")


def names_sha256(names):
    """sha256 (hex) of image files' paths within their folder (str or Path), in order: which
    images a split holds, by name, where the labels' hash sees only how many of each class."""
    return hashlib.sha256(b"".join(os.fsencode(name) + b"\n" for name in names)).hexdigest()


def held_out_record(fraction, seed, labels, skipped=(), names=None):
    """What weights files and checkpoints record of --val-fraction ``fraction`` with --seed
    ``seed`` over training images with ``labels`` (all of them, before the split; ``skipped``:
    the paths of unreadable ones left out before that; ``names``: their names_sha256, None
    where unknown): enough to find the same held-out images again (held_out_again), and to
    tell when the folder has changed since."""
    labels = np.asarray(labels, dtype=np.int64)
    return {"fraction": fraction, "seed": seed, "images": len(labels),
            "labels_sha256": hashlib.sha256(labels.tobytes()).hexdigest(), "skipped": list(skipped),
            **({"names_sha256": names} if names is not None else {})}


def held_out_again(labels, record, what, names=None):
    """The indices (ascending) of the images ``record`` (held_out_record) held out, among
    training images with ``labels`` (and ``names``, their names_sha256), read again: one line
    when they are not the images it was made of (``what``: the folder, for the line). The
    names are compared where both are known (weights saved before they were recorded: not)."""
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) != record["images"] or hashlib.sha256(labels.tobytes()).hexdigest() != record["labels_sha256"]:
        changed = f"{len(labels)} training images now, {record['images']} then, or other labels"
    elif names is not None and record.get("names_sha256", names) != names:
        changed = "the same number of images of each class, but other file names: renamed, moved or replaced"
    else:
        return stratified_split(labels, record["fraction"], record["seed"]).val
    raise UserError(f"{what} is not the folder the weights were trained on, or it has changed since ({changed}): the "
                    "images validation held out cannot be found again")
