"""--dataset folder: your own images in torchvision's ImageFolder layout, scanned and decoded
(engine/image_cache.py keeps the decoded images).

    DIR/train/CLASS/IMAGE     e.g. DIR/train/cat/0001.jpg, DIR/train/dog/a/b.png
    DIR/test/CLASS/IMAGE      (or DIR/val/CLASS/IMAGE; none with --val-fraction, which holds
                              out part of train/ instead)

Classes are the sorted folder names under train/ (label i is the i-th name). Any image file
Pillow reads counts, in any mode and size: the images become RGB, or stay gray when every
one is gray (16-bit gray is scaled to 8 bits, not clipped), and are resized to one size (the
most common among the training images, or --image-size), scaled to cover it and
centre-cropped so nothing is stretched. Hidden files and files that are not images (by their
ending) are ignored; an image that cannot be read is one line naming it. Any file name the
OS allows works, UTF-8 or not.
"""

import os
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from engine.data_formats import DatasetError

SPLIT_FOLDERS = {"train": ("train",), "test": ("test", "val")}
GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
WIDE_GRAY_MODES = {"I", "I;16", "I;16L", "I;16B", "I;16N", "F"}  # more than 8 bits per pixel
PROGRESS_S = 30  # seconds between progress lines of a long decode
STATS_VALUES = 2**24  # values per chunk when computing mean and std (16 MB of uint8, bounded memory)


def image_extensions():
    """File endings of every format this Pillow can open (.jpg, .png, .webp, .tif, ...)."""
    Image.init()
    return {ext.lower() for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}


# ---------------------------------------------------------------------------------------------
# Scanning: which files, which classes (a stat per file, nothing decoded).

def split_folder(root, split, needed=True):
    """The folder of ``split``: DIR/train, or DIR/test else DIR/val; None when it is missing and
    not ``needed``."""
    for name in SPLIT_FOLDERS[split]:
        if (root / name).is_dir():
            return root / name
    if not needed:
        return None
    wanted = " or ".join(f"{root / name}/" for name in SPLIT_FOLDERS[split])
    hint = ("" if split == "train" else
            f"; to validate on part of {root}/train/ instead, add --val-fraction 0.2 (20% of each class held out)")
    raise DatasetError(f"--data-dir {root}: no {wanted} (expected {root}/train/CLASS/IMAGE and "
                       f"{root}/test/CLASS/IMAGE, or val/ for test/){hint}")


def _visible(path):
    return not path.name.startswith(".")


def class_files(folder, extensions):
    """(image files, other files) below ``folder``, recursively, sorted; hidden ones skipped."""
    images, others = [], []

    def unreadable(err):
        raise err  # os.walk would skip a folder it cannot read

    for dirpath, dirnames, filenames in os.walk(folder, onerror=unreadable, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                path = Path(dirpath) / name
                (images if path.suffix.lower() in extensions else others).append(path)
    return images, others


def scan(root, needs_test=True):
    """(classes, {split: (files, labels)}, ignored files): what is in the folder; no "test"
    split when it has no test/ (or val/) and ``needs_test`` is False. A folder or file that
    cannot be read is one line naming it."""
    try:
        return _scan(Path(root).expanduser(), needs_test)
    except OSError as err:
        raise DatasetError(f"cannot read {err.filename or root} ({err.strerror or err})") from None


def _scan(root, needs_test):
    if not root.is_dir():
        raise DatasetError(f"--data-dir {root}: no such folder")
    folders = {split: split_folder(root, split, needed=split == "train" or needs_test) for split in SPLIT_FOLDERS}
    folders = {split: folder for split, folder in folders.items() if folder is not None}
    classes = sorted(p.name for p in folders["train"].iterdir() if p.is_dir() and _visible(p))
    if not classes:
        raise DatasetError(f"{folders['train']} has no class folders (expected {folders['train']}/CLASS/IMAGE)")
    extensions = image_extensions()
    splits, ignored = {}, []
    for split, folder in folders.items():
        strays = [p for p in folder.iterdir() if not p.is_dir() and _visible(p)]
        unknown = sorted(p.name for p in folder.iterdir() if p.is_dir() and _visible(p) and p.name not in classes)
        if unknown:
            raise DatasetError(f"{folder}: class folder(s) {', '.join(unknown)} are not in {folders['train']} "
                               f"(its classes: {', '.join(classes[:10])}{', ...' if len(classes) > 10 else ''})")
        files, labels = [], []
        for label, name in enumerate(classes):
            found, others = class_files(folder / name, extensions) if (folder / name).is_dir() else ([], [])
            if not found and split == "train":
                raise DatasetError(f"{folder / name} holds no image files")
            files += found
            labels += [label] * len(found)
            ignored += others
        if not files:
            raise DatasetError(f"{folder} holds no image files in its class folders")
        splits[split] = (files, np.asarray(labels, dtype=np.int64))
        ignored += strays
    return tuple(classes), splits, ignored


# ---------------------------------------------------------------------------------------------
# Decoding.

def header(path):
    """(mode, (height, width)) from the file's header, without decoding the pixels."""
    try:
        with Image.open(path) as image:
            return image.mode, (image.height, image.width)
    except Exception as err:  # Pillow raises many types for damaged files
        raise _unreadable(path, err) from None


def _unreadable(path, err):
    reason = " ".join(str(err).split()) or type(err).__name__
    return DatasetError(f"{path}: not a readable image ({reason}); remove or replace it")


def choose_size(sizes):
    """The most common (height, width); among equally common ones the smallest."""
    counts = Counter(sizes)
    return max(counts, key=lambda size: (counts[size], -size[0] * size[1]))


def decode(path, size, mode):
    """One image as uint8 (H, W, C): converted to ``mode`` (RGB or L), scaled to cover
    ``size`` (height, width) and centre-cropped to it (no distortion)."""
    try:
        with Image.open(path) as image:
            if image.mode == "P" and "transparency" in image.info:
                image = image.convert("RGBA")  # what Pillow asks for palette images with transparency
            if image.mode in WIDE_GRAY_MODES:  # convert() would clip 16-bit values at 255
                image = Image.fromarray(_to_8_bits(np.asarray(image), image.mode))
            image = image.convert(mode)  # decodes: a truncated file fails here
            if (image.height, image.width) != size:
                image = ImageOps.fit(image, (size[1], size[0]), Image.Resampling.BILINEAR)
            array = np.asarray(image, dtype=np.uint8)
    except MemoryError:  # the node's memory, not the file: engine/image_cache.py says so
        raise
    except Exception as err:
        raise _unreadable(path, err) from None
    return array[:, :, None] if array.ndim == 2 else array


def _to_8_bits(pixels, mode):
    """16-bit (or 32-bit integer) gray pixels scaled to 0..255; 32-bit float ones (mode F)
    taken as 0..1 when they are, else scaled from their own range."""
    pixels = pixels.astype(np.float64)
    if mode == "F":
        low, high = (0.0, 1.0) if pixels.min() >= 0 and pixels.max() <= 1 else (pixels.min(), pixels.max())
        pixels = (pixels - low) / max(high - low, 1e-12) * 255
    else:
        pixels = pixels / 257  # 65535 -> 255
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def decode_all(files, size, mode, out, workers, log=None):
    """Decode ``files`` into ``out`` (N, H, W, C), in order. Pillow releases the GIL while it
    decodes and resizes, so threads use several cores without worker processes. A line at
    most every PROGRESS_S seconds says how far it is."""
    last = time.perf_counter()
    for i, array in enumerate(map_threads(lambda p: decode(p, size, mode), files, workers)):
        out[i] = array
        if log and time.perf_counter() - last >= PROGRESS_S:
            last = time.perf_counter()
            log(f"  {i + 1} of {len(files)} images decoded")


def channel_stats(images, scale=255):
    """(mean, std) per channel of images (N, H, W, C) divided by ``scale`` (255: uint8 pixels to
    0..1), read in chunks of about STATS_VALUES values, so that a memory-mapped array is never
    read whole into memory. uint8 images are counted by value (exact, and fast); float images
    are summed in float64. A channel that never varies gets std 1 (not a division by ~0)."""
    channels = images.shape[-1]
    step = max(1, STATS_VALUES // max(1, int(np.prod(images.shape[1:]))))
    if images.dtype == np.uint8:
        counts = np.zeros((channels, 256), dtype=np.int64)
        for start in range(0, len(images), step):
            chunk = np.asarray(images[start:start + step])
            for c in range(channels):
                counts[c] += np.bincount(chunk[..., c].ravel(), minlength=256)
        values = np.arange(256) / scale
        count = counts.sum(axis=1)
        mean, squares = counts @ values / count, counts @ values**2 / count
    else:
        total, squared, count = np.zeros(channels), np.zeros(channels), 0
        for start in range(0, len(images), step):
            chunk = np.asarray(images[start:start + step], dtype=np.float64).reshape(-1, channels) / scale
            total += chunk.sum(axis=0)
            squared += np.square(chunk).sum(axis=0)
            count += len(chunk)
        mean, squares = total / count, squared / count
    std = np.sqrt(np.maximum(squares - mean**2, 0))
    return tuple(round(float(m), 4) for m in mean), tuple(round(float(s), 4) if s > 1e-4 else 1.0 for s in std)


def map_threads(function, items, workers):
    """function(item) for each item, in order, on ``workers`` threads, with at most
    8 x workers items under way (Executor.map would queue a million futures at once). Ctrl-C
    or an error cancels what has not started."""
    pool, pending = ThreadPoolExecutor(workers), deque()
    try:
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) >= 8 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
