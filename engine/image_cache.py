"""The decoded images of an image folder (engine/image_folder.py), kept as uint8 arrays in .npy
files under --cache-dir, one folder per image folder and one subfolder per version of its
files and requested size:

    CACHE/<name>-<hash of its path>/<size asked for>-<hash of file names, sizes and times>/
        train_images.npy (N, H, W, C) uint8, train_labels.npy (N,) int64, test_*.npy (when
        there is a test/), meta.json, unreadable.txt (when some images cannot be read)

The size asked for (SizeRequest) is "auto" (the training images' most common size), HxW, or
HxW-auto (--image-size with --augment auto: stored larger when the images turn out to be
photos, which the header pass finds out).

An image that cannot be read (truncated, not an image, a broken link) is left out: one pass
finds every one, and meta.json, unreadable.txt and the start-up block name each with its
reason, so that a folder with several bad files takes one run to learn of all of them.

A cache is built in a temporary folder and renamed into place when complete, so an
interrupted build is never used (and the next build removes its folder). The space it needs
is checked and allocated before any image is decoded: a full disk is one line, never a "Bus
error" from a memory-mapped page with nowhere to go. It is rebuilt when any image file is
added, removed or changed (a stat of each file, no decoding), and the older version of the
same size request is then deleted.

Its meta.json records, per split, the size of the images file, a hash of the labels and a
hash of a sample of the images: a cache whose files no longer match (overwritten, truncated,
meta.json lost) is rebuilt with a warning, never trained on. The check reads the labels and
SAMPLED_IMAGES images: milliseconds, however large the cache.

Running out of memory while decoding (an image too large for the node, times the decoding
threads) is one line with the figures and what to ask Slurm for; the unfinished build is
removed.

The arrays are memory-mapped: the device loader copies them to the GPU, the torchvision
loader's workers read them without loading everything.
"""

import errno
import hashlib
import io
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from engine.data_formats import default_data_dir
from engine.errors import NO_SPACE, DatasetError, ResourceProblem, free_bytes, size_text, space_problem
from engine.image_folder import (GRAY_MODES, SPLIT_FOLDERS, FolderStats, Unreadable, channel_stats, check_left,
                                 decode_all, folder_stats, header, image_notes, map_threads, scan)
from engine.log import count
from engine.processes import available_cores
from engine.task import names_sha256

CACHE_FORMAT = 4  # 2: meta.json has the checks (split_checks); 3: torchvision's resize, skipped files, stats;
#                  4: images turned upright by their EXIF orientation (image_folder.upright)
SAMPLED_IMAGES = 64  # images hashed per split, evenly spaced, the first and the last among them
NO_PREALLOCATION = (errno.EINVAL, errno.EOPNOTSUPP)  # file systems without fallocate
SHOWN_UNREADABLE = 10  # unreadable images named in the start-up block; unreadable.txt has them all


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
    stats: FolderStats      # the training images' sizes as found, before resizing
    layout: str             # image_folder.FLAT or SPLIT
    skipped: dict           # split -> paths (within the folder) of the unreadable images left out
    names_sha256: dict      # split -> task.names_sha256 of its images' paths ({} in a cache built before)


@dataclass(frozen=True)
class SizeRequest:
    """The size to store a folder's images at: ``choose(stats)`` gives (H, W) from the training
    images' FolderStats, known after the header pass, and ``why(stats)`` says why in words;
    ``name`` names the cache's version (one per request)."""
    name: str          # auto, 64x64, 64x64-auto
    choose: Callable   # FolderStats -> (H, W)
    why: Callable      # FolderStats -> str


MOST_COMMON = SizeRequest("auto", lambda stats: stats.common_size, lambda stats: "the training images' " + (
    "only size" if stats.sizes == 1 else f"most common of {stats.sizes} sizes" if stats.most_common
    else f"median by area: {stats.sizes} sizes, none shared by half of them"))


def fixed_size(size, why="as requested"):
    """The SizeRequest of exactly ``size`` (H, W)."""
    return SizeRequest("x".join(map(str, size)), lambda stats: tuple(size), lambda stats: why)


def folder_version(root, splits, request):
    """The name of this version of the cache: the size asked for (SizeRequest.name), then a
    hash of every file's path (within ``root``, however --data-dir was spelled), size and
    modification time. It changes when any image is added, removed or changed."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}".encode())
    try:
        for split, (files, labels) in splits.items():
            for path, label in zip(files, labels):
                info = _stat(path)
                name = path.relative_to(root)
                digest.update(f"{split}\0{name}\0{label}\0{info.st_size}\0{info.st_mtime_ns}\n"
                              .encode(errors="surrogateescape"))  # any name the OS allows
    except OSError as err:  # a file deleted since the scan
        raise DatasetError(f"cannot read {err.filename} ({err.strerror or err})") from None
    return f"{request.name}-{digest.hexdigest()[:16]}"


def default_cache_dir():
    """--cache-dir: datasets/cache/ beside the scripts, where the guide's data sets go too."""
    return default_data_dir() / "cache"


def cache_root(root, cache_dir):
    """CACHE/<folder name>-<hash of its absolute path>: one per image folder."""
    root = Path(root).expanduser().resolve()
    return Path(cache_dir).expanduser() / f"{root.name}-{hashlib.sha256(os.fsencode(root)).hexdigest()[:8]}"


def _stat(path):
    """The file's stat; a broken link's own (its image is unreadable, and named as such)."""
    try:
        return path.stat()
    except FileNotFoundError:
        return path.lstat()


def build_cache(target, root, scanned, request, log, workers):
    """Decode the readable images of ``scanned`` (image_folder.Scanned of the folder ``root``)
    at the size ``request`` chooses into a temporary folder beside ``target``, then rename it
    to ``target``. Unreadable images are left out and named; meta.json keeps the notes for
    the start-up block."""
    classes, total = scanned.classes, sum(len(files) for files, _ in scanned.splits.values())
    log(f"Decoding {total} images of {len(classes)} classes into {target} ...")
    start = time.perf_counter()
    splits, headers, skipped, names = {}, {}, {}, {}  # skipped: split -> [Unreadable]
    for split, (files, labels) in scanned.splits.items():
        found = list(map_threads(_probe, files, workers))  # every file's header, or why it has none
        readable = np.asarray([not isinstance(h, Unreadable) for h in found], dtype=bool)
        splits[split] = ([path for path, ok in zip(files, readable) if ok], labels[readable])
        headers[split] = [h for h in found if not isinstance(h, Unreadable)]
        skipped[split] = [h for h in found if isinstance(h, Unreadable)]
        check_left(splits[split][1], classes, split, skipped[split])
    stats = folder_stats([h.size for h in headers["train"]])
    size = tuple(request.choose(stats))
    all_headers = [h for split_headers in headers.values() for h in split_headers]
    gray = all(h.mode in GRAY_MODES for h in all_headers)
    mode = "L" if gray else "RGB"
    shapes = {split: (len(files), *size, 1 if gray else 3) for split, (files, _) in splits.items()}
    check_space(target.parent, sum(int(np.prod(shape)) + 9 * shape[0] for shape in shapes.values()), total)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}-",
                                dir=target.parent))  # unique across nodes too; removed if abandoned
    try:
        for split, (files, labels) in splits.items():
            out = np.lib.format.open_memmap(tmp / f"{split}_images.npy", mode="w+", dtype=np.uint8,
                                            shape=shapes[split])
            reserve(tmp / f"{split}_images.npy", out.offset + out.nbytes)  # a full disk fails here, not in a SIGBUS
            failed = decode_all(files, size, mode, out, workers, log)  # a header that reads, pixels that do not
            out.flush()
            del out
            if failed:
                decoded = np.ones(len(files), dtype=bool)
                decoded[[i for i, _ in failed]] = False
                files, labels = [path for path, ok in zip(files, decoded) if ok], labels[decoded]
                headers[split] = [h for h, ok in zip(headers[split], decoded) if ok]
                skipped[split] += [err for _, err in failed]
                check_left(labels, classes, split, skipped[split])
                keep_first_rows(tmp / f"{split}_images.npy", len(labels))
            np.save(tmp / f"{split}_labels.npy", labels)
            names[split] = names_sha256(path.relative_to(root) for path in files)
        mean, std = channel_stats(np.load(tmp / "train_images.npy", mmap_mode="r"))
        shown = {split: [Unreadable(within_data_dir(err.path, root), ValueError(err.reason)) for err in errs]
                 for split, errs in skipped.items()}
        notes = [*image_notes(headers, size, mode, request.why(stats),
                              [within_data_dir(path, root) for path in scanned.ignored], splits),
                 *unreadable_notes(shown, target / "unreadable.txt")]
        write_unreadable(skipped, tmp)
        seconds = time.perf_counter() - start  # headers, decoding, statistics
        meta = {"format": CACHE_FORMAT, "splits": list(splits), "classes": list(classes), "mean": mean, "std": std,
                "notes": notes, "data_dir": str(root), "image_size": list(size), "mode": mode, "build_s": seconds,
                "images": total, "stats": stats._asdict(), "layout": scanned.layout,
                "skipped": {split: [[str(Path(err.path).relative_to(root)), err.reason] for err in errs]
                            for split, errs in skipped.items()},
                "checks": {split: split_checks(tmp, split) for split in splits}, "names_sha256": names}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, target)  # atomic: the cache appears complete or not at all
        except OSError:
            if not (target / "meta.json").is_file():  # not another process that finished first
                raise
    except MemoryError:  # numpy's or Pillow's: an image too large for the node's memory, times the threads
        from engine.out_of_memory import cache_out_of_memory
        raise cache_out_of_memory(total, target.parent, max((h.size for h in all_headers), key=lambda s: s[0] * s[1]),
                                  workers) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    decoded = total - sum(map(len, skipped.values()))
    log(f"Decoded {decoded} images in {seconds:.1f} s ({total / max(seconds, 1e-9):.0f} images/s with "
        f"{count(workers, 'thread', 'threads')}) into {target}")


def _probe(path):
    """The file's image_folder.Header, or the Unreadable that says why it has none."""
    try:
        return header(path)
    except Unreadable as err:
        return err


def unreadable_notes(skipped, listed_in):
    """The start-up block's lines naming the unreadable images (at most SHOWN_UNREADABLE, then
    how many more, all listed in the file ``listed_in``); [] when every image reads."""
    errors = [err for errs in skipped.values() for err in errs]
    if not errors:
        return []
    lines = [f"WARNING: skipped {count(len(errors), 'unreadable image', 'unreadable images')}, not trained or "
             f"validated on (fix or remove {'it' if len(errors) == 1 else 'them'}; the next run reads the folder "
             "again):"]
    lines += [f"  {err.path}: {err.reason}" for err in errors[:SHOWN_UNREADABLE]]
    if len(errors) > SHOWN_UNREADABLE:
        lines.append(f"  ... and {len(errors) - SHOWN_UNREADABLE} more, all listed in {listed_in}")
    return lines


def write_unreadable(skipped, folder):
    """Every unreadable image, path TAB reason, in ``folder``/unreadable.txt (none: no file)."""
    errors = [err for errs in skipped.values() for err in errs]
    if errors:
        with open(folder / "unreadable.txt", "w", encoding="utf-8", errors="surrogateescape") as f:
            f.writelines(f"{err.path}\t{err.reason}\n" for err in errors)


def keep_first_rows(path, rows):
    """Shrink the .npy file ``path`` to its first ``rows`` rows (the images that decoded, which
    decode_all writes first), in place: numpy pads a header to a length that does not depend
    on the number of rows, so the new header fits where the old one was, and the rest of the
    file is cut off."""
    images = np.load(path, mmap_mode="r")
    shape, offset, dtype = (rows, *images.shape[1:]), images.offset, images.dtype
    del images
    header_bytes = io.BytesIO()
    np.lib.format.write_array_header_1_0(header_bytes, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                        "fortran_order": False, "shape": shape})
    if len(header_bytes.getvalue()) != offset:  # a numpy that pads otherwise (before 1.23): rewrite the file
        np.save(path, np.array(np.load(path, mmap_mode="r")[:rows]))
        return
    with open(path, "r+b") as f:
        f.write(header_bytes.getvalue())
        f.truncate(offset + int(np.prod(shape)) * dtype.itemsize)


def check_space(folder, needed, images):
    """Fail before decoding when the cache of ``images`` images (``needed`` bytes) cannot fit."""
    free = free_bytes(folder)
    if needed > free:
        raise ResourceProblem(f"the image cache of {images} images needs {size_text(needed)} in {folder}, and "
                              f"{size_text(free)} is free there: free some space, or choose another --cache-dir")


def remove_stale(folder_cache, keep, log):
    """Delete the older versions of this folder's cache of the same size request (a cache of
    another --image-size stays) and the temporary folders of abandoned builds."""
    request = keep.rpartition("-")[0]
    for old in folder_cache.iterdir():
        if old.name != keep and old.name.rpartition("-")[0] == request and (old / "meta.json").is_file():
            if _delete(old):
                log(f"Removed the outdated cache {old}")
    remove_abandoned(folder_cache)


def remove_abandoned(folder_cache):
    """Delete the temporary folders of builds that died (killed, a full disk): those of a
    process of this host that is gone, and any a day old; and what a removal that died left
    (``_delete``'s folders, removed already in all but name). Called before a build, so that a
    failed build's space is free for the next."""
    for aside in folder_cache.glob(".*.deleting*"):
        shutil.rmtree(aside, ignore_errors=True)  # another process's removal under way: no harm done
    host = socket.gethostname()
    for old in folder_cache.glob(".*.tmp-*"):
        try:
            owner_host, pid = old.name.split(".tmp-", 1)[1].rsplit("-", 2)[:2]
            gone = owner_host == host and not Path(f"/proc/{int(pid)}").exists()
            if gone or time.time() - old.stat().st_mtime > 86400:
                _delete(old)
        except (OSError, ValueError):  # removed by another process first; a name of another version
            continue


def _delete(folder):
    """Remove ``folder``, renamed aside first so that a half-deleted cache is never taken for one."""
    aside = folder.with_name(f".{folder.name}.deleting{os.getpid()}")
    try:
        os.replace(folder, aside)
    except OSError:  # another process removed it first
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def prepare_folder(root, cache_dir, size=None, log=print, workers=None, held_out=False):
    """Make sure the cache of image folder ``root`` is current (build it if not): call on
    global rank 0 while the other ranks wait. Returns the cache folder. ``size``: a
    SizeRequest, an (H, W), or None for the training images' most common size; ``held_out``
    (--val-fraction): the folder needs no test/ (image_folder.scan)."""
    root = Path(root).expanduser()
    request = size if isinstance(size, SizeRequest) else fixed_size(size) if size else MOST_COMMON
    scanned = scan(root, held_out)
    folder_cache = cache_root(root, cache_dir)
    target = folder_cache / folder_version(root, scanned.splits, request)
    target = built_alike(target, request) or target
    damage = why_damaged(target) if target.exists() else None
    if damage:
        log(f"WARNING: the image cache {target} is damaged ({damage}): rebuilding it")
        _delete(target)
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_abandoned(folder_cache)
            build_cache(target, root, scanned, request, log, workers or min(32, available_cores()))
        except OSError as err:
            if err.errno in NO_SPACE:
                raise space_problem("the image cache in", folder_cache, err) from None
            raise DatasetError(f"cannot write the image cache in {folder_cache} ({err.strerror or err}); "
                               "choose a writable --cache-dir") from None
        remove_stale(folder_cache, target.name, log)
    return target


def built_alike(target, request):
    """A cache of the same files as ``target`` built for another request whose images are the
    ones ``request`` asks for (training at --image-size 64 after pre-decoding at 64 with
    --augment auto, say), or None: its meta.json has the statistics to tell, no file is read."""
    version = target.name.rpartition("-")[2]
    if target.exists() or not target.parent.is_dir():
        return None
    for built in sorted(target.parent.glob(f"*-{version}")):
        try:
            meta = json.loads((built / "meta.json").read_text())
            if meta["format"] == CACHE_FORMAT and tuple(request.choose(recorded_stats(meta))) == tuple(
                    meta["image_size"]):
                return built
        except (OSError, ValueError, KeyError, TypeError):  # being built, damaged, or of another format
            continue
    return None


# The notes name a file within --data-dir as each run spells it (photos/cat/x.jpg from the
# project folder, /scratch/me/photos/cat/x.jpg from elsewhere), as image_list's do: meta.json
# keeps them under this mark, which read_folder_cache replaces with the run's --data-dir.
DATA_DIR_MARK = "<DATA_DIR>"


def within_data_dir(path, root):
    """``path``, a file of image folder ``root``, as the cache's notes keep it (DATA_DIR_MARK)."""
    return Path(DATA_DIR_MARK) / Path(path).relative_to(root)


def read_folder_cache(target, data_dir=None):
    """FolderData from a cache folder that ``prepare_folder`` made: memory-mapped arrays
    (copy-on-write, so torch can wrap them without a copy or a read-only warning); its test
    split is None when the folder has no test/. Its notes name files within ``data_dir``, as
    this run gives it (None: as the run that built it gave it)."""
    meta_path = Path(target) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        splits = {split: (np.load(target / f"{split}_images.npy", mmap_mode="c"),
                          np.load(target / f"{split}_labels.npy"))
                  for split in meta.get("splits", SPLIT_FOLDERS)}
    except (OSError, ValueError) as err:
        raise DatasetError(f"cannot read the image cache {target} ({type(err).__name__}: {err}); every node must "
                           "see the same --cache-dir, on a shared file system", same_on_every_rank=False) from None
    given = str(Path(data_dir).expanduser()) if data_dir else meta.get("data_dir", DATA_DIR_MARK)
    notes = (*(note.replace(DATA_DIR_MARK, given) for note in meta["notes"]),
             f"Cache: {target} (decoded once; rebuilt when the images change)")
    skipped = {split: tuple(path for path, _ in errors) for split, errors in meta["skipped"].items()}
    return FolderData(splits["train"], splits.get("test"), tuple(meta["classes"]), tuple(meta["mean"]),
                      tuple(meta["std"]), Path(target), notes, recorded_stats(meta), meta["layout"], skipped,
                      meta.get("names_sha256", {}))


def recorded_stats(meta):
    """The FolderStats a cache's meta.json records (JSON has lists where they have tuples)."""
    return FolderStats(**{**meta["stats"], "common_size": tuple(meta["stats"]["common_size"])})


# ---------------------------------------------------------------------------------------------
# Is the cache what was built?

def _sampled(images):
    """Indices of the images whose pixels are hashed: evenly spaced over the split."""
    return np.unique(np.linspace(0, len(images) - 1, min(SAMPLED_IMAGES, len(images))).astype(np.int64))


def split_checks(folder, split):
    """What meta.json records of ``split``'s files in the cache ``folder``."""
    folder = Path(folder)
    images = np.load(folder / f"{split}_images.npy", mmap_mode="r")
    labels = np.load(folder / f"{split}_labels.npy")
    pixels = hashlib.sha256()
    for i in _sampled(images):
        pixels.update(np.ascontiguousarray(images[i]).tobytes())
    return {"images_bytes": os.path.getsize(folder / f"{split}_images.npy"), "shape": list(images.shape),
            "labels_sha256": hashlib.sha256(labels.tobytes()).hexdigest(), "pixels_sha256": pixels.hexdigest()}


def why_damaged(folder):
    """None when the cache ``folder`` matches its meta.json, else what does not (for a warning)."""
    meta_path = Path(folder) / "meta.json"
    if not meta_path.is_file():
        return "no meta.json: a build that did not finish, or a file deleted"
    try:
        checks = json.loads(meta_path.read_text())["checks"]
        for split, recorded in checks.items():
            found = split_checks(folder, split)
            differ = [key for key in recorded if recorded[key] != found.get(key)]
            if differ:
                return f"{split}: {', '.join(key.split('_')[0] for key in differ)} differ from meta.json"
    except (OSError, ValueError, KeyError, TypeError, EOFError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def reserve(path, nbytes):
    """Allocate ``nbytes`` for the file ``path`` now: a disk that fills up during the decode is
    then an OSError here, not a SIGBUS ("Bus error") from a page of the memory-mapped file
    that has nowhere to go. File systems that cannot preallocate are left as they are."""
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, nbytes)
        except OSError as err:
            if err.errno not in NO_PREALLOCATION:
                raise
