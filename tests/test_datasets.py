"""--dataset: CIFAR-10, Fashion-MNIST and MNIST beside CIFAR-100. Each is written by the tests
in its real on-disk format (nothing is downloaded), read and checked, augmented its own way,
and trained through the entry points."""

import gzip
import io
import json
import re
import tarfile
import urllib.error

import numpy as np
from pathlib import Path

import pytest
import torch
import torchvision
import torchvision.transforms.functional as TF

import dataset_utils as du
import recipe
from engine import data_formats, errors, task
from conftest import (FAST, REPO, SMALL_MODEL, TINY_MODEL, clean_env, error_lines, idx_bytes, python_cmd,
                      read_metrics, run, run_main, torchrun_cmd, write_cifar10, write_dataset, write_idx,
                      write_image_folder)
from model import WideResNet

NAMES = tuple(task.DATASETS)
TORCHVISION = {"cifar100": torchvision.datasets.CIFAR100, "cifar10": torchvision.datasets.CIFAR10,
               "fashion-mnist": torchvision.datasets.FashionMNIST, "mnist": torchvision.datasets.MNIST}


@pytest.mark.parametrize("name", NAMES)
def test_reader_matches_torchvision(tmp_path, monkeypatch, name):
    spec = task.DATASETS[name]
    root = write_dataset(tmp_path, name, n_train=25, n_test=10)
    # torchvision checks the official md5 sums of CIFAR's files, which a tiny copy cannot match.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: True)
    for split in ("train", "test"):
        images, labels = data_formats.read_split(root, split, spec)
        reference = TORCHVISION[name](str(tmp_path), train=split == "train", download=False)
        expected = np.asarray(reference.data)
        assert images.dtype == np.uint8 and images.shape == (len(expected), *spec.image_shape)
        np.testing.assert_array_equal(images[..., 0] if spec.channels == 1 else images, expected)
        assert labels.tolist() == list(np.asarray(reference.targets))
    # The class names predict.py prints (torchvision's MNIST says "0 - zero": the digit is enough).
    names = [c.split(" - ")[0] for c in reference.classes] if name == "mnist" else reference.classes
    assert list(data_formats.class_names(root, spec)) == names


def test_idx_files_read_the_same_gzipped(tmp_path):
    spec = task.DATASETS["fashion-mnist"]
    plain = write_idx(tmp_path / "plain", "FashionMNIST", seed=4)
    packed = write_idx(tmp_path / "packed", "FashionMNIST", seed=4, gzipped=True)  # as downloaded
    assert (packed / "FashionMNIST" / "raw" / "train-images-idx3-ubyte.gz").exists()
    for split in ("train", "test"):
        for a, b in zip(data_formats.read_split(plain, split, spec), data_formats.read_split(packed, split, spec)):
            np.testing.assert_array_equal(a, b)


def _damage(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif how == "header":
        path.write_bytes(b"\x00\x00\x09\x99" + data[4:])
    else:
        path.unlink()


# (data set, file, damage, what the one line says after the file's path)
BAD_FILES = [
    ("cifar10", "data_batch_3", "truncated", " is truncated or corrupted (UnpicklingError"),
    ("cifar10", "test_batch", "missing", " is missing; delete it and fetch again with: python dataset_utils.py "
                                         "--dataset cifar10"),
    ("mnist", "train-images-idx3-ubyte", "truncated", " is truncated or corrupted: 23512 bytes of data for 60 items "
                                                      "(47040 expected)"),
    ("mnist", "t10k-labels-idx1-ubyte", "header", " is corrupted: not an idx file of uint8 items of shape () "
                                                  "(magic 2049)"),
    ("fashion-mnist", "train-labels-idx1-ubyte.gz", "truncated", " is truncated or corrupted (EOFError"),
]


@pytest.mark.parametrize("name, file, how, expected", BAD_FILES, ids=[f"{n}-{f}-{h}" for n, f, h, _ in BAD_FILES])
def test_a_bad_file_is_one_line_naming_it(tmp_path, name, file, how, expected):
    spec = task.DATASETS[name]
    root = write_dataset(tmp_path, name, gzipped=True) if file.endswith(".gz") else write_dataset(tmp_path, name)
    path = root / spec.folder / file
    _damage(path, how)
    split = "test" if file.startswith(("test", "t10k")) else "train"
    with pytest.raises(errors.DatasetError) as info:
        data_formats.read_split(root, split, spec)
    message = str(info.value)
    assert message.startswith(f"{path}{expected}") and "\n" not in message


@pytest.mark.parametrize("name", ["cifar10", "mnist"])
def test_a_missing_file_is_named_before_anything_is_read(tmp_path, name, capsys):
    spec = task.DATASETS[name]
    root = write_dataset(tmp_path, name)
    missing = spec.files["train"][0]
    (root / spec.folder / missing).unlink()
    code = run_main("train.py", "--dataset", name, "--data-dir", root, "--no-download", *FAST)
    assert code == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: {spec.title} in {root / spec.folder} is incomplete: {missing} missing; fetch it first with: "
        f"python dataset_utils.py --dataset {name} --data-dir {root}"]


def test_labels_beyond_the_classes_are_refused(tmp_path):
    spec = task.DATASETS["mnist"]
    root = write_idx(tmp_path, "MNIST", n_test=3)
    (root / spec.folder / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.array([1, 10, 2]), 2049))
    with pytest.raises(errors.DatasetError, match=r"t10k-labels-idx1-ubyte is corrupted: labels outside 0\.\.9"):
        data_formats.read_split(root, "test", spec)


def test_idx_download_tries_the_mirrors_and_keeps_present_files(tmp_path, monkeypatch):
    source = write_idx(tmp_path / "source", "MNIST", gzipped=True)
    calls = []

    def fake_download(url, root, filename, md5):
        calls.append((url, md5))
        if url.startswith(torchvision.datasets.MNIST.mirrors[0]):
            raise urllib.error.URLError("mirror down")
        (Path(root) / filename).write_bytes((source / "MNIST" / "raw" / filename).read_bytes())
    monkeypatch.setattr(torchvision.datasets.utils, "download_url", fake_download)
    root = tmp_path / "datasets"
    kept = root / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    kept.parent.mkdir(parents=True)
    kept.write_bytes((source / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz").read_bytes())
    kept.write_bytes(gzip.decompress(kept.read_bytes()))  # present, uncompressed: not fetched again
    assert run_main("dataset_utils.py", "--dataset", "mnist", "--data-dir", root) == 0
    md5s = dict(torchvision.datasets.MNIST.resources)
    assert [(url.rsplit("/", 1)[1], md5) for url, md5 in calls[1::2]] == [
        (name, md5s[name]) for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                                        "t10k-images-idx3-ubyte.gz")]
    assert sorted(p.name for p in (root / "MNIST" / "raw").iterdir()) == [
        "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte", "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz"]
    assert sorted(p.name for p in root.iterdir()) == ["MNIST"]  # no temporary folder left
    assert len(data_formats.read_split(root, "train", task.DATASETS["mnist"])[1]) == 60


def test_an_official_file_that_fails_to_read_is_not_called_corrupted(tmp_path, monkeypatch):
    """A file whose md5 is the official one is intact: when reading it fails all the same (a
    numpy left half imported by a Ctrl-C while Python started, seen in a walk), the line says to
    keep it, not to delete it and fetch again (no internet on a compute node)."""
    spec = task.DATASETS["cifar10"]
    root = write_dataset(tmp_path, "cifar10")
    monkeypatch.setattr(data_formats, "check_official", lambda *args: True)  # as the real files are

    def half_imported(path):
        raise AttributeError("module 'numpy' has no attribute 'multiply'")
    monkeypatch.setattr(data_formats, "load_pickle", half_imported)
    with pytest.raises(errors.DatasetError) as info:
        data_formats.read_split(root, "train", spec)
    assert str(info.value) == (
        f"{root / 'cifar-10-batches-py' / 'data_batch_1'} could not be read (AttributeError: module 'numpy' has no "
        "attribute 'multiply'), although it is the official file (its md5 checked): keep it, and run again or check "
        "the Python environment")
    monkeypatch.setattr(data_formats, "check_official", lambda *args: False)  # a copy of another size: maybe damaged
    with pytest.raises(errors.DatasetError, match="is truncated or corrupted .*; delete it and fetch again"):
        data_formats.read_split(root, "train", spec)


def test_fetching_ahead_names_a_copy_that_is_not_the_official_size(tmp_path, capsys):
    """tools/demo_data.py's small CIFAR-10 in the default folder is no fetched data set: said so
    as train.py says it, not just "ready"."""
    write_dataset(tmp_path, "cifar10")
    assert run_main("dataset_utils.py", "--dataset", "cifar10", "--data-dir", tmp_path) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"CIFAR-10 ready in {tmp_path / 'cifar-10-batches-py'}: 50 training and 20 test images",
        "WARNING: this CIFAR-10 has 50 training images instead of 50000 and 20 test images instead of 10000: a "
        "small copy (tools/demo_data.py), an incomplete one, or other files?"]


def test_a_failed_idx_download_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    def offline(url, root, filename, md5):
        (Path(root) / filename).write_bytes(b"\x1f\x8b partial")
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torchvision.datasets.utils, "download_url", offline)
    assert run_main("dataset_utils.py", "--dataset", "fashion-mnist", "--data-dir", tmp_path / "datasets") == 2
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: Fashion-MNIST not found in {tmp_path / 'datasets' / 'FashionMNIST' / 'raw'} and "
                           "downloading it failed (http://fashion-mnist")
    assert list(tmp_path.iterdir()) == []


def test_cifar10_download_unpacks_the_official_layout(tmp_path, monkeypatch):
    source = write_cifar10(tmp_path / "source")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")

    def fake_download(url, root, filename, md5):
        assert (url, filename, md5) == (torchvision.datasets.CIFAR10.url, torchvision.datasets.CIFAR10.filename,
                                        torchvision.datasets.CIFAR10.tgz_md5)
        (Path(root) / filename).write_bytes(buffer.getvalue())
    monkeypatch.setattr(torchvision.datasets.utils, "download_url", fake_download)
    data_formats.prepare(tmp_path / "datasets", task.DATASETS["cifar10"])
    images, labels = data_formats.read_split(tmp_path / "datasets", "train", task.DATASETS["cifar10"])
    assert images.shape == (50, 32, 32, 3) and len(labels) == 50


# ---------------------------------------------------------------------------------------------
# Augmentation and normalization per data set.

@pytest.mark.parametrize("name", NAMES)
def test_augmentation_stays_within_the_padding_and_flips_only_where_allowed(name):
    spec = task.DATASETS[name]
    prep = du.spec_preprocessing(spec)
    # Pixel (r, c) holds r * W + c + 1: every output pixel says where it came from, 0 = padding.
    h, w, _ = spec.image_shape
    image = torch.arange(1, h * w + 1, dtype=torch.int64).view(1, h, w, 1).expand(20_000, -1, -1, -1)
    rand = prep.randoms(20_000, seed=0, epoch=0)
    out = du.augment(image, rand, prep.ops, prep)
    source = out[:, h // 2, w // 2, 0] - 1  # the centre always comes from the image
    top = source // w - h // 2 + spec.padding  # the crop's row offset in the padded image
    mirrored = out[:, h // 2, w // 2 + 1, 0] < out[:, h // 2, w // 2, 0]
    assert top.min() == 0 and top.max() == 2 * spec.padding
    if spec.augment == "flip-crop":
        assert abs(mirrored.double().mean().item() - 0.5) < 0.02
    else:
        assert spec.augment == "crop" and not mirrored.any()  # a mirrored 3 is not a 3


def test_padding_and_normalization_are_the_data_sets_own():
    assert [task.DATASETS[n].padding for n in NAMES] == [4, 4, 2, 2]
    assert [task.DATASETS[n].augment for n in NAMES] == ["flip-crop", "flip-crop", "flip-crop", "crop"]
    assert task.DATASETS["mnist"].mean == (0.1307,)
    assert task.DATASETS["cifar10"].mean != task.DATASETS["cifar100"].mean


@pytest.mark.parametrize("name", ["fashion-mnist", "mnist"])
def test_one_channel_crops_equal_torchvision_pixel_for_pixel(name):
    """The augmentation and normalization of both loaders against torchvision's transforms on
    the PIL image, for every offset within the padding (and both flips where flips are used)."""
    spec = task.DATASETS[name]
    prep = du.spec_preprocessing(spec, "flip-crop")
    image = np.random.default_rng(1).integers(0, 256, (28, 28, 1), dtype=np.uint8)
    pil = du.to_pil(image)
    assert pil.mode == "L"
    span = range(2 * spec.padding + 1)
    combos = [(top, left, flip) for top in span for left in span for flip in (False, True)]
    rand = torch.full((len(combos), 2, recipe.RANDOM_PER_OP), 0.5, dtype=torch.float64)
    for k, (top, left, flip) in enumerate(combos):
        rand[k, 0, 0] = 0.25 if flip else 0.75
        rand[k, 1, :2] = (torch.tensor([top, left], dtype=torch.float64) + 0.5) / (2 * spec.padding + 1)
    batch = torch.from_numpy(image).expand(len(combos), -1, -1, -1)
    scale_shift = du.normalization(spec.mean, spec.std, torch.uint8)
    on_device = du.normalize(du.augment(batch, rand, prep.ops, prep), *scale_shift)
    references = []
    for k, (top, left, flip) in enumerate(combos):
        cropped = TF.crop(TF.pad(TF.hflip(pil) if flip else pil, spec.padding), top, left, 28, 28)
        references.append(TF.normalize(TF.to_tensor(cropped), spec.mean, spec.std))  # (1, 28, 28)
        # The same pixels (one grey level apart is 0.014 here), normalized within float32 rounding.
        torch.testing.assert_close(on_device[k], references[k], rtol=0, atol=1e-6, msg=str((top, left, flip)))
    # The DataLoader's items (torchvision's transforms on the 1-channel tensor) are among them.
    dataset = du.InMemoryImages(image[None], np.zeros(1), prep).with_transform(recipe.loader_transforms(prep))
    for seed in range(20):
        assert any(torch.allclose(dataset[(0, seed)][0], reference, rtol=0, atol=1e-6) for reference in references)


def test_the_model_follows_the_data():
    for name in NAMES:
        spec = task.DATASETS[name]
        model = WideResNet(spec.num_classes, spec.channels).eval()
        height, width, channels = spec.image_shape
        with torch.no_grad():
            assert model(torch.zeros(2, channels, height, width)).shape == (2, spec.num_classes)
    with torch.no_grad():
        assert WideResNet(10, 1).eval()(torch.zeros(1, 1, 4, 4)).shape == (1, 10)  # the smallest size it names


# ---------------------------------------------------------------------------------------------
# Training through the entry points.

@pytest.mark.parametrize("name", NAMES)
def test_a_short_run_learns_each_data_set(tmp_path, name):
    """4 classes of colours plus noise: 12 steps of 16 images lower the training loss and beat
    chance (with a small network: the Wide ResNet's shapes per data set are checked above)."""
    root = write_dataset(tmp_path / "data", name, learnable=True, classes=4, n_train=64, n_test=32)
    metrics = tmp_path / "m.jsonl"
    result = run(python_cmd("train.py", "--dataset", name, "--data-dir", root, "--epochs", "3", "--batch-size", "16",
                            "--warmup-epochs", "0", "--patience", "4", "--base-lr", "0.1", "--metrics-file", metrics,
                            *SMALL_MODEL, *FAST), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    spec = task.DATASETS[name]
    assert f"on {spec.title} with Batch Size: 16" in result.stdout
    assert f"Augmentation: {du.spec_preprocessing(spec).describe()}" in result.stdout
    records = read_metrics(metrics)
    assert [r["dataset"] for r in records] == [name] * 3
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]
    assert max(r["val_accuracy"] for r in records) >= 0.5  # chance: 0.25


def test_resuming_on_another_data_set_is_refused(tmp_path, capsys):
    common = ("--synthetic", "--epochs", "2", "--limit-batches", "1", "--batch-size", "4",
              "--checkpoint-dir", tmp_path / "ck", *FAST)
    assert run_main("train.py", "--dataset", "mnist", *common) == 0
    capsys.readouterr()
    assert run_main("train.py", "--dataset", "fashion-mnist", *common, "--epochs", "3", "--resume") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: the checkpoint was trained on --dataset mnist, this run is --dataset fashion-mnist; resume with "
        "--dataset mnist, or start a new run in another --checkpoint-dir"]
    assert run_main("train.py", "--dataset", "mnist", *common, "--resume") == 0  # the same data set continues


def test_ddp_on_a_one_channel_data_set(tmp_path):
    root = write_dataset(tmp_path / "data", "fashion-mnist", n_train=32, n_test=15)
    metrics = tmp_path / "m.jsonl"
    result = run(torchrun_cmd(2, "train_ddp.py", "--dataset", "fashion-mnist", "--data-dir", root, "--epochs", "2",
                              "--batch-size", "8", "--metrics-file", metrics, "--save-weights", tmp_path / "w.pt",
                              *FAST), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WideResNet(num_classes=10, in_channels=1), 17.1 M parameters, on Fashion-MNIST" in result.stdout
    records = read_metrics(metrics)
    assert [(r["epoch"], r["world_size"], r["dataset"], r["val_samples"], r["train_images"]) for r in records] == [
        (1, 2, "fashion-mnist", 15, 32), (2, 2, "fashion-mnist", 15, 32)]
    WideResNet(10, 1).load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))  # the saved model's shape


def test_benchmark_and_job_script_take_the_data_set(tmp_path):
    # The tiny network: the data set's flag is under test, not the Wide ResNet's speed.
    result = run(python_cmd("tools/benchmark.py", "--quick", "--dataset", "mnist", "--steps", "1",
                            "--pipeline-batches", "2", "--data-dir", tmp_path / "none", *TINY_MODEL,
                            "--json", tmp_path / "rows.json"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {(row["dataset"], row["data"]) for row in rows} == {("mnist", "synthetic")}
    assert "--dataset mnist" in result.stdout  # the recipe line names it
    (tmp_path / "pytorch.sif").touch()
    env = clean_env(PATH=f"{REPO / 'tests' / 'stubs'}:{clean_env()['PATH']}", SLURM_JOB_ID="41", SLURM_SUBMIT_DIR=REPO,
                    CONTAINER_PATH=tmp_path / "pytorch.sif", PER_GPU_BATCH=4, GPU_LOG_INTERVAL=1)
    result = run(["bash", REPO / "singlegpu_job.sh", "--dataset", "mnist", "--synthetic", "--epochs", "1",
                  "--limit-batches", "1", "--metrics-file", "m.jsonl", *FAST, *TINY_MODEL], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["dataset"] for r in read_metrics(tmp_path / "m.jsonl")] == ["mnist"]


def test_held_out_images_are_not_called_test_images(capsys):
    """--val-fraction on a built-in data set: the Data line names the held-out split, and the
    official sizes, which the images read have, give no warning."""
    assert run_main("train.py", "--synthetic", "--val-fraction", "0.2", "--epochs", "1", "--limit-batches", "1",
                    "--batch-size", "8", *FAST) == 0
    out = capsys.readouterr().out
    # A fifth of each class of the random labels: about 10000 images, the same count on both lines.
    kept, held = map(int, re.search(r"SYNTHETIC random images and labels: accuracy is meaningless, (\d+) training / "
                                    r"(\d+) held-out images", out).groups())
    assert kept + held == 50000 and abs(held - 10000) <= 50, out
    assert "instead of" not in out and f"Validation: {held} of the 50000 training images held out" in out


@pytest.mark.parametrize("layout", ["split", "flat"])
def test_an_image_folder_without_dataset_folder_is_one_line_and_nothing_is_fetched(tmp_path, capsys, layout):
    """--data-dir naming your images, --dataset folder forgotten: the default CIFAR-100 is not
    downloaded into them; one line says what to add."""
    images = write_image_folder(tmp_path / "imgs", classes=2, n_train=2, n_test=1)
    if layout == "flat":
        (images / "test").rename(tmp_path / "test")
        for folder in list((images / "train").iterdir()):
            folder.rename(images / folder.name)
        (images / "train").rmdir()
    before = sorted(p.relative_to(images) for p in images.rglob("*"))
    assert run_main("train.py", "--data-dir", images, "--epochs", "1", *TINY_MODEL) == 2
    [line] = error_lines(capsys.readouterr().err)
    shape = f"{images}/CLASS/IMAGE" if layout == "flat" else f"{images}/train/CLASS/IMAGE"
    assert line == (f"error: {images} is an image folder ({shape}), not CIFAR-100 (--dataset cifar100): for your own "
                    "images add --dataset folder")
    assert sorted(p.relative_to(images) for p in images.rglob("*")) == before  # no download folder made


def test_a_data_folder_that_is_no_image_folder_is_fetched_into(tmp_path):
    """One folder of images beside the data sets (datasets/my_photos), or a data set's own
    download folder, is no image folder: fetching goes on (here, offline: its own line)."""
    from engine.image_folder import image_folder_layout
    write_image_folder(tmp_path / "data" / "my_photos", classes=2, n_train=1, n_test=1)
    write_dataset(tmp_path / "data", "mnist")
    assert image_folder_layout(tmp_path / "data") is None
    assert image_folder_layout(tmp_path / "data" / "my_photos") == "DIR/train/CLASS/IMAGE"
    assert image_folder_layout(tmp_path / "data" / "my_photos" / "train") == "DIR/CLASS/IMAGE"
    assert image_folder_layout(tmp_path / "nowhere") is None
