"""Labels: checked against the classes, for every kind of data set, and split.

--val-fraction: a validation set held out of the training images, for data that comes
without a test split (an image folder of train/ alone, a FILE.py:NAME set). The split is
stratified (each class gives the same fraction) and a pure function of the labels, the
fraction and --seed: the same on every rank, and the same after a resume, which keeps both
flags (a resume with others is refused).
"""

import hashlib
from typing import NamedTuple

import numpy as np

from engine.errors import UserError

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


def describe_split(split, fraction, seed, classes):
    """The start-up block's line."""
    return (f"Validation: {len(split.val)} of the {len(split.train) + len(split.val)} training images held out "
            f"(--val-fraction {fraction:g} of each of the {classes} classes, chosen by --seed {seed}); training on "
            f"the other {len(split.train)}")


def held_out_record(fraction, seed, labels, skipped=()):
    """What weights files and checkpoints record of --val-fraction ``fraction`` with --seed
    ``seed`` over training images with ``labels`` (all of them, before the split; ``skipped``:
    the paths of unreadable ones left out before that): enough to find the same held-out
    images again (held_out_again), and to tell when the folder has changed since."""
    labels = np.asarray(labels, dtype=np.int64)
    return {"fraction": fraction, "seed": seed, "images": len(labels),
            "labels_sha256": hashlib.sha256(labels.tobytes()).hexdigest(), "skipped": list(skipped)}


def held_out_again(labels, record, what):
    """The indices (ascending) of the images ``record`` (held_out_record) held out, among
    training images with ``labels``, read again: one line when they are not the images it
    was made of (``what``: the folder, for the line)."""
    labels = np.asarray(labels, dtype=np.int64)
    if len(labels) != record["images"] or hashlib.sha256(labels.tobytes()).hexdigest() != record["labels_sha256"]:
        raise UserError(f"{what} is not the folder the weights were trained on, or it has changed since ("
                        f"{len(labels)} training images now, {record['images']} then, or other labels): the images "
                        "validation held out cannot be found again")
    return stratified_split(labels, record["fraction"], record["seed"]).val
