"""The four built-in data sets on disk (engine/task.py's DATASETS says what each is): where
their files go, how they are fetched, and how they are read and checked; imported by a run
that reads them (a --synthetic run makes its images without them). Files are torchvision's
own layout, so a folder torchvision filled works here and the other way round:

    cifar100       DIR/cifar-100-python/{train,test,meta}                  Python pickles
    cifar10        DIR/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}
    fashion-mnist  DIR/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]
    mnist          DIR/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]

Every reader returns (images uint8 (N, H, W, C), labels int64 (N,)) and turns a missing,
truncated or corrupted file into one line naming the file. CIFAR's pickles are read by a
restricted unpickler, so a planted file runs no code (docs/what-runs-code.md). A download is checked (md5, by
torchvision) and moved into place file by file, so an interrupted one never looks complete,
files already present are never overwritten, and a failed one leaves nothing behind.
"""

import codecs
import gzip
import hashlib
import pickle
import shutil
import socket
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from engine.errors import DatasetError

IDX_IMAGES, IDX_LABELS = 2051, 2049  # the idx files' magic numbers: uint8 data, 3 or 1 dimensions
# A download that receives nothing for this long fails (seconds): a compute node whose network
# never answers (a firewall that drops packets, a dead proxy) must not hang until the time limit.
DOWNLOAD_STALL_S = 60.0


class RefusedData(DatasetError):
    """A data file that would run code when read, or an official file that is not what was
    published: refused before anything in it is constructed. Exit status 1."""

    exit_code = 1


# ---------------------------------------------------------------------------------------------
# CIFAR's pickles, read without running code: unpickling may call any function a file names,
# so only what the official files (Python 2, numpy arrays) and tools/demo_data.py's contain is
# allowed: containers, strings, numbers, and numpy's array reconstruction.

_MULTIARRAY = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray  # numpy 2 renamed numpy.core
SAFE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _MULTIARRAY._reconstruct,  # how numpy 1 (the official files) names it
    ("numpy._core.multiarray", "_reconstruct"): _MULTIARRAY._reconstruct,  # numpy 2
    ("numpy.core.multiarray", "scalar"): _MULTIARRAY.scalar,
    ("numpy._core.multiarray", "scalar"): _MULTIARRAY.scalar,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,  # bytes in a protocol-2 pickle written by Python 3
}


class SafeUnpickler(pickle.Unpickler):
    """pickle.Unpickler that constructs nothing but SAFE_GLOBALS: any other global (posix.system,
    builtins.eval, a class) is refused by name before it is looked up."""

    def find_class(self, module, name):
        try:
            return SAFE_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused global {module}.{name}") from None


def load_pickle(path):
    """The object of a CIFAR pickle file, read with SafeUnpickler (latin-1: the official files
    are Python 2 pickles, read as torchvision reads them). A refused global is one line naming
    the file and the global; nothing of the file has run."""
    with open(path, "rb") as f:
        try:
            return SafeUnpickler(f, encoding="latin1").load()
        except pickle.UnpicklingError as err:
            if str(err).startswith("refused global"):
                raise RefusedData(f"{path} holds a pickle that would run code ({str(err)}), not CIFAR data: refused, "
                                  "nothing in it was run; replace it with the official file") from None
            raise


def check_official(root, spec, split, name):
    """A file as large as the official one (its images' pixels alone fill that much) must be the
    official one: its md5 is compared with torchvision's record, as torchvision does. True when
    it is that file, False for a smaller copy (nothing to compare)."""
    path = file_path(root, spec, name)
    images = spec.split_sizes[split] // len(spec.files[split])
    if path.stat().st_size < images * int(np.prod(spec.image_shape)):
        return False  # a small copy (tools/demo_data.py, the tests): no official md5 to compare
    official = dict(_official_md5s(spec)).get(name)
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if official and digest.hexdigest() != official:
        raise RefusedData(f"{path} has the official file's size but not its md5 ({digest.hexdigest()}, official "
                          f"{official}): damaged or altered; {_refetch(root, spec)}")
    return bool(official)


def _official_md5s(spec):
    """(file name, md5) of the official archive's files, from torchvision's CIFAR class."""
    import torchvision.datasets

    source = getattr(torchvision.datasets, spec.source)
    return [*source.train_list, *source.test_list, (source.meta["filename"], source.meta["md5"])]


def default_data_dir() -> Path:
    """``datasets/`` beside the scripts (train.py's folder, which holds engine/), as in the guide."""
    return Path(__file__).resolve().parents[1] / "datasets"


def data_root(root, spec) -> Path:
    """The folder that holds ``spec.folder``. --data-dir naming the data set's own folder
    (.../cifar-100-python, .../FashionMNIST or .../FashionMNIST/raw) is a common slip: it
    means its parent, unless the data set's folder really is inside it."""
    root = Path(root)
    parts = Path(spec.folder).parts
    for k in range(len(parts), 0, -1):
        if root.parts[-k:] == parts[:k] and not (root / spec.folder).exists():
            return root.parents[k - 1]
    return root


def fetch_hint(root, spec) -> str:
    return f"python dataset_utils.py --dataset {spec.name} --data-dir {root}"


def file_path(root, spec, name):
    """Where file ``name`` of ``spec`` is: an idx file may be stored gzipped (name.gz) too."""
    path = Path(root) / spec.folder / name
    if spec.is_idx and not path.is_file() and path.with_name(name + ".gz").is_file():
        return path.with_name(name + ".gz")
    return path


def missing_files(root, spec) -> list:
    return [name for name in spec.all_files() if not file_path(root, spec, name).is_file()]


# ---------------------------------------------------------------------------------------------
# Fetching.

def prepare(root, spec, download=True):
    """Make sure the files are in ``root``, downloading them if allowed. One line on failure,
    naming what is missing; a failed download leaves nothing behind that was not there."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise DatasetError(f"--data-dir {root} is a file, not a directory")
    missing = missing_files(root, spec)
    if not missing:
        return
    what = (f"{spec.title} not found in {root / spec.folder}" if len(missing) == len(spec.all_files())
            else f"{spec.title} in {root / spec.folder} is incomplete: {', '.join(missing)} missing")
    if not download:
        raise DatasetError(f"{what}; fetch it first with: {fetch_hint(root, spec)}")
    created = _new_folders(root / spec.folder)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp, _no_answer_after(DOWNLOAD_STALL_S):
            (_download_idx if spec.is_idx else _download_cifar)(root, spec, Path(tmp))
    except (OSError, RuntimeError, tarfile.TarError, EOFError) as err:
        _remove_empty(created)
        reason = (f"no answer from the network for {DOWNLOAD_STALL_S:g} s" if _timed_out(err)
                  else " ".join(str(err).split()) or type(err).__name__)
        raise DatasetError(f"{what} and downloading it failed ({reason}); on a machine with internet (e.g. a "
                           f"login node) run: {fetch_hint(root, spec)}") from None
    except BaseException:  # Ctrl-C: the temporary folder is gone, and so are the folders made for it
        _remove_empty(created)
        raise


@contextmanager
def _no_answer_after(seconds):
    """Every socket opened inside (urllib's, in torchvision's download) gives up when a connect
    or a read waits longer than ``seconds``: a stalled download fails instead of hanging. A
    slow but moving download is not cut: the limit is per read, not for the whole file."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def _timed_out(err):
    """urllib reports a socket timeout as TimeoutError or as URLError(reason=TimeoutError)."""
    return isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError)


def _remove_empty(folders):
    for folder in folders:  # deepest first; only if still empty
        try:
            folder.rmdir()
        except OSError:
            pass


def _new_folders(folder):
    """The folders of ``folder``'s path that do not exist yet, deepest first."""
    folder = Path(folder).absolute()
    return [p for p in (folder, *folder.parents) if not p.exists()]


def _move_into_place(source, target):
    """Move ``source`` to ``target`` unless a file is there already (never overwritten)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        shutil.move(str(source), target)  # a rename on one file system


def _download_cifar(root, spec, tmp):
    """The official archive (md5-checked by torchvision), unpacked in ``tmp``, then each missing
    file moved into place."""
    import torchvision.datasets
    from torchvision.datasets.utils import download_url

    source = getattr(torchvision.datasets, spec.source)
    print(f"Downloading {spec.title} from {source.url} into {root}", flush=True)
    download_url(source.url, str(tmp), source.filename, source.tgz_md5)
    with tarfile.open(tmp / source.filename, "r:gz") as archive:
        # filter="data" refuses links and paths outside tmp (Python >= 3.11.4 / 3.12).
        archive.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    for name in missing_files(root, spec):
        _move_into_place(tmp / source.base_folder / name, root / spec.folder / name)


def _download_idx(root, spec, tmp):
    """Each missing file, gzipped, from the first of torchvision's mirrors that serves it
    (md5-checked), then moved into place; it is read gzipped."""
    import torchvision.datasets
    from torchvision.datasets.utils import download_url

    source = getattr(torchvision.datasets, spec.source)
    md5s = dict(source.resources)
    for name in missing_files(root, spec):
        errors = []
        for mirror in source.mirrors:
            print(f"Downloading {spec.title} {name} from {mirror}{name}.gz into {root}", flush=True)
            try:
                download_url(f"{mirror}{name}.gz", str(tmp), f"{name}.gz", md5s[f"{name}.gz"])
                break
            except (OSError, RuntimeError) as err:
                if _timed_out(err):  # the network does not answer: the next mirror would not either
                    raise
                errors.append(f"{mirror}: {' '.join(str(err).split()) or type(err).__name__}")
        else:
            raise RuntimeError("; ".join(errors))
        _move_into_place(tmp / f"{name}.gz", root / spec.folder / f"{name}.gz")


# ---------------------------------------------------------------------------------------------
# Reading.

def read_split(root, split, spec):
    """One split: (images uint8 (N, H, W, C), labels int64 (N,)), checked."""
    reader = _read_idx if spec.is_idx else _read_cifar
    images, labels = reader(root, split, spec)
    if len(labels) and (labels.min() < 0 or labels.max() >= spec.num_classes):
        path = file_path(root, spec, spec.files[split][-1])
        raise DatasetError(f"{path} is corrupted: labels outside 0..{spec.num_classes - 1}; "
                           f"{_refetch(root, spec)}", same_on_every_rank=False)
    return images, labels


def _refetch(root, spec):
    return f"delete it and fetch again with: {fetch_hint(root, spec)}"


def _read_cifar(root, split, spec):
    """Pickled dicts: 'data' (N, H * W * C) uint8 in R, G, B planes per image, and the labels
    ('fine_labels' in CIFAR-100, 'labels' in CIFAR-10). A training split of several files
    (CIFAR-10's five batches) is concatenated."""
    height, width, channels = spec.image_shape
    pixels, key = height * width * channels, spec.label_key
    parts = []
    for name in spec.files[split]:
        path = file_path(root, spec, name)
        intact = False
        try:
            intact = check_official(root, spec, split, name)
            entry = load_pickle(path)
            data, labels = np.asarray(entry["data"]), np.asarray(entry[key], dtype=np.int64)
        except FileNotFoundError:
            raise DatasetError(f"{path} is missing; {_refetch(root, spec)}", same_on_every_rank=False) from None
        except RefusedData:
            raise
        except Exception as err:  # a damaged pickle can raise almost anything
            if intact:  # the official bytes: the cause is elsewhere (a numpy half imported by a Ctrl-C, say)
                raise DatasetError(f"{path} could not be read ({type(err).__name__}: {err}), although it is the "
                                   "official file (its md5 checked): keep it, and run again or check the Python "
                                   "environment", same_on_every_rank=False) from None
            raise DatasetError(f"{path} is truncated or corrupted ({type(err).__name__}: {err}); "
                               f"{_refetch(root, spec)}", same_on_every_rank=False) from None
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != pixels or len(labels) != len(data):
            raise DatasetError(f"{path} is corrupted: expected uint8 data of shape (N, {pixels}) with N labels, "
                               f"found {data.dtype} {data.shape} with {len(labels)} labels; {_refetch(root, spec)}",
                               same_on_every_rank=False)
        parts.append((data, labels))
    data = np.concatenate([d for d, _ in parts])
    images = data.reshape(-1, channels, height, width).transpose(0, 2, 3, 1)  # planes -> (N, H, W, C)
    return np.ascontiguousarray(images), np.concatenate([labels for _, labels in parts])


def class_names(root, spec):
    """The names of the data set's classes, label i's at i (the CIFAR files', checked)."""
    return spec.names if spec.is_idx else _read_meta(root, spec)


def _read_meta(root, spec):
    """The class names in CIFAR's meta file (meta, batches.meta), read as safely as the data: a
    pickle planted there runs nothing either, and one that is not a dict of names is one line."""
    (name,) = spec.extra_files
    path = file_path(root, spec, name)
    try:
        meta = load_pickle(path)
    except RefusedData:
        raise
    except Exception as err:
        raise DatasetError(f"{path} is truncated or corrupted ({type(err).__name__}: {err}); {_refetch(root, spec)}",
                           same_on_every_rank=False) from None
    # CIFAR-100's fine_label_names (its 20 coarse ones are the other list), CIFAR-10's label_names
    names = [v for v in meta.values() if isinstance(v, list) and len(v) == spec.num_classes] \
        if isinstance(meta, dict) else []
    if not names or not all(isinstance(name, (str, bytes)) for name in names[0]):
        raise DatasetError(f"{path} is corrupted: not a dict with the names of the {spec.num_classes} classes; "
                           f"{_refetch(root, spec)}", same_on_every_rank=False)
    return tuple(name.decode("latin-1") if isinstance(name, bytes) else name for name in names[0])


def _read_idx(root, split, spec):
    """The idx format of MNIST and Fashion-MNIST: a big-endian header (magic number, then one
    int32 per dimension), then uint8 data; images (N, 28, 28), labels (N,)."""
    image_name, label_name = spec.files[split]
    images = _read_idx_file(root, spec, image_name, IDX_IMAGES, spec.image_shape[:2])
    labels = _read_idx_file(root, spec, label_name, IDX_LABELS, ())
    if len(images) != len(labels):
        raise DatasetError(f"{file_path(root, spec, label_name)} holds {len(labels)} labels for "
                           f"{len(images)} images; {_refetch(root, spec)}", same_on_every_rank=False)
    return images[..., None], labels.astype(np.int64)  # (N, H, W, 1)


def _read_idx_file(root, spec, name, magic, item_shape):
    path = file_path(root, spec, name)
    dims = 1 + len(item_shape)
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DatasetError(f"{path} is missing; {_refetch(root, spec)}", same_on_every_rank=False) from None
    except (OSError, EOFError) as err:  # gzip: a cut or damaged archive
        raise DatasetError(f"{path} is truncated or corrupted ({type(err).__name__}: {err}); "
                           f"{_refetch(root, spec)}", same_on_every_rank=False) from None
    header = np.frombuffer(raw[:4 * (1 + dims)], dtype=">i4") if len(raw) >= 4 * (1 + dims) else None
    if header is None or header[0] != magic or tuple(header[2:]) != tuple(item_shape):
        found = "too short" if header is None else f"header {header.tolist()}"
        raise DatasetError(f"{path} is corrupted: not an idx file of uint8 items of shape {item_shape} "
                           f"(magic {magic}), {found}; {_refetch(root, spec)}", same_on_every_rank=False)
    count, body = int(header[1]), raw[4 * (1 + dims):]
    expected = count * int(np.prod(item_shape, dtype=np.int64))
    if len(body) != expected:
        raise DatasetError(f"{path} is truncated or corrupted: {len(body)} bytes of data for {count} items "
                           f"({expected} expected); {_refetch(root, spec)}", same_on_every_rank=False)
    return np.frombuffer(body, dtype=np.uint8).reshape(count, *item_shape).copy()

