"""--dataset folder: your own images, in either of the layouts torchvision's ImageFolder users
have, scanned and decoded (engine/image_cache.py keeps the decoded images).

    DIR/CLASS/IMAGE           e.g. DIR/cat/0001.jpg, DIR/dog/a/b.png: every image is a training
                              image, and --val-fraction holds out part of each class
    DIR/train/CLASS/IMAGE     with DIR/test/CLASS/IMAGE (or DIR/val/CLASS/IMAGE) to validate
                              on, or none with --val-fraction

Classes are the sorted class folder names (label i is the i-th name). Any image file Pillow
reads counts, in any mode and size: the images become RGB, or stay gray when every one is
gray (16-bit gray is scaled to 8 bits, not clipped), and are resized to one size (the most
common among the training images, or --image-size): the shorter side scaled so that the
image covers the size, then centre-cropped, as torchvision's Resize and CenterCrop do, so
nothing is stretched. Hidden files and files that are not images (by their ending) are
ignored; an image that cannot be read is an Unreadable, which the cache skips and names.
Any file name the OS allows works, UTF-8 or not.
"""

import itertools
import os
import statistics
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

from engine.errors import DatasetError
from engine.log import count

SPLIT_FOLDERS = {"train": ("train",), "test": ("test", "val")}  # the first found of each is taken
FLAT, SPLIT = "DIR/CLASS/IMAGE", "DIR/train/CLASS/IMAGE"  # the two layouts, as the start-up block names them
GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
WIDE_GRAY_MODES = {"I", "I;16", "I;16L", "I;16B", "I;16N", "F"}  # more than 8 bits per pixel
PROGRESS_S = 30  # seconds between progress lines of a long decode
ENLARGE_NOTE_FACTOR = 2  # median upscaling above which the start-up block notes it
STATS_VALUES = 2**24  # values per chunk when computing mean and std (16 MB of uint8, bounded memory)


def image_extensions():
    """File endings of every format this Pillow can open (.jpg, .png, .webp, .tif, ...)."""
    Image.init()
    return {ext.lower() for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}


# ---------------------------------------------------------------------------------------------
# Scanning: which layout, which files, which classes (a stat per file, nothing decoded).

class Scanned(NamedTuple):
    """What is in an image folder."""
    classes: tuple  # class folder names, sorted: label i is classes[i]
    splits: dict    # "train" (and "test" when the folder has one): (files, int64 labels (N,))
    ignored: list   # files that are not images
    layout: str     # FLAT or SPLIT


def scan(root, held_out=False, flag="--data-dir"):
    """Scanned of the image folder ``root``. ``held_out`` (--val-fraction): validation is held
    out of the training images, so no test/ is needed (and a flat folder is accepted). A folder
    or file that cannot be read, and a layout that is neither, is one line naming it and
    ``flag``, the option that gave ``root`` (predict.py's --held-out)."""
    try:
        return _scan(Path(root).expanduser(), held_out, flag)
    except OSError as err:
        raise DatasetError(f"cannot read {err.filename or root} ({err.strerror or err})") from None


def split_folders(root, held_out, flag="--data-dir"):
    """({split: folder}, layout) of ``root``, given by ``flag``: DIR/train (with DIR/test or
    DIR/val), or DIR itself holding the class folders."""
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and _visible(p))
    splits = [name for name in folders if any(name in names for names in SPLIT_FOLDERS.values())]
    others = [name for name in folders if name not in splits]
    if splits and others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise DatasetError(f"{flag} {root} mixes two layouts: {', '.join(f'{name}/' for name in splits)} beside "
                           f"the class folder(s) {shown}; keep either {root}/CLASS/IMAGE or {root}/train/CLASS/IMAGE "
                           f"(with {root}/test/CLASS/IMAGE)")
    if others:
        if len(others) == 1:  # the first thing to fix (often --data-dir one level too high), before validation
            raise one_class(root, others[0], flag)
        if not any(first_image(root / name) for name in others):  # else it is asked for --val-fraction first
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise DatasetError(f"{flag} {root} holds no image files in its folders ({shown}): it is not an image "
                               f"folder ({root}/CLASS/IMAGE, or {root}/train/CLASS/IMAGE and {root}/test/CLASS/IMAGE)")
        if not held_out:
            raise DatasetError(f"{flag} {root} holds its class folders directly ({root}/CLASS/IMAGE, "
                               f"{len(others)} classes) and no test/ to validate on: add --val-fraction 0.2 to hold "
                               "out 20% of each class for validation")
        return {"train": root}, FLAT
    if not splits:
        raise DatasetError(f"{flag} {root} has no class folders (expected {root}/CLASS/IMAGE, or "
                           f"{root}/train/CLASS/IMAGE and {root}/test/CLASS/IMAGE)")
    found = {split: split_folder(root, split, split == "train" or not held_out, flag) for split in SPLIT_FOLDERS}
    return {split: folder for split, folder in found.items() if folder is not None}, SPLIT


def first_image(folder):
    """The first image file found below ``folder`` (a walk that stops there), or None."""
    extensions = image_extensions()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        image = next((name for name in filenames if Path(name).suffix.lower() in extensions), None)
        if image is not None:
            return Path(dirpath) / image
    return None


def validation_note(root):
    """[the start-up block's line on which folder validates] when ``root`` has both test/ and
    val/: test/, as it always has (runs and weights of such a folder record no folder name, so
    the choice cannot change under them), and val/ is not read."""
    root = Path(root).expanduser()
    if not all((root / name).is_dir() for name in SPLIT_FOLDERS["test"]):
        return []
    return [f"Validation: on {root / 'test'}/, which chooses model_best.pt and the early stop; {root / 'val'}/ is "
            f"not read (to validate on it, move {root / 'test'}/ out of {root}, or classify it at the end: "
            f"python predict.py --weights WEIGHTS --labelled {root / 'val'})"]


def split_folder(root, split, needed=True, flag="--data-dir"):
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
    raise DatasetError(f"{flag} {root}: no {wanted} (expected {root}/train/CLASS/IMAGE and "
                       f"{root}/test/CLASS/IMAGE, or val/ for test/){hint}")


def _visible(path):
    return not path.name.startswith(".")


def class_folders(folder):
    """The sorted names of the class folders in ``folder`` (a split's): its visible folders."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and _visible(p))


def image_folder_layout(root, most=100):
    """The layout (FLAT or SPLIT) of ``root`` when it is an image folder, else None. For the
    --data-dir of a built-in data set whose files are missing: --dataset folder forgotten, not
    a folder to download into. An image folder here: train/ holding class folders, or two
    folders or more beside each other, each holding image files among its first ``most``
    entries (a data set's download folder holds archives and arrays)."""
    extensions = image_extensions()

    def holds_images(folder):
        entries = itertools.islice(os.scandir(folder), most)
        return any(Path(entry.name).suffix.lower() in extensions for entry in entries)

    def classes(folder):
        return [path for path in folder.iterdir() if path.is_dir() and _visible(path) and holds_images(path)]

    try:
        train = next((root / name for name in SPLIT_FOLDERS["train"] if (root / name).is_dir()), None)
        if train is not None:
            return SPLIT if classes(train) else None
        return FLAT if len(classes(root)) >= 2 else None
    except OSError:  # a folder that cannot be read: the data set's own error says what is missing
        return None


def class_files(folder, extensions):
    """(image files, other files) below ``folder``, recursively, sorted; hidden ones skipped.
    Not torchvision.datasets.folder's find_classes and make_dataset: they take a hidden folder
    (.ipynb_checkpoints) for a class and its files for images, and do not list the files they
    pass over, which the start-up block names."""
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


class OneClassFolder(DatasetError):
    """An image folder of a single class folder ``name`` (``meant``: the folder inside it looks
    like the image folder meant, and the line names it); predict.py --held-out words its own."""

    def __init__(self, message, name, meant):
        super().__init__(message)
        self.name, self.meant = name, meant


def one_class(folder, name, flag="--data-dir"):
    """The OneClassFolder for ``folder`` holding a single class folder ``name``: a classifier
    needs two. Most often ``flag`` (--data-dir) is one level too high (it names a folder that
    holds the folder of class folders), and then the line names the folder meant."""
    inner = folder / name
    nested = [p.name for p in inner.iterdir() if p.is_dir() and _visible(p)]
    meant = len(nested) >= 2 or any(n in names for n in nested for names in SPLIT_FOLDERS.values())
    return OneClassFolder(f"{folder} holds 1 class folder ({name}): a classifier needs at least two; "
                          + (f"did you mean {flag} {inner}?" if meant else
                             f"add a folder of images for each other class ({folder}/CLASS/IMAGE)"), name, meant)


def _scan(root, held_out, flag):
    if not root.is_dir():
        raise DatasetError(f"{flag} {root}: {'a file, not a folder' if root.exists() else 'no such folder'}")
    folders, layout = split_folders(root, held_out, flag)
    classes = class_folders(folders["train"])
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
                raise DatasetError(f"{folder / name} holds no image files: add images of class {name}, or remove "
                                   f"the folder (each folder of {folder} is a class)")
            files += found
            labels += [label] * len(found)
            ignored += others
        if not files:
            raise DatasetError(f"{folder} holds no image files in its class folders")
        splits[split] = (files, np.asarray(labels, dtype=np.int64))
        ignored += strays
    if len(classes) == 1:  # trains to 100% on a task of one answer: never what was meant
        raise one_class(folders["train"], classes[0], flag)
    return Scanned(tuple(classes), splits, ignored, layout)


# ---------------------------------------------------------------------------------------------
# Decoding.

class Unreadable(DatasetError):
    """An image file that cannot be read: ``path`` and ``reason`` (Pillow's, in one line)."""

    def __init__(self, path, err):
        self.path = path
        # Pillow repeats the path in some messages ("cannot identify image file 'x.jpg'"): once is enough.
        text = err.strerror if isinstance(err, OSError) and err.strerror else str(err).replace(f" '{path}'", "")
        self.reason = " ".join(text.split()) or type(err).__name__
        super().__init__(f"{path}: not a readable image ({self.reason}); remove or replace it")


class Header(NamedTuple):
    mode: str    # Pillow's: RGB, L, P, CMYK, I;16, ...
    size: tuple  # (height, width)


EXIF_ORIENTATION = 0x0112  # how the camera was held: 5 to 8 store the picture a quarter turn off
TURNED = (5, 6, 7, 8)
# Each EXIF orientation's turn to upright, Pillow's ImageOps.exif_transpose's own; not that function,
# which also rewrites the EXIF block and raises on tags cameras and editors write wrong (a signed
# XResolution), so that a photo it decodes fine would be left out as unreadable.
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}


def orientation(image):
    """The EXIF orientation (1-8) of ``image`` (Pillow's, opened), from what Pillow read of the
    file before its pixels: the EXIF block (a PNG's eXIf chunk, or ImageMagick's text chunk of
    it), else XMP's tiff:Orientation; 1 where there is none or it cannot be read. Read with
    Image.Image.getexif, not a PNG's own, which decodes the whole image to look for an eXIf
    chunk after the pixels (the PNG specification puts it before them)."""
    try:
        return Image.Image.getexif(image).get(EXIF_ORIENTATION, 1)
    except Exception:  # a damaged EXIF block: the pixels as stored, as before orientations were read
        return 1


def upright(image):
    """``image`` (Pillow's, not decoded yet) as it is meant to be seen: turned and flipped as its
    EXIF orientation says (a phone's portrait photo is stored sideways), as DALI's decoder and
    image viewers do; itself when it has none. Every decode of an image file goes through it,
    so training on any loader, --eval-only and predict.py see the same pixels."""
    turn = UPRIGHT.get(orientation(image))
    return image.transpose(turn) if turn is not None else image


def header(path):
    """Header of the file (read without decoding the pixels), or Unreadable; its size (H, W)
    as upright turns it."""
    try:
        with Image.open(path) as image:
            turned = orientation(image) in TURNED
            return Header(image.mode, (image.width, image.height) if turned else (image.height, image.width))
    except Exception as err:  # Pillow raises many types for damaged files; OSError for a broken link
        raise Unreadable(path, err) from None


def choose_size(sizes):
    """(the (height, width) to store images of ``sizes`` at, whether it is the most common):
    the most common one, among equally common ones the smallest, when at least half the images
    have it; else, photos of many sizes, the median image's by area, so that a thumbnail among
    them cannot set it."""
    counts = Counter(sizes)
    common = max(counts, key=lambda size: (counts[size], -size[0] * size[1]))
    if 2 * counts[common] >= len(sizes):
        return common, True
    return sorted(sizes, key=lambda size: (size[0] * size[1], size))[(len(sizes) - 1) // 2], False


class FolderStats(NamedTuple):
    """The training images' sizes, from their headers: what choosing a size looks at."""
    common_size: tuple      # (H, W) to store them at (choose_size)
    sizes: int              # how many distinct sizes
    median_short_side: int  # pixels: whether they are photos (recipe.auto_augment)
    most_common: bool = True  # common_size is that of half the images or more; else the median's by area


def folder_stats(sizes):
    """FolderStats of the (height, width) of each training image."""
    size, most_common = choose_size(sizes)
    return FolderStats(size, len(set(sizes)), int(statistics.median_low(min(s) for s in sizes)), most_common)


def cover_size(height, width, size):
    """(h, w) an image of ``height`` x ``width`` is resized to so that it covers ``size`` (H, W)
    with its aspect ratio kept: the binding side exactly, the other rounded down as
    torchvision's Resize(int) rounds it (so for a square ``size`` this is Resize(S) itself).
    Computed here because torchvision's Resize covers square sizes only: Resize(int) scales the
    shorter side, whichever side a non-square size needs to cover."""
    target_h, target_w = size
    if target_h * width >= target_w * height:  # target_h / height >= target_w / width: the height binds
        return target_h, max(target_w, int(target_h * width / height))
    return max(target_h, int(target_w * height / width)), target_w


def resize_and_crop(image, size):
    """The PIL ``image`` resized to cover ``size`` (H, W) (cover_size) and centre-cropped to it,
    by torchvision's own resize and center_crop (Pillow's bilinear resize on a PIL image): for a
    square size exactly v2.Resize(S), v2.CenterCrop(S) (tests/test_photos.py compares them)."""
    from torchvision.transforms.v2 import functional  # here: 2 s of imports, paid by the runs that decode
    image = functional.resize(image, list(cover_size(image.height, image.width, size)))
    return functional.center_crop(image, list(size))


def decode(path, size, mode):
    """One image as uint8 (H, W, C): converted to ``mode`` (RGB or L), resized to cover ``size``
    (height, width) and centre-cropped to it (no distortion), as torchvision's Resize and
    CenterCrop do (resize_and_crop). Unreadable when it cannot be read."""
    try:
        with Image.open(path) as opened:
            image = upright(opened)
            if image.mode == "P" and "transparency" in image.info:
                image = image.convert("RGBA")  # what Pillow asks for palette images with transparency
            if image.mode in WIDE_GRAY_MODES:  # convert() would clip 16-bit values at 255
                image = Image.fromarray(_to_8_bits(np.asarray(image), image.mode))
            image = image.convert(mode)  # decodes: a truncated file fails here
            if (image.height, image.width) != tuple(size):
                image = resize_and_crop(image, size)
            array = np.asarray(image, dtype=np.uint8)
    except MemoryError:  # the node's memory, not the file: engine/image_cache.py says so
        raise
    except Exception as err:
        raise Unreadable(path, err) from None
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


# ---------------------------------------------------------------------------------------------
# What was read: classes left without an image, the start-up block's lines.

def check_left(labels, classes, split, skipped):
    """Once the unreadable images (``skipped``) are left out: every training class still has
    an image, and a test split has any. Else one line naming the class and an unreadable file."""
    if split == "train":
        empty = [name for label, name in enumerate(classes) if not np.any(labels == label)]
        if empty:
            example = next((err for err in skipped if empty[0] in Path(err.path).parts), skipped[0])
            raise DatasetError(f"class {empty[0]} has no readable image ({example.path}: {example.reason}; "
                               f"{count(len(skipped), 'unreadable image', 'unreadable images')} in all)")
    elif not len(labels):
        raise DatasetError(f"none of the {split} images can be read (e.g. {skipped[0].path}: {skipped[0].reason})")


def image_notes(headers, size, mode, why, ignored, splits):
    """The start-up block's lines on the images decoded (``headers``: split -> their
    image_folder.Header) at ``size`` in ``mode`` (``why``: that size's reason), the files
    ``ignored`` (not images, or images beside the class folders), and file names that are not UTF-8."""
    decoded = [h for split_headers in headers.values() for h in split_headers]
    resized = sum(h.size != size for h in decoded)
    converted = sum(h.mode != mode for h in decoded)
    notes = [f"Images: {size[0]}x{size[1]} ({why}; {resized} resized: scaled to cover, centre-cropped), "
             + ("gray (every image is gray)" if mode == "L" else
                f"RGB ({converted} converted from other modes)" if converted else "RGB (every image is RGB)")]
    enlarged = enlargement_note([h.size for h in decoded], size)
    if enlarged:
        notes.append(enlarged)
    not_images, outside = ignored_kinds(ignored)
    notes += ignored_note(len(not_images), not_images[:1], len(outside), outside[:1])
    undecodable = [path for files, _ in splits.values() for path in files if not _utf8(path)]
    if undecodable:
        shown = os.fsencode(undecodable[0]).decode("utf-8", "backslashreplace")  # caf\xe9.png: the bytes on disk
        notes.append(f"WARNING: {len(undecodable)} file name(s) are not UTF-8, e.g. {shown}: read all the same")
    return notes


def ignored_kinds(ignored):
    """(files that are not images, images outside the class folders) of the files a scan
    ``ignored``: inside a class folder a file by an image's name is an image, so one in the
    ignored is beside the class folders (DIR/train/IMAGE), where it belongs to no class."""
    extensions = image_extensions()
    outside = [path for path in ignored if Path(path).suffix.lower() in extensions]
    return [path for path in ignored if Path(path).suffix.lower() not in extensions], outside


def ignored_note(number, examples, outside=0, outside_examples=()):
    """[the line on ``number`` files left out as not images, naming the first of ``examples``;
    the warning on ``outside`` images left out as beside the class folders], or []."""
    notes = []
    if number:
        notes.append(f"Ignored {count(number, 'file that is not an image', 'files that are not images')}, "
                     f"e.g. {examples[0]}")
    if outside:
        first = Path(outside_examples[0])
        notes.append(f"WARNING: {count(outside, 'image lies', 'images lie')} beside the class folders, in no class, "
                     f"and {'is' if outside == 1 else 'are'} left out, e.g. {first}: move each into the folder of "
                     f"its class ({first.parent}/CLASS/)")
    return notes


def enlargement_note(sizes, size, most=ENLARGE_NOTE_FACTOR):
    """A Note when most images of ``sizes`` ((H, W) each) are scaled up to ``size`` by more
    than ``most`` on the median one: enlarging adds no detail, while the cache and every step
    pay for each pixel (an --image-size of 2000 on 240x180 photos makes a cache 90x theirs)."""
    factors = sorted(max(size[0] / height, size[1] / width) for height, width in sizes)
    median = factors[(len(factors) - 1) // 2]
    if median <= most:
        return None
    enlarged = sum(factor > 1 for factor in factors)
    areas = sorted(size[0] * size[1] / (height * width) for height, width in sizes)  # pixels stored / pixels read
    growth = areas[(len(areas) - 1) // 2]
    return (f"Note: {enlarged} of {len(factors)} images are enlarged to {size[0]}x{size[1]}, the median one "
            f"{median:.1f}x: no detail is added, while memory and time per image grow {growth:.{growth < 10:d}f}x; "
            "keep it if the model needs this size (a pretrained one may), else lower --image-size")


def _utf8(path):
    try:
        str(path).encode()
        return True
    except UnicodeEncodeError:  # bytes of another encoding, kept by Python as surrogates
        return False


def decode_all(files, size, mode, out, workers, log=None):
    """Decode ``files`` into the first rows of ``out`` (N, H, W, C), in order, leaving out those
    that cannot be read; returns [(index in ``files``, Unreadable)] of those. Pillow releases
    the GIL while it decodes and resizes, so threads use several cores without worker
    processes. A line at most every PROGRESS_S seconds says how far it is."""
    def attempt(path):
        try:
            return decode(path, size, mode)
        except Unreadable as err:
            return err

    last, row, failed = time.perf_counter(), 0, []
    for i, result in enumerate(map_threads(attempt, files, workers)):
        if isinstance(result, Unreadable):
            failed.append((i, result))
        else:
            out[row] = result
            row += 1
        if log and time.perf_counter() - last >= PROGRESS_S:
            last = time.perf_counter()
            log(f"  {i + 1} of {len(files)} images decoded")
    return failed


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
