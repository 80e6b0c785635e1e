"""--dataset folder: your own images in torchvision's ImageFolder layout, decoded once.

    DIR/train/CLASS/IMAGE     e.g. DIR/train/cat/0001.jpg, DIR/train/dog/a/b.png
    DIR/test/CLASS/IMAGE      (or DIR/val/CLASS/IMAGE; none with --val-fraction, which holds
                              out part of train/ instead)

Classes are the sorted folder names under train/ (label i is the i-th name). Any image file
Pillow reads counts, in any mode and size: the images become RGB, or stay gray when every
one is gray (16-bit gray is scaled to 8 bits, not clipped), and are resized to one size (the
most common among the training images, or --image-size), scaled to cover it and
centre-cropped so nothing is stretched. Hidden files and files that are not images (by their
ending) are ignored; an image that cannot be read is one line naming it.

The decoded images are kept as uint8 arrays in .npy files under --cache-dir, one folder per
image folder and one subfolder per version of its files and requested size:

    CACHE/<name>-<hash of its path>/<auto or HxW>-<hash of file names, sizes and times>/
        train_images.npy (N, H, W, C) uint8, train_labels.npy (N,) int64, test_*.npy (when
        there is a test/), meta.json

A cache is built in a temporary folder and renamed into place when complete, so an
interrupted build is never used; it is rebuilt when any image file is added, removed or
changed (a stat of each file, no decoding), and the older version at the same requested
size is then deleted. The arrays are memory-mapped: the device loader copies them to the
GPU, the torchvision loader's workers read them without loading everything.
"""

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from engine.data_formats import DatasetError, default_data_dir
from engine.processes import available_cores

SPLIT_FOLDERS = {"train": ("train",), "test": ("test", "val")}
GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
WIDE_GRAY_MODES = {"I", "I;16", "I;16L", "I;16B", "I;16N", "F"}  # more than 8 bits per pixel
CACHE_FORMAT = 1
PROGRESS_S = 30  # seconds between progress lines of a long decode
STATS_VALUES = 2**24  # values per chunk when computing mean and std (16 MB of uint8, bounded memory)


@dataclass(frozen=True)
class FolderData:
    """A decoded image folder: uint8 images (N, H, W, C) and int64 labels (N,) per split."""
    train: tuple            # (images, labels)
    test: tuple             # None when the folder has no test/ (or val/)
    classes: tuple          # folder names, sorted: label i is classes[i]
    mean: tuple             # per channel, of the training images scaled to 0..1
    std: tuple
    cache: Path             # the folder the arrays are read from
    notes: tuple            # how the images were prepared, for the start-up block


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


def folder_version(root, splits, image_size):
    """The name of this version of the cache: the requested size (auto or HxW), then a hash
    of every file's path (within ``root``, however --data-dir was spelled), size and
    modification time. It changes when any image is added, removed or changed."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}".encode())
    try:
        for split, (files, labels) in splits.items():
            for path, label in zip(files, labels):
                info = path.stat()
                name = path.relative_to(root)
                digest.update(f"{split}\0{name}\0{label}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    except OSError as err:  # a file deleted since the scan, a broken link
        raise DatasetError(f"cannot read {err.filename} ({err.strerror or err})") from None
    size = "x".join(map(str, image_size)) if image_size else "auto"
    return f"{size}-{digest.hexdigest()[:16]}"


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
    for i, array in enumerate(_map(lambda p: decode(p, size, mode), files, workers)):
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


# ---------------------------------------------------------------------------------------------
# The cache.

def default_cache_dir():
    """--cache-dir: datasets/cache/ beside the scripts, where the guide's data sets go too."""
    return default_data_dir() / "cache"


def cache_root(root, cache_dir):
    """CACHE/<folder name>-<hash of its absolute path>: one per image folder."""
    root = Path(root).expanduser().resolve()
    return Path(cache_dir).expanduser() / f"{root.name}-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}"


def build_cache(target, splits, classes, image_size, ignored, log, workers):
    """Decode every image into a temporary folder beside ``target``, then rename it to
    ``target``. Its meta.json keeps the notes for the start-up block."""
    total = sum(len(files) for files, _ in splits.values())
    log(f"Decoding {total} images of {len(classes)} classes into {target} ...")
    start = time.perf_counter()
    headers = {split: list(_map(header, files, workers)) for split, (files, _) in splits.items()}
    train_sizes = [size for _, size in headers["train"]]
    size = image_size or choose_size(train_sizes)
    all_headers = [h for split_headers in headers.values() for h in split_headers]
    gray = all(mode in GRAY_MODES for mode, _ in all_headers)
    mode = "L" if gray else "RGB"
    resized = sum(s != size for _, s in all_headers)
    converted = sum(m != mode for m, _ in all_headers)
    distinct = len(set(train_sizes))
    how = ("as requested" if image_size else
           f"the training images' {'only size' if distinct == 1 else f'most common of {distinct} sizes'}")
    notes = [f"Images: {size[0]}x{size[1]} ({how}; {resized} resized: scaled to cover, centre-cropped), "
             + ("gray (every image is gray)" if gray else f"RGB ({converted} converted from other modes)")]
    if ignored:
        notes.append(f"Ignored {len(ignored)} file(s) that are not images, e.g. {ignored[0]}")

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))  # unique across nodes too
    try:
        for split, (files, labels) in splits.items():
            out = np.lib.format.open_memmap(tmp / f"{split}_images.npy", mode="w+", dtype=np.uint8,
                                            shape=(len(files), *size, 1 if gray else 3))
            decode_all(files, size, mode, out, workers, log)
            out.flush()
            del out
            np.save(tmp / f"{split}_labels.npy", labels)
        mean, std = channel_stats(np.load(tmp / "train_images.npy", mmap_mode="r"))
        seconds = time.perf_counter() - start  # headers, decoding, statistics
        meta = {"format": CACHE_FORMAT, "splits": list(splits), "classes": list(classes), "mean": mean, "std": std,
                "notes": notes,
                "image_size": list(size), "mode": mode, "build_s": seconds, "images": total}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, target)  # atomic: the cache appears complete or not at all
        except OSError:
            if not (target / "meta.json").is_file():  # not another process that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"Decoded {total} images in {seconds:.1f} s ({total / max(seconds, 1e-9):.0f} images/s with {workers} "
        f"threads) into {target}")


def _map(function, items, workers):
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


def remove_stale(folder_cache, keep, log):
    """Delete the older versions of this folder's cache at the same requested size (a cache
    at another --image-size stays), and temporary folders of builds killed a day ago or
    more. Each is renamed aside first, so a half-deleted cache is never taken for one."""
    size = keep.split("-")[0]
    for old in folder_cache.iterdir():
        try:
            outdated = old.name != keep and old.name.startswith(f"{size}-") and (old / "meta.json").is_file()
            abandoned = old.name.startswith(".") and ".tmp" in old.name and time.time() - old.stat().st_mtime > 86400
            if old.is_dir() and (outdated or abandoned):
                aside = old.with_name(f".{old.name}.deleting{os.getpid()}")
                os.replace(old, aside)
                shutil.rmtree(aside, ignore_errors=True)
                if outdated:
                    log(f"Removed the outdated cache {old}")
        except OSError:  # another process removed it first
            continue


def prepare_folder(root, cache_dir, image_size=None, log=print, workers=None, needs_test=True):
    """Make sure the cache of image folder ``root`` is current (build it if not): call on
    global rank 0 while the other ranks wait. Returns the cache folder. A folder without
    test/ (or val/) is refused when ``needs_test``."""
    root = Path(root).expanduser()
    classes, splits, ignored = scan(root, needs_test)
    folder_cache = cache_root(root, cache_dir)
    target = folder_cache / folder_version(root, splits, image_size)
    if not (target / "meta.json").is_file():
        try:
            build_cache(target, splits, classes, image_size, ignored, log, workers or min(32, available_cores()))
        except OSError as err:
            raise DatasetError(f"cannot write the image cache in {folder_cache} ({err.strerror or err}); "
                               "choose a writable --cache-dir") from None
        remove_stale(folder_cache, target.name, log)
    return target


def read_folder_cache(target):
    """FolderData from a cache folder that ``prepare_folder`` made: memory-mapped arrays
    (copy-on-write, so torch can wrap them without a copy or a read-only warning); its test
    split is None when the folder has no test/."""
    meta_path = Path(target) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        splits = {split: (np.load(target / f"{split}_images.npy", mmap_mode="c"),
                          np.load(target / f"{split}_labels.npy"))
                  for split in meta.get("splits", SPLIT_FOLDERS)}
    except (OSError, ValueError) as err:
        raise DatasetError(f"cannot read the image cache {target} ({type(err).__name__}: {err}); every node must "
                           "see the same --cache-dir, on a shared file system (if it is damaged, delete it to "
                           "rebuild it)", same_on_every_rank=False) from None
    notes = (*meta["notes"], f"Cache: {target} (decoded once; rebuilt when the images change)")
    return FolderData(splits["train"], splits.get("test"), tuple(meta["classes"]), tuple(meta["mean"]),
                      tuple(meta["std"]), Path(target), notes)
