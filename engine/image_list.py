"""--loader dali's pass over an image folder: each image decoded once, on threads, to find the
ones that cannot be read (the same ones the cache skips: engine/image_cache.py) and the ones DALI
does not decode (a GIF), and to count the training pixels for the channels' mean and std. What
it finds is kept in one small JSON file in the folder's cache folder, next to the decoded
caches, and found again without decoding while no image changes:

    CACHE/<name>-<hash of its path>/list-<hash of file names, sizes and times>.json

No decoded copy of the images is kept: DALI reads and decodes the files themselves every epoch,
so a folder of any size trains without the cache's disk space (1.28 M ImageNet photos would be
250 GB decoded at 256 pixels).
"""

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from engine.errors import NO_SPACE, DatasetError, space_problem
from engine.image_cache import SizeRequest, cache_root, folder_version, unreadable_notes
from engine.image_folder import (GRAY_MODES, PROGRESS_S, FolderStats, Unreadable, check_left, folder_stats, header,
                                 ignored_kinds, ignored_note, map_threads, scan, upright)
from engine.log import count
from engine.processes import available_cores
from engine.task import names_sha256

LIST_FORMAT = 1
LISTED = SizeRequest("list", None, None)  # names the list's version (folder_version): no size is chosen
# What DALI's image decoder reads (nvidia.dali.fn.decoders.image); Pillow reads more (GIF, ICO, ...).
DALI_FORMATS = {".jpg", ".jpeg", ".jpe", ".png", ".bmp", ".tif", ".tiff", ".webp", ".pnm", ".ppm", ".pgm", ".pbm",
                ".jp2", ".j2k"}
TIFF_SUFFIXES = (".tif", ".tiff")


@dataclass(frozen=True)
class FolderList:
    """An image folder as files: per split (absolute paths, int64 labels (N,)) of the images
    that read; what FolderData (engine/image_cache.py) holds, without the pixels."""
    train: tuple            # (paths, labels)
    test: tuple             # None when the folder has no test/ (or val/)
    classes: tuple          # folder names, sorted: label i is classes[i]
    mean: tuple             # per channel, of the training images' pixels scaled to 0..1
    std: tuple
    gray: bool              # every image is gray: one channel
    notes: tuple            # for the start-up block: the images, the unreadable ones, where the list is
    stats: object           # image_folder.FolderStats of the training images' sizes
    layout: str             # image_folder.FLAT or SPLIT
    skipped: dict           # split -> paths (within the folder) of the images left out
    names_sha256: dict      # split -> task.names_sha256 of its images' paths


def checked(path):
    """(mode, (height, width), pixel counts (channels, 256) of the image as RGB) of the image file
    ``path`` decoded whole, or the Unreadable that says why it cannot be, or why DALI cannot."""
    if Path(path).suffix.lower() not in DALI_FORMATS:
        return Unreadable(path, ValueError(f"a {Path(path).suffix} file, which DALI does not decode: convert it to "
                                           "JPEG or PNG, or use --loader torchvision"))
    try:
        with Image.open(path) as opened:
            image = upright(opened)  # as DALI decodes it
            mode, size = image.mode, (image.height, image.width)
            pixels = np.asarray(image.convert("RGB"))  # decodes: a truncated file fails here
    except MemoryError:
        raise
    except Exception as err:  # Pillow raises many types for damaged files; OSError for a broken link
        return Unreadable(path, err)
    counts = np.stack([np.bincount(pixels[..., c].ravel(), minlength=256) for c in range(3)])
    return mode, size, counts


def stats_of(counts, gray):
    """(mean, std) per channel of pixels scaled to 0..1 from their value counts (C, 256)."""
    counts = counts[:1] if gray else counts
    values = np.arange(256) / 255
    total = counts.sum(axis=1)
    mean, squares = counts @ values / total, counts @ values**2 / total
    std = np.sqrt(np.maximum(squares - mean**2, 0))
    return tuple(round(float(m), 4) for m in mean), tuple(round(float(s), 4) if s > 1e-4 else 1.0 for s in std)


def build_list(root, scanned, workers, log):
    """The list's contents (a dict for JSON) of ``scanned`` (image_folder.Scanned of ``root``):
    every image decoded once on ``workers`` threads (Pillow releases the GIL while decoding),
    its pixel counts summed as it comes (memory: the file names, not a count per image). A line
    at most every PROGRESS_S seconds says how far it is."""
    total = sum(len(files) for files, _ in scanned.splits.values())
    log(f"Checking {total} images of {len(scanned.classes)} classes for --loader dali (each decoded once) ...")
    start = last = time.perf_counter()
    splits, skipped, sizes, gray, done, cmyk_tiffs = {}, {}, [], True, 0, []
    counts = np.zeros((3, 256), dtype=np.int64)
    for split, (files, labels) in scanned.splits.items():
        readable, skipped[split] = np.ones(len(files), dtype=bool), []
        for i, result in enumerate(map_threads(checked, files, workers)):
            if isinstance(result, Unreadable):
                readable[i] = False
                skipped[split].append(result)
                continue
            mode, size, pixels = result
            gray = gray and mode in GRAY_MODES
            if mode == "CMYK" and files[i].suffix.lower() in TIFF_SUFFIXES:
                cmyk_tiffs.append(files[i])
            if split == "train":
                sizes.append(size)
                counts += pixels
            done += 1
            if time.perf_counter() - last >= PROGRESS_S:
                last = time.perf_counter()
                log(f"  {done} of {total} images checked")
        check_left(labels[readable], scanned.classes, split, skipped[split])
        splits[split] = {"files": [str(path.relative_to(root)) for path, ok in zip(files, readable) if ok],
                         "labels": labels[readable].tolist()}
    mean, std = stats_of(counts, gray)
    seconds = time.perf_counter() - start
    log(f"Checked {total} images in {seconds:.1f} s ({total / max(seconds, 1e-9):.0f} images/s with "
        f"{count(workers, 'thread', 'threads')})")
    return {"format": LIST_FORMAT, "classes": list(scanned.classes), "layout": scanned.layout, "splits": splits,
            "mean": mean, "std": std, "gray": gray, "stats": folder_stats(sizes)._asdict(),
            "skipped": {split: [[str(Path(err.path).relative_to(root)), err.reason] for err in errs]
                        for split, errs in skipped.items()},
            # Files that are not images, and images beside the class folders: how many, and the first.
            **{key: {"count": len(paths), "first": [str(Path(path).relative_to(root)) for path in paths[:1]]}
               for key, paths in zip(("ignored", "outside"), ignored_kinds(scanned.ignored))},
            "cmyk_tiff": {"count": len(cmyk_tiffs), "first": [str(path.relative_to(root)) for path in cmyk_tiffs[:1]]}}


def decoded_bytes(root, held_out, request, sample=100):
    """About the bytes the image folder ``root`` takes decoded at the size ``request`` (a
    SizeRequest) chooses: what its cache would hold, from ``sample`` training images' headers."""
    scanned = scan(root, held_out)
    files = scanned.splits["train"][0]
    sizes = []
    for path in files[::max(1, len(files) // sample)]:
        try:
            sizes.append(header(path).size)
        except Unreadable:  # the list's pass names it
            continue
    height, width = request.choose(folder_stats(sizes or [(224, 224)]))
    return sum(len(split_files) for split_files, _ in scanned.splits.values()) * height * width * 3


def prepare_list(root, cache_dir, log=print, workers=None, held_out=False):
    """The list file of image folder ``root`` for --loader dali, made if missing (call on global
    rank 0 while the other ranks wait); ``held_out``: --val-fraction (image_folder.scan)."""
    root = Path(root).expanduser()
    scanned = scan(root, held_out)
    folder_cache = cache_root(root, cache_dir)
    target = folder_cache / f"{folder_version(root, scanned.splits, LISTED)}.json"
    if target.is_file():
        return target
    listed = build_list(root, scanned, workers or min(32, available_cores()), log)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        folder_cache.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(listed))  # names that are not UTF-8 as \udcXX escapes: read back the same
        os.replace(tmp, target)  # atomic: complete or absent
    except OSError as err:
        if err.errno in NO_SPACE:
            raise space_problem("the image list in", folder_cache, err) from None
        raise DatasetError(f"cannot write the image list in {folder_cache} ({err.strerror or err}); choose a "
                           "writable --cache-dir") from None
    finally:
        tmp.unlink(missing_ok=True)
    for old in folder_cache.glob("list-*.json"):  # older versions of the same folder's list
        if old != target:
            old.unlink(missing_ok=True)
    return target


def read_list(target, root):
    """FolderList of the list file ``target`` of image folder ``root``."""
    try:
        listed = json.loads(Path(target).read_text())
    except (OSError, ValueError) as err:
        raise DatasetError(f"cannot read the image list {target} ({type(err).__name__}: {err}); every node must see "
                           "the same --cache-dir, on a shared file system", same_on_every_rank=False) from None
    given, root = Path(root).expanduser(), Path(root).expanduser().resolve()
    splits = {split: ([str(root / name) for name in part["files"]], np.asarray(part["labels"], dtype=np.int64))
              for split, part in listed["splits"].items()}
    # Named within --data-dir as it was given (d/train/cat/1.jpg), as the cache's notes name them:
    # DALI reads the absolute paths, but people look for the files where they said they are.
    errors = {split: [Unreadable(given / name, ValueError(reason)) for name, reason in errs]
              for split, errs in listed["skipped"].items()}
    stats = FolderStats(**{**listed["stats"], "common_size": tuple(listed["stats"]["common_size"])})
    images = sum(len(labels) for _, labels in splits.values())
    ignored, outside = listed.get("ignored", {}), listed.get("outside", {})  # a list made before: nothing said
    notes = (f"Images: {images} files decoded by DALI every epoch (none kept decoded: training crops the whole "
             "image, validation resizes it to cover the stored size below and takes the centre), "
             + ("gray (every image is gray)" if listed["gray"] else "RGB") + f"; checked once, listed in {target}",
             *ignored_note(ignored.get("count", 0), [given / name for name in ignored.get("first", [])],
                           outside.get("count", 0), [given / name for name in outside.get("first", [])]),
             *cmyk_tiff_note(listed.get("cmyk_tiff", {}), given),
             *unreadable_notes(errors, target))
    skipped = {split: tuple(name for name, _ in errs) for split, errs in listed["skipped"].items()}
    return FolderList(splits["train"], splits.get("test"), tuple(listed["classes"]), tuple(listed["mean"]),
                      tuple(listed["std"]), listed["gray"], notes, stats, listed["layout"], skipped,
                      {split: names_sha256(part["files"]) for split, part in listed["splits"].items()})


def cmyk_tiff_note(found, root):
    """[the Note on the list's CMYK TIFF files (``found``: their count and the first's name within
    ``root``)], or []. DALI's libtiff decoder (nvImageCodec's) does not take CMYK: for each such
    file, every time it is decoded, it prints an [ERROR] line, and the next decoder (OpenCV's)
    reads the image, with Pillow's pixels (tests/test_dali.py). No DALI setting silences the
    line (DALI_NVIMGCODEC_LOG_LEVEL 0 is its default, the least it says); the user can."""
    if not found.get("count"):
        return []
    many = found["count"] > 1
    return [f"Note: {count(found['count'], 'CMYK TIFF file', 'CMYK TIFF files')}{', e.g.' if many else ','} "
            f"{root / found['first'][0]}: "
            f"DALI's TIFF decoder prints an [ERROR] line for {'each' if many else 'it'} every time it decodes "
            f"{'one' if many else 'it'}, then its next decoder reads {'them' if many else 'it'} correctly (saved as "
            "RGB, or as JPEG, the line goes)"]
