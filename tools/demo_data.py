"""Small learnable data sets in every on-disk format the scripts read, for demos and tests
(CIFAR-100 and the others cannot always be downloaded; a compute node has no internet):

    python tools/demo_data.py --dataset folder my_images    # my_images/train/CLASS/*.png|jpg, my_images/test/...
    python tools/demo_data.py --dataset photos my_photos    # photos of varied sizes in my_photos/CLASS/
    python tools/demo_data.py --dataset cifar100 demo       # demo/cifar-100-python/{train,test,meta}
    python tools/demo_data.py --dataset real-photos crops   # crops of 8 real photographs (pip install scikit-image)

Each class is a colour plus noise, so a network learns it in a few epochs: a check that
data, augmentation and training work end to end, not a score to compare. real-photos is the
exception: crops of real photographs, whose class is the photograph they were cut from, for
comparing recipes on real pixels (docs/recipe.md's table).
"""

import gzip
import importlib.util
import pickle
import sys
from pathlib import Path

import numpy as np
from PIL import Image

if __package__ in (None, ""):  # run as python tools/NAME.py: the project's modules are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli import OneLineParser  # noqa: E402
from engine.task import DATASETS  # noqa: E402

def learnable_images(labels, rng, height, width, channels, classes=10):
    """uint8 images (N, height, width, channels) a network can learn to classify: a colour set
    by the label (``classes`` levels 200 / classes apart per channel) plus noise of standard
    deviation 20."""
    labels = np.asarray(labels)[:, None, None, None]
    step = 200 // classes
    colour = 28 + (labels * step + np.arange(channels) * 70) % (step * classes)  # (N, 1, 1, C)
    return np.clip(colour + rng.normal(0, 20, (len(labels), height, width, channels)), 0, 255).astype(np.uint8)


def write_cifar100(root, n_train=64, n_test=40, seed=0, test_labels=None, classes=100, learnable=False):
    """Write cifar-100-python/{train,test,meta} as the official archive has them: pickled
    dicts with 'data' (N, 3072) uint8 in R, G, B planes and 'fine_labels'. ``learnable``:
    images of ``classes`` colours (learnable_images) instead of noise."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(0, classes, n).tolist()
        if split == "test" and test_labels is not None:
            labels = list(test_labels)
        if learnable:  # stored as R, G, B planes per image
            data = learnable_images(labels, rng, 32, 32, 3, classes).transpose(0, 3, 1, 2).reshape(n, 3072)
        else:
            data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        entry = {
            "filenames": [f"image_{i}.png" for i in range(n)],
            "batch_label": f"{split} batch 1 of 1",
            "fine_labels": labels,
            "coarse_labels": [label // 5 for label in labels],
            "data": data,
        }
        with open(folder / split, "wb") as f:
            pickle.dump(entry, f, protocol=2)
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"class_{i}" for i in range(100)],
                     "coarse_label_names": [f"super_{i}" for i in range(20)]}, f, protocol=2)
    return Path(root)


def _labels_and_images(rng, n, classes, shape, learnable):
    """(labels list of 0..classes-1, uint8 images (n, H, W, C)): noise, or learnable_images."""
    labels = rng.integers(0, classes, n).tolist()
    if learnable:
        return labels, learnable_images(labels, rng, *shape, classes=classes)
    return labels, rng.integers(0, 256, (n, *shape), dtype=np.uint8)


def write_cifar10(root, n_train=50, n_test=20, seed=0, classes=10, learnable=False):
    """cifar-10-batches-py/ as the official archive has it: data_batch_1..5 (the training
    images split in 5), test_batch and batches.meta, pickled dicts with 'data' (N, 3072)
    uint8 in R, G, B planes and 'labels'."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    batches = [(f"data_batch_{i + 1}", n) for i, n in enumerate(np.diff(np.linspace(0, n_train, 6).astype(int)))]
    for name, n in (*batches, ("test_batch", n_test)):
        labels, images = _labels_and_images(rng, int(n), classes, (32, 32, 3), learnable)
        entry = {"batch_label": name, "labels": labels, "filenames": [f"{i}.png" for i in range(int(n))],
                 "data": images.transpose(0, 3, 1, 2).reshape(int(n), 3072)}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class_{i}" for i in range(10)], "num_cases_per_batch": n_train // 5}, f)
    return Path(root)


def idx_bytes(array, magic):
    """The idx format: magic number and dimensions as big-endian int32, then the uint8 data."""
    return np.array([magic, *array.shape], dtype=">i4").tobytes() + array.astype(np.uint8).tobytes()


def write_idx(root, folder, n_train=60, n_test=20, seed=0, classes=10, learnable=False, gzipped=False):
    """MNIST or Fashion-MNIST as torchvision keeps them: ``folder`` (MNIST or FashionMNIST)/raw/
    {train,t10k}-{images-idx3,labels-idx1}-ubyte, gzipped (.gz, as downloaded) or not."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels, images = _labels_and_images(rng, n, classes, (28, 28, 1), learnable)
        for name, data in ((f"{prefix}-images-idx3-ubyte", idx_bytes(images[..., 0], 2051)),
                           (f"{prefix}-labels-idx1-ubyte", idx_bytes(np.array(labels), 2049))):
            if gzipped:
                (raw / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (raw / name).write_bytes(data)
    return Path(root)


def write_dataset(root, name, learnable=False, classes=None, **options):
    """A tiny copy of data set ``name`` (a --dataset value) in its real on-disk format, with
    labels 0..classes-1 (default: 10 for learnable images, else all of the data set's)."""
    classes = classes or (10 if learnable or name != "cifar100" else 100)
    if name == "cifar100":
        return write_cifar100(root, classes=classes, learnable=learnable, **options)
    if name == "cifar10":
        return write_cifar10(root, classes=classes, learnable=learnable, **options)
    folder = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}[name]
    return write_idx(root, folder, classes=classes, learnable=learnable, **options)


def write_image_folder(root, classes=4, n_train=32, n_test=8, seed=0, sizes=((32, 32), (40, 48)),
                       formats=("png", "jpg"), gray_every=3, stray=True):
    """An image folder in torchvision's ImageFolder layout, as users have them:
    root/{train,test}/class_K/image_I.{png,jpg} with ``n_train`` and ``n_test`` images per
    class. Image i is saved as formats[i % len(formats)], in size sizes[i % 4 == 3] (one in
    four the second size), and gray when i % gray_every == 0 (0: never). ``stray``: a
    notes.txt and a hidden file beside the images, which are not images."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    for split, n in (("train", n_train), ("test", n_test)):
        for label in range(classes):
            folder = root / split / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                height, width = sizes[min(i % 4 == 3, len(sizes) - 1)]
                pixels = learnable_images([label], rng, height, width, 3, classes)[0]
                image = Image.fromarray(pixels)
                if gray_every and i % gray_every == 0:
                    image = image.convert("L")
                image.save(folder / f"image_{i}.{formats[i % len(formats)]}")
        if stray:
            (root / split / "class_0" / "notes.txt").write_text("not an image\n")
            (root / split / "class_0" / ".DS_Store").write_bytes(b"\0")
    return root


# A folder of photos as users have them: one folder per class and nothing else (no train/ or
# test/), JPEGs and PNGs of varied sizes (60x80 to 500x333), some gray, one CMYK, upper-case .JPG
# endings, a class name with a space, and stray files that are not images.
PHOTO_SIZES = ((60, 80), (333, 500), (120, 90), (96, 128), (200, 150))  # (height, width)
PHOTO_CLASSES = ("cat", "dog", "red panda")
PHOTO_COLOURS = ((200, 60, 40), (40, 180, 70), (50, 70, 210))


def photo(rng, label, height, width):
    """uint8 (H, W, 3): the class's colour in a random ellipse on a noisy background."""
    pixels = rng.integers(0, 120, (height, width, 3)).astype(np.float64)
    rows, cols = np.mgrid[:height, :width]
    cy, cx = rng.uniform(0.35, 0.65) * height, rng.uniform(0.35, 0.65) * width
    inside = ((rows - cy) / (0.35 * height)) ** 2 + ((cols - cx) / (0.35 * width)) ** 2 <= 1
    pixels[inside] = np.asarray(PHOTO_COLOURS[label]) + rng.normal(0, 20, (inside.sum(), 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def write_photo_folder(root, per_class=20, seed=0, classes=PHOTO_CLASSES):
    """root/CLASS/NAME for ``per_class`` images of each class; returns root."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    for label, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            height, width = PHOTO_SIZES[i % len(PHOTO_SIZES)]
            image = Image.fromarray(photo(rng, label, height, width))
            if i % 7 == 3:
                image = image.convert("L")  # a gray photo among colour ones
            if i % 2:
                image.save(folder / f"IMG_{i:04d}.JPG", quality=90)
            else:
                image.save(folder / f"img {i}.png")
        (folder / "Thumbs.db").write_bytes(b"\0" * 16)
    Image.fromarray(photo(rng, 0, 90, 120)).convert("CMYK").save(root / classes[0] / "print.jpg")
    (root / "README.txt").write_text("photos from the field trip\n")
    return root


# The photographs scikit-image ships in its wheel (skimage/data), one class each: what a crop of
# them shows is a real photo's texture, edges and colour (or its lack: camera is gray).
REAL_PHOTOS = {"astronaut": "astronaut.png", "camera": "camera.png", "cat": "chelsea.png", "coffee": "coffee.png",
               "hubble": "hubble_deep_field.jpg", "rocket": "rocket.jpg", "retina": "retina.jpg", "tissue": "ihc.png"}


def real_photos_folder():
    """scikit-image's folder of sample photographs, found without importing it (seconds); a
    one-line SystemExit when it is not installed."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: --dataset real-photos cuts its crops from the photographs scikit-image ships: "
                         "pip install scikit-image")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def write_real_photo_crops(root, per_class=104, seed=0, source=None):
    """root/CLASS/crop_I.{jpg,png}: ``per_class`` random crops of each REAL_PHOTOS photograph, a
    side of 12-45% of its shorter side, some shrunk by up to 2x (46 to 230 pixels here), one in
    three saved as PNG. Returns root."""
    rng, source, root = np.random.default_rng(seed), Path(source or real_photos_folder()), Path(root)
    for name, file in REAL_PHOTOS.items():
        photo_ = Image.open(source / file)
        photo_.load()
        width, height = photo_.size
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            side = int(rng.uniform(0.12, 0.45) * min(width, height))
            aspect = rng.uniform(0.75, 1.33)
            w, h = min(width, int(side * aspect ** 0.5)), min(height, int(side / aspect ** 0.5))
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            crop = photo_.crop((left, top, left + w, top + h))
            shrink = rng.uniform(1.0, 2.0)
            crop = crop.resize((max(8, round(w / shrink)), max(8, round(h / shrink))), Image.BILINEAR)
            if i % 3:
                crop.convert("RGB" if crop.mode not in ("L", "RGB") else crop.mode).save(
                    root / name / f"crop_{i:03d}.jpg", quality=90)
            else:
                crop.save(root / name / f"crop_{i:03d}.png")
    return root


def build_parser():
    parser = OneLineParser(description="Write a small learnable copy of a data set into DIR (each class a "
                                       "colour plus noise), to try the scripts without downloading: 512 training "
                                       "and 128 test images of 10 classes in the data set's own format, or for "
                                       "folder an image folder of 4 classes with PNG and JPEG, RGB and gray "
                                       "images of two sizes.")
    parser.add_argument("--dataset", choices=(*DATASETS, "folder", "photos", "real-photos"), default="cifar100",
                        help="which format (folder: DIR/train/CLASS/IMAGE and DIR/test/CLASS/IMAGE; photos: "
                             "DIR/CLASS/IMAGE, photos of varied sizes; real-photos: DIR/CLASS/IMAGE, 104 crops of "
                             "each of 8 photographs scikit-image ships, the class being the photograph)")
    parser.add_argument("directory", metavar="DIR", type=Path,
                        help="where to write it: a new folder, or one of built-in data sets only for another "
                             "built-in one (never over a copy, never into an image folder)")
    return parser


def main(argv=None):
    """``python tools/demo_data.py --dataset NAME DIR``: never writes over an existing copy."""
    parser = build_parser()
    args = parser.parse_args(argv)
    root, dataset = args.directory, args.dataset
    if root.exists() and not root.is_dir():
        print(f"error: {root} is a file, not a folder; give a new folder", file=sys.stderr)
        return 2
    first = {"folder": "train", "photos": PHOTO_CLASSES[0], "real-photos": next(iter(REAL_PHOTOS))}  # a copy's
    target = root / (first[dataset] if dataset in first else DATASETS[dataset].folder)
    if target.exists():
        print(f"error: {target} exists already; give another folder", file=sys.stderr)
        return 2
    # An image folder's classes are its folders: it needs a folder of its own, which no other data set may join
    # (hidden files aside; built-in sets sit side by side, with the image cache, as in datasets/).
    present = sorted(path.name for path in root.iterdir() if not path.name.startswith(".")) if root.is_dir() else []
    beside = {Path(spec.folder).parts[0] for spec in DATASETS.values()} | {"cache"}
    others = present if dataset in first else [name for name in present if name not in beside]
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        where = ("an image folder needs a new or empty folder" if dataset in first
                 else "a built-in data set goes into a new folder or beside other built-in ones")
        print(f"error: {root} holds {shown}: {where} (mixed, neither would read as it should)", file=sys.stderr)
        return 2
    try:
        if dataset == "real-photos":
            write_real_photo_crops(root)
            print(f"Wrote 104 crops of each of {len(REAL_PHOTOS)} photographs ({', '.join(REAL_PHOTOS)}; JPEG and "
                  f"PNG) into {root}, one folder per class: train with --dataset folder --data-dir {root} "
                  "--val-fraction 0.2")
        elif dataset == "photos":
            write_photo_folder(root)
            print(f"Wrote {len(PHOTO_CLASSES)} classes of photos ({', '.join(PHOTO_CLASSES)}; 20 each, and a CMYK "
                  f"print among the {PHOTO_CLASSES[0]}s; JPEG and PNG, 60x80 to 500x333 pixels) into {root}, one "
                  f"folder per class: train with --dataset folder --data-dir {root} --val-fraction 0.2")
        elif dataset == "folder":
            write_image_folder(root, classes=4, n_train=64, n_test=16)
            print(f"Wrote an image folder of 4 classes (64 training and 16 test images each; PNG and JPEG, RGB and "
                  f"gray, 32x32 and 40x48) into {root}: train with --dataset folder --data-dir {root}")
        else:
            write_dataset(root, dataset, learnable=True, n_train=512, n_test=128)
            print(f"Wrote a learnable 10-class copy of {DATASETS[dataset].title} (512 training and 128 test images) "
                  f"into {root}: train with --dataset {dataset} --data-dir {root}")
    except OSError as err:  # a parent that is a file, no permission, a full disk: not a traceback
        print(f"error: cannot write {err.filename or root}: {err.strerror or err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
