"""A --dataset FILE.py:NAME data set read whole into memory: two map-style data sets of
(image, int label) items become arrays, served like every other data set.
"""

from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from engine.errors import UserError, type_named
from engine.plugins import call_user_code, load_plugin
from engine.task import check_labels

def materialize(dataset, split, ref):
    """(images (N, H, W, C) uint8 or float32, labels int64 (N,)) of a map-style data set."""
    what = f"--dataset {ref}: the {split} set"
    try:
        count = len(dataset)
    except TypeError:
        raise UserError(f"{what} is {type_named(dataset)}, not a map-style data set (with len and [i])") from None
    if count == 0:
        raise UserError(f"{what} is empty")
    images, labels = None, np.empty(count, dtype=np.int64)
    for i in range(count):
        item = call_user_code(lambda: dataset[i], f"{what}[{i}]", ref)
        if not (isinstance(item, (tuple, list)) and len(item) >= 2):
            raise UserError(f"{what}[{i}] is {type_named(item)}, not (image, label)")
        image = as_hwc(item[0], f"{what}[{i}]")
        if images is None:
            images = np.empty((count, *image.shape), dtype=image.dtype)
        elif image.shape != images.shape[1:] or image.dtype != images.dtype:
            raise UserError(f"{what}[{i}] is {image.dtype} {image.shape} (H, W, C), item 0 {images.dtype} "
                            f"{images.shape[1:]}: every image must have one size and type (resize them in "
                            f"{ref.rpartition(':')[2]})")
        images[i] = image
        try:
            labels[i] = int(item[1])
        except (TypeError, ValueError):
            raise UserError(f"{what}[{i}] has the label {item[1]!r}, not a class index") from None
    return images, labels


def as_hwc(image, what):
    """A tensor (C, H, W) or (H, W), or a PIL image, as a numpy (H, W, C) uint8 or float32."""
    if isinstance(image, Image.Image):
        array = np.array(image if image.mode in ("L", "RGB") else image.convert("RGB"), dtype=np.uint8)
        return array[:, :, None] if array.ndim == 2 else array
    if not torch.is_tensor(image) or image.ndim not in (2, 3):
        shape = f" of shape {tuple(image.shape)}" if hasattr(image, "shape") else ""
        raise UserError(f"{what}: the image is {type_named(image)}{shape}, not a tensor (C, H, W) or a PIL "
                        "image (for a numpy (H, W, C) array: torch.from_numpy(a).permute(2, 0, 1))")
    image = image.detach().cpu()
    image = image[None] if image.ndim == 2 else image
    if image.dtype == torch.uint8:
        return image.permute(1, 2, 0).numpy()
    if image.is_floating_point():
        return image.permute(1, 2, 0).float().numpy()
    raise UserError(f"{what}: the image is {image.dtype}; give uint8 (0..255) or floating point")




class UserData(NamedTuple):
    train: tuple    # (images (N, H, W, C) uint8 or float32, labels int64 (N,))
    test: tuple     # None when NAME returned (train, None): --val-fraction holds out part of train
    classes: tuple  # label i is classes[i]


def read_user_data(ref, data_dir):
    """NAME(data_dir) of --dataset FILE.py:NAME, read whole into memory and checked: one
    image size and type for both splits, labels within the classes."""
    factory = load_plugin(ref, "--dataset")
    result = call_user_code(lambda: factory(data_dir), f"--dataset {ref}", ref)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise UserError(f"--dataset {ref}: {ref.rpartition(':')[2]}(data_dir) returned {type_named(result)}, "
                        "not (train, test)")
    train_images, train_labels = materialize(result[0], "training", ref)
    if result[1] is None:  # no test split: --val-fraction holds out part of the training set
        test_images, test_labels = train_images[:0], train_labels[:0]
    else:
        test_images, test_labels = materialize(result[1], "test", ref)
    if train_images.shape[1:] != test_images.shape[1:] or train_images.dtype != test_images.dtype:
        raise UserError(f"--dataset {ref}: training images are {train_images.dtype} {train_images.shape[1:]} (H, W, "
                        f"C), test images {test_images.dtype} {test_images.shape[1:]}: make them alike")
    classes = getattr(result[0], "classes", None)
    classes = tuple(map(str, classes)) if classes is not None else tuple(
        str(label) for label in range(int(np.concatenate([train_labels, test_labels]).max()) + 1))
    for labels, split in ((train_labels, "training"), (test_labels, "test")):
        check_labels(labels, len(classes), f"--dataset {ref}: {split}")
    test = (test_images, test_labels) if result[1] is not None else None
    return UserData((train_images, train_labels), test, classes)
