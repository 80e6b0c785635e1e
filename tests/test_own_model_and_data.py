"""Your own model and your own images: --model FILE.py:NAME, --dataset folder, --dataset
FILE.py:NAME and --augment, end to end as users run them (from their project folder, with
relative paths), and every mistake in a plug-in as one line."""

import json
import os
import re
import shutil
import signal

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

import dataset_utils as du
import recipe
import train_utils as tu
from engine import data_formats, image_cache, image_folder, models, plugins, task
from engine.errors import EXIT_STOPPED, UserError
from engine.flags import among_images
from engine import weights as weights_file
from tools import demo_data
from conftest import (FAST, REPO, TINY_MODEL, error_lines, python_cmd, read_metrics, run, run_main, start,
                      torchrun_cmd, wait_for, write_cifar100, write_image_folder)
from model import WideResNet

# A small network with none of the Wide ResNet's attribute names (no fc, no input_block), so
# that nothing of the engine can lean on them. It takes image_size, and records it.
MY_NET = '''
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.seen_size = image_size
        self.features = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def tiny(num_classes, in_channels):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))
'''
SMALL = (*FAST, "--batch-size", "32", "--warmup-epochs", "1", "--base-lr", "0.05", "--log-interval", "0")


@pytest.fixture
def project(tmp_path):
    """A user's project folder: my_net.py and an image folder (PNG and JPEG, RGB and gray,
    32x32 and 40x48, a stray notes.txt and a hidden file), 4 classes."""
    (tmp_path / "my_net.py").write_text(MY_NET)
    write_image_folder(tmp_path / "images", classes=4, n_train=32, n_test=8)
    return tmp_path


def folder_args(project, *extra):
    return ("--model", "my_net.py:Net", "--dataset", "folder", "--data-dir", "images", "--cache-dir", "cache",
            *SMALL, *extra)


def assert_learned(records):
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]
    assert max(r["val_accuracy"] for r in records) >= 0.5  # chance is 0.25


def test_an_image_folder_learns_under_train_py_and_torchrun(project):
    result = run(python_cmd("train.py", *folder_args(project, "--epochs", "4", "--metrics-file", "one.jsonl")),
                 cwd=project)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Decoding 160 images of 4 classes into cache/images-" in out
    assert "Training Net(num_classes=4, in_channels=3, image_size=(32, 32)) from my_net.py" in out
    assert "the image folder images (4 classes: class_0, class_1, class_2, class_3), 128 training / 32 test" in out
    assert ("Images: 32x32 (the training images' most common of 2 sizes; 40 resized: scaled to cover, "
            "centre-cropped), RGB (56 converted from other modes)") in out
    assert "Ignored 2 files that are not images, e.g. images/" in out  # notes.txt twice; .DS_Store is hidden
    assert "Augmentation: flip-crop (flip, pad_crop with 4-pixel padding)" in out
    assert "Traceback" not in result.stderr
    assert_learned(read_metrics(project / "one.jsonl"))

    # Two processes: the cache is reused (nothing decoded), and the run learns the same way.
    result = run(torchrun_cmd(2, "train_ddp.py", *folder_args(project, "--epochs", "4", "--metrics-file",
                                                             "two.jsonl")), cwd=project)
    assert result.returncode == 0, result.stderr
    assert "Decoding" not in result.stdout and "Cache: cache/images-" in result.stdout
    records = read_metrics(project / "two.jsonl")
    assert records[0]["world_size"] == 2 and records[0]["val_samples"] == 32
    assert_learned(records)


def test_your_model_is_stopped_by_a_signal_resumed_and_evaluated(project):
    args = folder_args(project, "--epochs", "20", "--checkpoint-dir", "ckpt", "--metrics-file", "m.jsonl",
                       "--save-weights", "w.pt", "--checkpoint-interval", "0", "--patience", "20")
    process = start(python_cmd("train.py", *args), project, project / "first.log")
    wait_for(project / "first.log", "Epoch 2/20:", process)
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=120) == EXIT_STOPPED
    assert "Stopped after" in (project / "first.log").read_text()

    # Resuming with the Wide ResNet instead is refused: another model is another run.
    result = run(python_cmd("train.py", *args, "--resume", "--model", "model:WideResNet"), cwd=project)
    assert result.returncode == 2 and error_lines(result.stderr) == [
        "error: the checkpoint was trained with --model my_net.py:Net, this run has --model model:WideResNet; "
        "resume with --model my_net.py:Net, or start a new run in another --checkpoint-dir"]

    result = run(python_cmd("train.py", *args, "--resume"), cwd=project)
    assert result.returncode == 0, result.stderr
    records = read_metrics(project / "m.jsonl")
    assert [r["epoch"] for r in records] == list(range(1, 21)) and records[-1]["model"] == "my_net.py:Net"

    # The weights file is the plain state_dict of Net, with the classes in its metadata.
    state = torch.load(project / "w.pt", weights_only=True)
    assert set(state) == {"features.0.weight", "features.0.bias", "features.1.weight", "features.1.bias",
                          "features.1.running_mean", "features.1.running_var", "features.1.num_batches_tracked",
                          "head.weight", "head.bias"}
    assert state._metadata[""]["task"]["classes"] == ["class_0", "class_1", "class_2", "class_3"]
    assert state._metadata[""]["task"]["model"] == "my_net:Net"

    # --eval-only of those weights through --model gives the last epoch's accuracy exactly.
    result = run(python_cmd("train.py", *folder_args(project, "--eval-only", "--weights", "w.pt")), cwd=project)
    assert result.returncode == 0, result.stderr
    assert f"Accuracy={records[-1]['val_accuracy']:.4f} on all 32 test images" in result.stdout
    assert "Evaluating Net(num_classes=4, in_channels=3, image_size=(32, 32)) from my_net.py weights w.pt" in \
        result.stdout


def test_with_test_and_val_folders_the_start_up_block_says_which_validates(tmp_path, capsys):
    """DIR/train, DIR/test and DIR/val: test/ validates, as it always has (a run or weights of
    such a folder record no folder name), and the start-up block says that val/ is not read,
    where it was silently ignored; predict.py --held-out takes the same test/."""
    root = write_image_folder(tmp_path / "imgs", n_train=8, n_test=4)
    shutil.copytree(root / "test", root / "val")
    for label in range(4):  # val/: 2 images per class, test/: 4
        for i in (2, 3):
            next((root / "val" / f"class_{label}").glob(f"image_{i}.*")).unlink()
    metrics = tmp_path / "m.jsonl"
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, *TINY_MODEL, *FAST, "--epochs", "1",
                    "--batch-size", "8", "--metrics-file", metrics, "--save-weights", tmp_path / "w.pt") == 0
    out = capsys.readouterr().out
    assert "32 training / 16 test images" in out and read_metrics(metrics)[0]["val_samples"] == 16
    assert (f"Validation: on {root / 'test'}/, which chooses model_best.pt and the early stop; {root / 'val'}/ is "
            f"not read (to validate on it, move {root / 'test'}/ out of {root}, or classify it at the end: "
            f"python predict.py --weights WEIGHTS --labelled {root / 'val'})") in out
    assert run_main("predict.py", "--weights", tmp_path / "w.pt", "--held-out", root, "--output",
                    tmp_path / "held.csv") == 0
    assert len((tmp_path / "held.csv").read_text().splitlines()) == 1 + 16  # the header, test/'s images
    shutil.rmtree(root / "test")  # val/ alone: validated on, no line about it
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, *TINY_MODEL, *FAST, "--epochs", "1",
                    "--batch-size", "8") == 0
    out = capsys.readouterr().out
    assert "32 training / 8 test images" in out and "Validation: on" not in out


def test_weights_of_other_classes_are_refused_for_evaluation(project, capsys):
    model = WideResNet(num_classes=4)
    weights_file.save_weights(model, project / "w.pt", {"classes": ["cat", "dog", "eel", "fox"]})
    reloaded = WideResNet(num_classes=4)
    reloaded.load_state_dict(torch.load(project / "w.pt", weights_only=True), strict=True)  # the guide's layout
    os.chdir(project)
    assert run_main("train.py", *folder_args(project, "--model", "model:WideResNet", "--eval-only",
                                             "--weights", "w.pt")) == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --weights w.pt were trained on other classes (label 0 is 'cat' there and 'class_0' here): their "
        "outputs would be read as the wrong labels; use the data set they were trained on"]  # no --finetune to evaluate
    assert run_main("train.py", *folder_args(project, "--model", "model:WideResNet", "--weights", "w.pt",
                                             "--epochs", "1")) == 2  # training from them: a new head is a way out
    assert error_lines(capsys.readouterr().err)[0].endswith(
        "use the data set they were trained on, or --finetune to start from them with a new head")
    # Another number of classes: named as such, not as tensors of other shapes.
    weights_file.save_weights(WideResNet(num_classes=3), project / "w3.pt", {"classes": ["cat", "dog", "eel"]})
    assert run_main("train.py", *folder_args(project, "--model", "model:WideResNet", "--eval-only",
                                             "--weights", "w3.pt")) == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --weights w3.pt were trained on other classes (3 classes there, 4 here): their outputs would be read "
        "as the wrong labels; use the data set they were trained on"]


def test_eval_only_on_another_data_set_does_not_take_the_weights_folder(tmp_path, capsys):
    """--eval-only --weights W --dataset cifar10, W trained on an image folder: W's folder was
    taken as CIFAR-10's --data-dir, and the line said to add --dataset folder, which W records."""
    root = write_image_folder(tmp_path / "images", classes=2, n_train=2, n_test=1, gray_every=0, stray=False)
    weights_file.save_weights(WideResNet(num_classes=2), tmp_path / "w.pt",
                              {"classes": ["class_0", "class_1"], "dataset": "folder", "data_dir": str(root)})
    assert run_main("train.py", "--eval-only", "--weights", tmp_path / "w.pt", "--dataset", "cifar10",
                    "--no-download", *FAST) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert str(root) not in line and "--dataset folder" not in line, line  # the default folder, datasets/

def test_a_cache_dir_inside_the_data_dir_is_one_line(tmp_path, capsys):
    """It trained, and the next run read the cache's folder as one more class (or two layouts)."""
    root = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, gray_every=0, stray=False)
    for inside in (root, root / "cache"):
        assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--cache-dir", inside) == 2
        assert error_lines(capsys.readouterr().err) == [
            f"train.py: error: --cache-dir {inside} is inside --data-dir {root}: the next run would read the cache as "
            "one more class folder; put it beside the images, not among them (see --help)"]
    assert sorted(path.name for path in root.iterdir()) == ["test", "train"]


def test_a_checkpoint_dir_inside_the_data_dir_is_one_line(tmp_path, capsys):
    """It trained, and its --resume then read the checkpoint folder as a class folder with no
    images (or as two layouts): refused before anything is written there."""
    root = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, gray_every=0, stray=False)
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")  # the scan meets the link, wherever it points
    for inside in (root, root / "ckpt", root / "train" / "ckpt", root / "link", root / "link" / "ckpt"):
        assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--checkpoint-dir", inside) == 2
        assert error_lines(capsys.readouterr().err) == [
            f"train.py: error: --checkpoint-dir {inside} is inside --data-dir {root}: the next run, its --resume too, "
            "would scan it with the images (a class folder without any); put it beside the images, not among them "
            "(see --help)"]
    for flag in ("--tensorboard", "--profile-dir"):  # their run folders too (a new user's walk: --tensorboard)
        assert run_main("train.py", "--dataset", "folder", "--data-dir", root, flag, root / "logs") == 2
        assert error_lines(capsys.readouterr().err) == [
            f"train.py: error: {flag} {root / 'logs'} is inside --data-dir {root}: the next run, its --resume too, "
            "would scan it with the images (a class folder without any); put it beside the images, not among them "
            "(see --help)"]
    # A file the run writes, in a folder it would create there: that folder is a class without images.
    for flag, inside in (("--save-weights", root / "train" / "extra" / "w.pt"),
                         ("--metrics-file", root / "test" / "logs" / "m.jsonl")):
        assert run_main("train.py", "--dataset", "folder", "--data-dir", root, flag, inside) == 2
        assert error_lines(capsys.readouterr().err) == [
            f"train.py: error: {flag} {inside} is inside --data-dir {root}, in a folder it would create "
            f"({inside.parent}): the next run, its --resume too, would scan it with the images (a class folder "
            "without any); put it beside the images, not among them (see --help)"]
    # In a folder already there the scan ignores it; hidden, at any depth, it skips it; --eval-only writes none.
    weights_file.save_weights(WideResNet(num_classes=2), tmp_path / "w.pt",
                              {"classes": ["class_0", "class_1"], "dataset": "folder", "data_dir": str(root)})
    for taken in (("--save-weights", root / "w.pt"), ("--metrics-file", root / "train" / "class_0" / "m.jsonl"),
                  ("--metrics-file", root / "train" / ".logs" / "m.jsonl"),
                  ("--eval-only", "--weights", tmp_path / "w.pt", "--save-weights", root / "train" / "new" / "w.pt")):
        args = tu.parse_args("train.py", [str(arg) for arg in ("--dataset", "folder", "--data-dir", root, *taken)])
        assert args.data_dir == str(root)  # parsed: not refused
    assert not among_images(root / "train" / ".ckpt", root) and among_images(root / "train" / "ckpt", root)
    (root / "link").unlink()
    assert sorted(path.name for path in root.iterdir()) == ["test", "train"]
    assert sorted(path.name for path in (root / "train").iterdir()) == ["class_0", "class_1"]
    assert not among_images(root / ".ckpt", root) and not among_images(root / ".." / "ckpt", root)  # the scan skips
    assert not among_images(root / ".metrics.jsonl", root)  # a hidden file too
    assert among_images(tmp_path / "alias" / "ckpt", root) is False
    (tmp_path / "alias").symlink_to(root)  # the images under another name: found with links resolved
    assert among_images(tmp_path / "alias" / "ckpt", root)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--checkpoint-dir", tmp_path / "ckpt",
                    "--model", f"{REPO / 'tests' / 'tiny_net.py'}:Net", "--epochs", "1", "--batch-size", "4") == 0
    assert list((tmp_path / "ckpt").glob("checkpoint_*.pt"))  # beside the images: trained and kept


def test_a_data_dir_that_is_missing_or_a_file_is_one_line_saying_which(tmp_path):
    with pytest.raises(UserError, match=rf"^--data-dir {re.escape(str(tmp_path / 'photos'))}: no such folder$"):
        image_folder.scan(tmp_path / "photos")
    (tmp_path / "w.pt").write_bytes(b"")  # weights given where the images were meant
    with pytest.raises(UserError, match=rf"^--data-dir {re.escape(str(tmp_path / 'w.pt'))}: a file, not a folder$"):
        image_folder.scan(tmp_path / "w.pt")


def test_weights_whose_classes_are_numbers_load_where_their_count_fits(tmp_path):
    """--synthetic names classes by number, as weights of the built-in data sets saved before
    their names were read did: those load on the named classes (positions are all they say)."""
    weights_file.save_weights(torch.nn.Linear(3, 4), tmp_path / "w.pt", {"classes": ["0", "1", "2", "3"]})
    named = {"classes": ["apple", "aquarium_fish", "baby", "bear"]}
    model = torch.nn.Linear(3, 4)
    weights_file.load_weights(model, tmp_path / "w.pt", expected=named)
    assert torch.equal(model.weight, torch.load(tmp_path / "w.pt", weights_only=True)["weight"])
    weights_file.save_weights(torch.nn.Linear(3, 4), tmp_path / "x.pt", {"classes": ["0", "1", "3", "2"]})
    with pytest.raises(UserError, match="label 0 is '0' there and 'apple' here"):  # not 0..3 in order: names
        weights_file.load_weights(torch.nn.Linear(3, 4), tmp_path / "x.pt", expected=named)


def test_the_cache_is_built_once_and_rebuilt_when_an_image_changes(tmp_path):
    root = write_image_folder(tmp_path / "images", classes=3, n_train=8, n_test=4)
    said = []
    first = image_cache.prepare_folder(root, tmp_path / "cache", log=said.append)
    assert any(line.startswith("Decoding 36 images of 3 classes") for line in said)
    data = image_cache.read_folder_cache(first)
    assert data.train[0].shape == (24, 32, 32, 3) and data.train[0].dtype == np.uint8
    assert data.classes == ("class_0", "class_1", "class_2") and data.train[1].tolist() == [0] * 8 + [1] * 8 + [2] * 8
    # Files in sorted order; a 32x32 RGB PNG is kept as it is.
    png = root / "train" / "class_1" / "image_2.png"
    assert Image.open(png).mode == "RGB" and np.array_equal(data.train[0][8 + 2], np.asarray(Image.open(png)))
    mean, std = image_folder.channel_stats(data.train[0])
    assert np.allclose(mean, data.train[0].reshape(-1, 3).mean(0) / 255, atol=1e-4) and data.mean == mean

    said.clear()
    assert image_cache.prepare_folder(root, tmp_path / "cache", log=said.append) == first and not said
    Image.new("RGB", (32, 32), "red").save(root / "train" / "class_2" / "image_new.png")
    second = image_cache.prepare_folder(root, tmp_path / "cache", log=said.append)
    assert second != first and not first.exists() and f"Removed the outdated cache {first}" in said
    assert image_cache.read_folder_cache(second).train[0].shape[0] == 25
    assert not list((tmp_path / "cache").glob("*/.*tmp*"))  # no half-built cache left


def test_gray_folders_stay_gray_and_image_size_resizes(tmp_path):
    root = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, gray_every=1, stray=False)
    data = image_cache.read_folder_cache(image_cache.prepare_folder(root, tmp_path / "c", log=lambda _: None))
    assert data.train[0].shape == (8, 32, 32, 1) and "gray (every image is gray)" in data.notes[0]
    resized = image_cache.read_folder_cache(image_cache.prepare_folder(root, tmp_path / "c", (24, 20),
                                                                         log=lambda _: None))
    assert resized.train[0].shape == (8, 24, 20, 1) and "Images: 24x20 (as requested;" in resized.notes[0]
    assert image_folder.choose_size([(40, 48), (32, 32), (40, 48), (32, 32)]) == ((32, 32), True)  # a tie: the smaller
    # Photos of many sizes, none common: the median by area, not the one thumbnail among them.
    photos = [(150 + k, 200 + 3 * k) for k in range(30)] + [(20, 24)]
    assert image_folder.choose_size(photos) == ((164, 242), False)
    assert image_folder.choose_size([(8, 8), (16, 16), (16, 16), (32, 32), (64, 64)]) == ((16, 16), False)


def test_unreadable_images_are_left_out_and_named_and_a_class_of_none_is_one_line(tmp_path, capsys):
    root = write_image_folder(tmp_path / "images", classes=2, n_train=6, n_test=2, stray=False)
    jpeg = root / "train" / "class_1" / "image_1.jpg"
    jpeg.write_bytes(jpeg.read_bytes()[:200])  # truncated: its header reads, its pixels do not
    (root / "test" / "class_0" / "image_9.png").write_bytes(b"\x89PNG no more")
    said = []
    data = image_cache.read_folder_cache(image_cache.prepare_folder(root, tmp_path / "cache", log=said.append))
    assert data.train[1].tolist() == [0] * 6 + [1] * 5 and len(data.train[0]) == 11  # rows and labels still paired
    clean = np.asarray(Image.open(root / "train" / "class_1" / "image_2.png").convert("RGB"))
    assert np.array_equal(data.train[0][6 + 1], clean)  # the image after the bad one moved up a row
    assert data.skipped == {"train": ("train/class_1/image_1.jpg",), "test": ("test/class_0/image_9.png",)}
    assert data.test[1].tolist() == [0, 0, 1, 1] and "Decoded 15 images" in said[-1]
    warning = [note for note in data.notes if note.startswith(("WARNING: skipped", "  "))]
    assert warning[0].startswith("WARNING: skipped 2 unreadable images, not trained or validated on")
    assert warning[1].startswith(f"  {jpeg}: ") and "truncated" in warning[1].lower() and len(warning) == 3
    for bad in (root / "train" / "class_0").glob("*"):  # no readable image left in a class
        bad.write_bytes(b"")
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--cache-dir", tmp_path / "c", *SMALL) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: class class_0 has no readable image ({root}/train/class_0/image_0.png: ")
    assert line.endswith("; 7 unreadable images in all)")
    assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file()]  # nothing half-written kept


@pytest.mark.parametrize("layout, expected", [
    ({"train/a/x.png": True}, "no {root}/test/ or {root}/val/"),
    ({"train/a/x.png": True, "test/b/y.png": True}, "class folder(s) b are not in {root}/train"),
    ({"train/a/x.png": True, "train/b/notes.txt": False, "test/a/y.png": True},
     "{root}/train/b holds no image files: add images of class b, or remove the folder (each folder of {root}/train "
     "is a class)"),
    ({"train/x.png": True, "test/y.png": True}, "{root}/train has no class folders"),
    # Folders of anything but images (the scripts' own folder, say): not class folders that want --val-fraction.
    ({"engine/a.py": False, "tests/b.py": False, "docs/c.md": False},
     "--data-dir {root} holds no image files in its folders (docs, engine, tests): it is not an image folder"),
])
def test_a_folder_in_the_wrong_layout_is_one_line(tmp_path, capsys, layout, expected):
    root = tmp_path / "images"
    for name, is_image in layout.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        if is_image:
            Image.new("RGB", (8, 8)).save(root / name)
        else:
            (root / name).write_text("x")
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--cache-dir", tmp_path / "c", *SMALL) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert expected.format(root=root) in line


def test_an_empty_class_folder_beside_the_others_names_their_folder(tmp_path, capsys):
    """Class folders in the folder itself (--val-fraction): the line said "each folder of train/
    is a class", of a train/ there is not."""
    root = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=0, stray=False)
    shutil.rmtree(root / "test")
    for folder in (root / "train").iterdir():
        folder.rename(root / folder.name)
    (root / "train").rmdir()
    (root / "horse").mkdir()
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--val-fraction", "0.5", "--cache-dir",
                    tmp_path / "c", *SMALL) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: {root}/horse holds no image files: add images of class horse, or remove the folder (each folder of "
        f"{root} is a class)"]


def test_a_split_that_holds_out_nothing_is_one_line(tmp_path, capsys):
    """One image per class: --val-fraction leaves each in training, so validation had no image
    and every epoch printed "Val Accuracy=nan", the run ending in success and weights."""
    root = write_image_folder(tmp_path / "images", classes=2, n_train=1, n_test=0, gray_every=0, stray=False)
    shutil.rmtree(root / "test")
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--val-fraction", "0.2", "--cache-dir",
                    tmp_path / "c", "--save-weights", tmp_path / "w.pt", *SMALL) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith("error: --val-fraction 0.2 holds out no image of ") and line.endswith(
        ": each of its 2 classes has a single training image, which stays in training; add images (two or more per "
        "class), or a test/ folder to validate on"), line
    assert not (tmp_path / "w.pt").exists()


def test_a_class_without_test_images_is_named_at_the_start(tmp_path, capsys):
    """A class folder missing (or empty) in test/ while train/ has it: the accuracy silently left
    that class out."""
    root = write_image_folder(tmp_path / "images", classes=3, n_train=4, n_test=2, gray_every=0, stray=False)
    shutil.rmtree(root / "test" / "class_2")
    tiny = (*SMALL, "--batch-size", "4", "--epochs", "1", *TINY_MODEL)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--cache-dir", tmp_path / "c", *tiny) == 0
    out = capsys.readouterr().out
    assert ("Warning: the test images hold none of 1 class of the 3 (class_2): the accuracy is over the others; add "
            "test images of each class, or validate on part of the training images with --val-fraction 0.2") in out
    root2 = write_image_folder(tmp_path / "all", classes=3, n_train=4, n_test=2, gray_every=0, stray=False)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root2, "--cache-dir", tmp_path / "c", *tiny) == 0
    assert "hold none of" not in capsys.readouterr().out

MY_DATA = '''
import torch


class Split(torch.utils.data.Dataset):
    classes = ["dark", "light"]

    def __init__(self, n, dtype):
        generator = torch.Generator().manual_seed(n)
        self.labels = torch.randint(0, 2, (n,), generator=generator)
        noise = torch.rand(n, 1, 12, 12, generator=generator) * 0.2
        self.images = (self.labels[:, None, None, None] * 0.7 + noise)
        if dtype == "uint8":
            self.images = (self.images * 255).to(torch.uint8)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def make(data_dir):
    return Split(96, "uint8"), Split(32, "uint8")


def make_float(data_dir):
    return Split(96, "float"), Split(32, "float")
'''


@pytest.mark.parametrize("name", ["make", "make_float"])
def test_a_data_set_from_your_file_learns(tmp_path, name):
    (tmp_path / "my_data.py").write_text(MY_DATA)
    (tmp_path / "my_net.py").write_text(MY_NET)
    result = run(python_cmd("train.py", "--model", "my_net.py:Net", "--dataset", f"my_data.py:{name}", *SMALL,
                            "--epochs", "4", "--metrics-file", "m.jsonl", "--batch-size", "16"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"Data: my_data.py:{name}(" in result.stdout and "2 classes, 96 training / 32 test images" in result.stdout
    assert "Net(num_classes=2, in_channels=1, image_size=(12, 12))" in result.stdout
    assert_learned(read_metrics(tmp_path / "m.jsonl"))


def test_float_images_are_flipped_padded_crops_in_both_loaders():
    """Two float channels: each loader's training image is one of the image's flips and zero-padded
    crops (padded before normalization, as stored), normalized per channel."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(6, 8, 8, 2)).astype(np.float32)
    prep = du.preprocessing((8, 8, 2), (0.1, -0.2), (1.5, 0.5), "flip-crop")
    scale_shift = du.normalization(prep.mean, prep.std, torch.float32)
    data = du.InMemoryImages(images, np.arange(6), prep).with_transform(recipe.loader_transforms(prep))
    keys = list(du.AugmentSampler(range(6), 6, 3))
    one_at_a_time = torch.stack([data[key][0] for key in keys])  # the torchvision loader's items
    rand = prep.randoms(6, 3, 0)[[index for index, _ in keys]]
    on_device = du.normalize(du.augment(torch.from_numpy(images)[[i for i, _ in keys]], rand, prep.ops, prep),
                             *scale_shift)
    p = prep.padding
    span = range(2 * p + 1)
    for served in (one_at_a_time, on_device):
        for (index, _), item in zip(keys, served, strict=True):
            padded = torch.nn.functional.pad(torch.from_numpy(images[index]), (0, 0, p, p, p, p))
            views = [view.flip(1) if flip else view for flip in (False, True)
                     for view in (padded[top:top + 8, left:left + 8] for top in span for left in span)]
            assert any(torch.allclose(item, du.normalize(view[None], *scale_shift)[0], atol=1e-6)
                       for view in views), index
    assert torch.allclose(data[0][0], (torch.from_numpy(images[0]).permute(2, 0, 1) - torch.tensor([0.1, -0.2])[:, None,
                          None]) / torch.tensor([1.5, 0.5])[:, None, None])


def test_float_images_far_from_zero_keep_their_precision():
    """A float data set whose mean is 43,000 of its standard deviations from 0 (temperatures in
    kelvin with millikelvin differences): subtracted first, its normalized values keep float32's
    precision (a fused x * scale + shift, with both rounded to float32, is 3.7e-4 off here)."""
    images = (300 + 0.007 * np.random.default_rng(0).normal(size=(4, 6, 6, 1))).astype(np.float32)
    out = du.normalize(torch.from_numpy(images), *du.normalization((300.0,), (0.007,), torch.float32))
    exact = (torch.from_numpy(images).double() - 300) / 0.007  # (4, 6, 6, 1)
    assert out.shape == (4, 1, 6, 6) and (out.permute(0, 2, 3, 1).double() - exact).abs().max() < 1e-5


def test_augment_chooses_for_any_data_set():
    cifar, mnist = task.DATASETS["cifar100"], task.DATASETS["mnist"]

    def prep(spec, augment):
        made = du.spec_preprocessing(spec, augment)
        return made.padding, [op.__name__ for op in made.ops]

    assert prep(cifar, "auto") == (4, ["flip", "pad_crop"]) and prep(mnist, "auto") == (2, ["pad_crop"])
    assert prep(mnist, "flip-crop") == (2, ["flip", "pad_crop"]) and prep(cifar, "crop") == (4, ["pad_crop"])
    assert prep(cifar, "none")[1] == []
    assert du.preprocessing((64, 48, 3), (0,) * 3, (1,) * 3).padding == 6  # a folder: 1/8 of the shorter side
    # none: the device loader serves the images only normalized.
    images = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    plain = du.preprocessing((8, 8, 3), (0.5,) * 3, (0.25,) * 3, "none")
    loader = du.DeviceLoader(du.InMemoryImages(images, np.arange(4), plain), 4, range(4),
                                        torch.device("cpu"), augmented=True, drop_last=True)
    [(batch, _)] = list(loader)
    reference = (torch.from_numpy(images).permute(0, 3, 1, 2) / 255 - 0.5) / 0.25  # ToTensor + Normalize
    torch.testing.assert_close(batch, reference, rtol=0, atol=1e-6)


def test_a_data_set_that_does_not_fit_is_streamed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(du, "DEVICE_DATA_FRACTION", 1e-12)
    write_cifar100(tmp_path / "data")
    assert run_main("train.py", "--data-dir", tmp_path / "data", "--synthetic", "--epochs", "1", "--limit-batches",
                    "1", "--batch-size", "8", "--metrics-file", tmp_path / "m.jsonl", *FAST) == 0
    out = capsys.readouterr().out
    assert "Loader: torchvision DataLoader, 0 worker processes per training process; auto: the data set (184.3 MB) " \
           "does not fit in 0% of the device's" in out
    assert read_metrics(tmp_path / "m.jsonl")[0]["loader"] == "torchvision"


# A network of one input size, as torchvision's ViT checks it (torchvision/models/vision_transformer.py).
FIXED_SIZE_NET = """import torch.nn as nn
class Net(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))

    def forward(self, x):
        assert x.shape[2] == 224, f"Wrong image height! Expected 224 but got {x.shape[2]}!"
        return self.head(x)
"""

BAD_MODELS = {
    "missing file": ("", "nothing.py:Net", "error: --model nothing.py:Net: no such file {tmp}/nothing.py"),
    "no .py": ("", "./my_net:Net", "error: --model ./my_net:Net: no such file {tmp}/my_net; did you mean --model "
                                   "./my_net.py:Net?"),
    # A folder named in place of a file (the user's images, say): not found as a module, or, from the project
    # folder (on sys.path), imported as a namespace package, with no code.
    "a folder": ("", "images:Net", "error: --model images:Net: {tmp}/images is a folder, not a Python file or "
                                   "module; name the file that defines Net: images/FILE.py:Net"),
    "a folder's path": ("", "./images/:Net", "error: --model ./images/:Net: {tmp}/images is a folder, not a Python "
                                             "file or module; name the file that defines Net: ./images/FILE.py:Net"),
    "missing name": ("class Other: pass\n", "my_net.py:Net",
                     "error: --model my_net.py:Net: {tmp}/my_net.py has no Net (it defines: Other)"),
    "a typo": ("", "torchvision.models:resnet19",
               "error: --model torchvision.models:resnet19: {torchvision}/models/__init__.py has no resnet19 (did you "
               "mean resnet18 or "),
    "no module": ("", "nosuchmodule:Net",
                  "error: --model nosuchmodule:Net: no module named nosuchmodule (for a file give its path: "
                  "nosuchmodule.py:Net)"),
    "two colons": ("class Net: pass\n", "my_net.py:Net:x",
                   "error: --model my_net.py:Net:x: no module named my_net.py:Net (one colon: FILE.py:NAME or "
                   "module:NAME)"),
    "not callable": ("Net = 3\n", "my_net.py:Net",
                     "error: --model my_net.py:Net: Net is not a class or function but a value of type int"),
    "wrong signature": ("def Net(classes, channels): pass\n", "my_net.py:Net",
                        "error: --model my_net.py:Net: Net(classes, channels) does not take num_classes and "
                        "in_channels; it is called as Net(num_classes=N, in_channels=C[, image_size=(H, W)])"),
    "extra argument": ("def Net(num_classes, in_channels, depth): pass\n", "my_net.py:Net",
                       "error: --model my_net.py:Net: Net(num_classes, in_channels, depth) also requires depth (give "
                       "it a default); it is called as Net(num_classes=N, in_channels=C[, image_size=(H, W)])"),
    "not a module": ("def Net(num_classes, in_channels):\n    return [num_classes]\n", "my_net.py:Net",
                     "error: --model my_net.py:Net: Net(...) returned a list, not an nn.Module"),
    "raises": ("def Net(num_classes, in_channels):\n    width = 0\n    raise ValueError(f'bad width {width}')\n",
               "my_net.py:Net", "error: --model my_net.py:Net raised ValueError: bad width 0 (at {tmp}/my_net.py, "
                                "line 3, in Net: raise ValueError(f'bad width {{width}}'))"),
    "wrong output": ("import torch.nn as nn\ndef Net(num_classes, in_channels):\n"
                     "    return nn.Sequential(nn.Flatten(), nn.LazyLinear(7))\n", "my_net.py:Net",
                     "error: --model my_net.py:Net maps images (2, 3, 32, 32) to (2, 7), not to logits (2, 100) for "
                     "the data's 100 classes"),
    "syntax": ("def Net(:\n", "my_net.py:Net", "error: --model my_net.py:Net: importing my_net.py raised SyntaxError"),
    "detached": ("import torch.nn as nn\nclass Net(nn.Sequential):\n    def __init__(self, num_classes, in_channels):\n"
                 "        super().__init__(nn.Flatten(), nn.LazyLinear(num_classes))\n\n    def forward(self, x):\n"
                 "        return super().forward(x).detach()\n", "my_net.py:Net",
                 "error: --model my_net.py:Net's output does not depend on its trainable parameters (torch.no_grad(), "
                 ".detach() or .item() in its forward?): nothing would train"),
    "no parameters": ("import torch.nn as nn\ndef Net(num_classes, in_channels):\n"
                      "    return nn.Sequential(nn.Flatten(), nn.AdaptiveAvgPool1d(num_classes))\n", "my_net.py:Net",
                      "error: --model my_net.py:Net has no trainable parameters: nothing to train"),
    # Right for the start-up check's batches of 2 and 1 only: the training batch fails in forward, named by its line.
    "fails in training": ("import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self, num_classes, in_channels):\n"
                          "        super().__init__()\n        self.head = nn.LazyLinear(num_classes)\n\n"
                          "    def forward(self, x):\n        return self.head(x.reshape(min(len(x), 2), -1))\n",
                          "my_net.py:Net",
                          "error: {tmp}/my_net.py, line 8, in forward: RuntimeError: "),
    # Logits (2, classes) for the check's two images, (classes,) for one: an evaluation's last batch failed.
    "squeezed": ("import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self, num_classes, in_channels):\n"
                 "        super().__init__()\n        self.head = nn.LazyLinear(num_classes)\n\n"
                 "    def forward(self, x):\n        return self.head(x.flatten(1)).squeeze()\n", "my_net.py:Net",
                 "error: --model my_net.py:Net maps images (1, 3, 32, 32) to (100,), not to logits (1, 100) for the "
                 "data's 100 classes: a batch of one image (an evaluation's last, predict.py's) must keep its batch "
                 "dimension (.squeeze() in the forward? .flatten(1) or .squeeze(-1) keeps it)"),
    # Logits in evaluation, (logits, auxiliary logits) in training: the training step's loss failed in a traceback.
    "auxiliary outputs": ("import torch.nn as nn\nclass Net(nn.Module):\n"
                          "    def __init__(self, num_classes, in_channels):\n        super().__init__()\n"
                          "        self.head, self.aux = nn.LazyLinear(num_classes), nn.LazyLinear(num_classes)\n\n"
                          "    def forward(self, x):\n        x = x.flatten(1)\n"
                          "        return (self.head(x), self.aux(x)) if self.training else self.head(x)\n",
                          "my_net.py:Net",
                          "error: --model my_net.py:Net maps images (2, 3, 32, 32) in training mode to tuple, not to "
                          "logits (2, 100) for the data's 100 classes: a model with auxiliary outputs in training "
                          "(torchvision's googlenet and inception_v3 take aux_logits=False); return the logits alone"),
    "torchvision's auxiliary outputs": ("", "torchvision.models:googlenet",
                                        "error: --model torchvision.models:googlenet maps images (2, 3, 32, 32) in "
                                        "training mode to GoogLeNetOutputs, not to logits (2, 100)"),
    # A bug in forward about a shape, on images whose size is not the user's to choose: its line, not a guess
    # that the model takes other images.
    "shape bug": ("import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self, num_classes, in_channels):\n"
                  "        super().__init__()\n        self.head = nn.LazyLinear(num_classes)\n\n"
                  "    def forward(self, x):\n        return self.head(x.flatten(1).view(x.size(0), 16))\n",
                  "my_net.py:Net",
                  "error: --model my_net.py:Net on images (2, 3, 32, 32) raised RuntimeError: shape '[2, 16]' is "
                  "invalid for input of size 6144 (at {tmp}/my_net.py, line 8, in forward: return "
                  "self.head(x.flatten(1).view(x.size(0), 16)))"),
    "fixed size": (FIXED_SIZE_NET, "my_net.py:Net",
                   "error: --model my_net.py:Net does not take images of 3 x 32 x 32 pixels (AssertionError: Wrong "
                   "image height! Expected 224 but got 32!): it takes 224 x 224 pixels; use a model that takes these "
                   "images (--image-size resizes the images of --dataset folder only) (at {tmp}/my_net.py, line 8, in "
                   "forward: assert x.shape[2] == 224, f\"Wrong image height! Expected 224 but got {{x.shape[2]}}!\")"),
}


@pytest.mark.parametrize("case", BAD_MODELS)
def test_every_bad_model_is_one_line(tmp_path, capsys, monkeypatch, case):
    source, ref, expected = BAD_MODELS[case]
    (tmp_path / "my_net.py").write_text(source)
    (tmp_path / "images").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "my_net", raising=False)
    assert run_main("train.py", "--synthetic", "--model", ref, "--epochs", "1", *FAST) == 2
    err = capsys.readouterr().err
    [line] = error_lines(err)
    assert line.startswith(expected.format(tmp=tmp_path, torchvision=Path(torchvision.__file__).parent)), line
    assert "Traceback" not in err


WARNS = ("import warnings\nimport torch.nn as nn\nclass Net(nn.Module):\n"
         "    def __init__(self, num_classes, in_channels):\n        super().__init__()\n"
         "        warnings.warn('the default initialization will change', FutureWarning)\n"
         "        self.head = nn.LazyLinear(num_classes)\n\n"
         "    def forward(self, x):\n        x = x.flatten(1)\n"
         "        return (self.head(x), self.head(x)) if self.training and AUX else self.head(x)\n")


@pytest.mark.parametrize("case", ["refused", "trains", "its weights refused"])
def test_a_models_own_warning_is_shown_when_it_trains_and_not_above_its_refusal(tmp_path, case):
    """torchvision's googlenet warns of its initialization as it is built: two lines above the
    one line that refuses its auxiliary outputs (or --weights that do not fit it). A model that
    is accepted still shows it."""
    (tmp_path / "my_net.py").write_text(f"AUX = {case == 'refused'}\n" + WARNS)
    run_args = ("--synthetic", "--epochs", "1", "--limit-batches", "1", "--batch-size", "4", *FAST)
    weights = ()
    if case == "its weights refused":  # another model's
        assert run(python_cmd("train.py", *run_args, *TINY_MODEL, "--save-weights", "tiny.pt"), cwd=tmp_path
                   ).returncode == 0
        weights = ("--weights", "tiny.pt")
    result = run(python_cmd("train.py", *run_args, "--model", "my_net.py:Net", *weights), cwd=tmp_path)
    if case == "trains":
        assert result.returncode == 0, result.stderr
        assert "FutureWarning: the default initialization will change" in result.stderr
        return
    assert result.returncode == 2
    refusal = ("error: --model my_net.py:Net maps images (2, 3, 32, 32) in training mode to tuple"
               if case == "refused" else "error: --weights tiny.pt does not fit Net(")
    assert result.stderr.startswith(refusal), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_a_folder_on_the_import_path_named_as_the_model_is_one_line(tmp_path, capsys, monkeypatch):
    """From the project folder (sys.path[0] of python train.py) a folder without __init__.py,
    the user's images, imports as a namespace package: no __file__, no code. It said "None has
    no Net (it defines: nothing)"."""
    (tmp_path / "my_images").mkdir()
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "my_images", raising=False)
    assert run_main("train.py", "--synthetic", "--model", "my_images:Net", "--epochs", "1", *FAST) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --model my_images:Net: {tmp_path / 'my_images'} is a folder, not a Python file or module; name the "
        "file that defines Net: my_images/FILE.py:Net"]

def test_a_model_name_mistyped_is_one_line_before_any_image_is_decoded(tmp_path, capsys, monkeypatch):
    root = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, gray_every=0, stray=False)
    (tmp_path / "my_net.py").write_text("class Net: pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "my_net", raising=False)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--model", "my_net.py:Nett", "--cache-dir",
                    tmp_path / "cache", "--epochs", "1", *FAST) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --model my_net.py:Nett: {tmp_path / 'my_net.py'} has no Nett (did you mean Net?)"]
    assert not (tmp_path / "cache").exists()  # nothing decoded first


def test_a_mistyped_torchvision_model_is_offered_models_not_modules():
    """torchvision.models holds the module resnet beside the functions resnet18, resnet152...:
    only what NAME can be is offered."""
    with pytest.raises(UserError) as refused:
        plugins.load_plugin("torchvision.models:resnet18x", "--model")
    offered = str(refused.value).partition("did you mean ")[2].rstrip("?)").split(" or ")
    assert offered and "resnet18" in offered and "resnet" not in offered, offered


def test_a_model_without_gradients_is_refused_for_training_only():
    """--eval-only and predict.py evaluate it: nothing trains, so its output needs no gradient."""
    class Detached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3 * 8 * 8, 4)

        def forward(self, x):
            return self.head(x.flatten(1)).detach()

    models.check_output(Detached(), "n.py:Net", (3, 8, 8), 4, trains=False)
    with pytest.raises(UserError, match=r"^--model n.py:Net's output does not depend on its trainable parameters"):
        models.check_output(Detached(), "n.py:Net", (3, 8, 8), 4)


def test_a_model_of_one_input_size_on_other_images_names_the_image_size_to_give(tmp_path, capsys):
    root = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, gray_every=0, stray=False)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", root, "--image-size", "64", "--model",
                    "torchvision.models:vit_b_16", "--cache-dir", tmp_path / "c", "--epochs", "1", *FAST) == 2
    err = capsys.readouterr().err
    assert error_lines(err) == ["error: --model torchvision.models:vit_b_16 does not take images of 3 x 64 x 64 pixels "
                                "(AssertionError: Wrong image height! Expected 224 but got 64!): give --image-size 224"]
    assert "Traceback" not in err


class Failing(torch.nn.Module):
    """Raises ``err`` in its forward pass."""

    def __init__(self, err):
        super().__init__()
        self.err = err

    def forward(self, x):
        raise self.err


@pytest.mark.parametrize("err, expected", [
    (AssertionError("input size must be 48x48"), "--model n.py:Net does not take images of 3 x 64 x 64 pixels "
                                                 "(AssertionError: input size must be 48x48): give the --image-size it "
                                                 "was designed for"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x12288 and 6912x10)"),
     "give the --image-size it was designed for, or make the layer take the 12288 features these images give (not "
     "6912; nn.LazyLinear takes what comes)"),
    # Not about the size: the line that names where it was raised, as before.
    (RuntimeError("Given groups=1, weight of size [8, 1, 3, 3], expected input[2, 3, 64, 64] to have 1 channels"),
     "--model n.py:Net on images (2, 3, 64, 64) raised RuntimeError: Given groups=1"),
    (NameError("name 'widht' is not defined"), "--model n.py:Net on images (2, 3, 64, 64) raised NameError"),
    # Out of memory, even where its message speaks of a size, is not the image size's fault.
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB; try setting max_split_size_mb"),
     "--model n.py:Net on images (2, 3, 64, 64) raised OutOfMemoryError"),
])
def test_the_first_forward_pass_blames_the_image_size_only_for_a_size_error(err, expected):
    with pytest.raises(UserError) as info:
        models.check_output(Failing(err), "n.py:Net", (3, 64, 64), 10, resizable=True)
    assert str(info.value).startswith(expected) or str(info.value).endswith(expected), str(info.value)
    with pytest.raises(KeyboardInterrupt):  # never caught
        models.check_output(Failing(KeyboardInterrupt()), "n.py:Net", (3, 64, 64), 10, resizable=True)
    with pytest.raises(UserError, match=r"^--model n\.py:Net on images \(2, 3, 64, 64\) raised "):
        models.check_output(Failing(err), "n.py:Net", (3, 64, 64), 10)  # predict.py: the size the weights had


BAD_DATA = {
    "one set": ("def make(data_dir):\n    return [1, 2, 3]\n",
                "error: --dataset my_data.py:make: make(data_dir) returned a list, not (train, test)"),
    "an int": ("def make(data_dir):\n    return 3\n",
               "error: --dataset my_data.py:make: make(data_dir) returned an int, not (train, test)"),
    "not images": ("def make(data_dir):\n    return [('a', 0)], [('b', 1)]\n",
                   "error: --dataset my_data.py:make: the training set[0]: the image is a str, not a tensor (C, H, W)"),
    "two sizes": ("import torch\ndef make(data_dir):\n"
                  "    return [(torch.zeros(1, 8, 8), 0), (torch.zeros(1, 9, 8), 1)], [(torch.zeros(1, 8, 8), 0)]\n",
                  "error: --dataset my_data.py:make: the training set[1] is float32 (9, 8, 1) (H, W, C), item 0 "
                  "float32 (8, 8, 1): every image must have one size and type"),
    "labels": ("import torch\nclass S(list):\n    classes = ['a', 'b']\ndef make(data_dir):\n"
               "    return S([(torch.zeros(1, 8, 8), 0), (torch.zeros(1, 8, 8), 2)]), S([(torch.zeros(1, 8, 8), 0)])\n",
               "error: --dataset my_data.py:make: training image 1 has the label 2, outside 0..1 of its 2 classes"),
    "one label": ("import torch\ndef make(data_dir):\n"
                  "    return [(torch.zeros(1, 8, 8), 7)] * 10, [(torch.zeros(1, 8, 8), 3)]\n",
                  "error: every training image of my_data.py:make has the label 7 (7) of its 8 classes: a classifier "
                  "needs images of at least two"),  # it would learn one answer, to 100%
    "raises": ("def make(data_dir):\n    return open(data_dir + '/nothing.csv')\n",
               "error: --dataset my_data.py:make raised FileNotFoundError: [Errno 2] No such file or directory"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_every_bad_data_set_is_one_line(tmp_path, capsys, monkeypatch, case):
    source, expected = BAD_DATA[case]
    (tmp_path / "my_data.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "my_data", raising=False)
    assert run_main("train.py", "--dataset", "my_data.py:make", "--epochs", "1", *FAST) == 2
    err = capsys.readouterr().err
    [line] = error_lines(err)
    assert line.startswith(expected), line
    if case == "raises":
        assert f"(at {tmp_path.resolve()}/my_data.py, line 2, in make: return open(" in line
    assert "Traceback" not in err


def test_write_demo_writes_each_format_and_never_over_a_copy(tmp_path, capsys):
    assert demo_data.main(["--dataset", "folder", str(tmp_path / "demo")]) == 0
    assert len(list((tmp_path / "demo" / "train" / "class_3").glob("image_*"))) == 64
    assert demo_data.main(["--dataset", "folder", str(tmp_path / "demo")]) == 2
    assert f"error: {tmp_path / 'demo' / 'train'} exists already" in capsys.readouterr().err
    for other in ("photos", "mnist"):  # into an image folder: it would read as more classes, or mixed layouts
        assert demo_data.main(["--dataset", other, str(tmp_path / "demo")]) == 2
        assert f"error: {tmp_path / 'demo'} holds test, train: " in capsys.readouterr().err
    assert json.dumps(sorted(p.name for p in (tmp_path / "demo").iterdir())) == '["test", "train"]'
    assert demo_data.main(["--dataset", "mnist", str(tmp_path / "data")]) == 0
    (tmp_path / "data" / ".DS_Store").touch()
    (tmp_path / "data" / "cache").mkdir()  # the image folders' cache, as in datasets/
    assert demo_data.main(["--dataset", "cifar10", str(tmp_path / "data")]) == 0  # built-in sets side by side
    images, labels = data_formats.read_split(tmp_path / "data", "train", task.DATASETS["mnist"])
    assert images.shape == (512, 28, 28, 1) and set(labels.tolist()) == set(range(10))
    assert demo_data.main(["--dataset", "photos", str(tmp_path / "data")]) == 2
    (tmp_path / "afile").write_text("mine\n")  # was a NotADirectoryError traceback
    for kind in ("folder", "photos", "mnist"):
        capsys.readouterr()
        assert demo_data.main(["--dataset", kind, str(tmp_path / "afile")]) == 2
        assert capsys.readouterr().err == f"error: {tmp_path / 'afile'} is a file, not a folder; give a new folder\n"
        assert demo_data.main(["--dataset", kind, str(tmp_path / "afile" / "sub")]) == 1  # was a traceback too
        assert capsys.readouterr().err.startswith(f"error: cannot write {tmp_path / 'afile' / 'sub'}")
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_job_script_takes_your_model_and_folder_relative_to_the_submit_directory(project):
    from test_job_scripts import job_env  # the stand-ins for apptainer, nvidia-smi and scontrol

    result = run(["bash", REPO / "singlegpu_job.sh", "--model", "my_net.py:Net", "--dataset", "folder", "--data-dir",
                  "images", "--cache-dir", "cache", "--epochs", "2", "--num-workers", "0", "--log-interval", "0"],
                 cwd=project, env=job_env(project, SLURM_SUBMIT_DIR=project, PROJECT_DIR=REPO))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Training Net(num_classes=4, in_channels=3, image_size=(32, 32)) from my_net.py" in result.stdout
    weights = next((project / "checkpoints").glob("singlegpu_*/weights.pt"))
    assert torch.load(weights, weights_only=True)._metadata[""]["task"]["classes"][0] == "class_0"
    assert "Traceback" not in result.stderr


def test_the_cache_can_be_built_ahead_with_trainings_flags_and_other_sizes_are_kept(tmp_path, capsys):
    root = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, stray=False)
    (root / "test").rename(tmp_path / "elsewhere")  # a train/ alone: --val-fraction, as train.py takes it
    cache = tmp_path / "cache"
    data_flags = ("--dataset", "folder", "--data-dir", root, "--cache-dir", cache, "--val-fraction", "0.25",
                  "--image-size", "16", "--augment", "resized-crop")
    assert du.main(list(map(str, data_flags))) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("Images: 18x18 (8/7 of --image-size 16x16 for resized-crop;")  # after
    # Decoding ... and Decoded ...
    assert out.splitlines()[-1] == (f"Image folder {root} ready in {next(cache.glob('images-*/18x18-*'))}: 8 "
                                    "training images (2 of them held out for validation by --val-fraction 0.25) of "
                                    "2 classes")
    # train.py with the same flags finds it: nothing decoded again.
    assert run_main("train.py", *data_flags, "--model", "model:WideResNet", "--epochs", "1", "--batch-size", "2",
                    *FAST) == 0
    assert "Decoding" not in capsys.readouterr().out
    # The size chosen from the data is another cache; the one at 18x18 stays.
    image_cache.prepare_folder(root, cache, log=lambda _: None, held_out=True)
    assert len(list(cache.glob("images-*/18x18-*"))) == 1 and len(list(cache.glob("images-*/auto-*"))) == 1
    assert du.main(["--dataset", "folder", "--data-dir", str(root)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --data-dir {root}: no {root}/test/ or {root}/val/ (expected {root}/train/CLASS/IMAGE and "
        f"{root}/test/CLASS/IMAGE, or val/ for test/); to validate on part of {root}/train/ instead, add "
        "--val-fraction 0.2 (20% of each class held out)"]


def test_sixteen_bit_gray_images_are_scaled_not_clipped(tmp_path):
    root = tmp_path / "images"
    for split in ("train", "test"):
        for name in ("a", "b"):  # two classes: one is refused
            (root / split / name).mkdir(parents=True)
            Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)).save(root / split / name / "x.png")
    assert Image.open(root / "train" / "a" / "x.png").mode.startswith("I")
    data = image_cache.read_folder_cache(image_cache.prepare_folder(root, tmp_path / "c", log=lambda _: None))
    assert data.train[0].shape == (2, 8, 8, 1) and data.train[0].max() == 128  # 32768 / 257, not 255




@pytest.mark.parametrize("loader", ["cache", "dali"])
def test_an_image_beside_the_class_folders_is_a_warning_not_a_file_that_is_no_image(tmp_path, capsys, monkeypatch,
                                                                                  loader):
    """train/stray.png belongs to no class and is left out: it was counted among the "files that
    are not images", so the user looked for a file that was not an image and found only images."""
    monkeypatch.chdir(tmp_path)
    write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2)
    shutil.copy(tmp_path / "images" / "train" / "class_0" / "image_0.png", tmp_path / "images" / "train" / "stray.png")
    assert du.main(["--dataset", "folder", "--data-dir", "images", "--cache-dir", "cache", "--loader", loader]) == 0
    out = capsys.readouterr().out
    assert "\nIgnored 2 files that are not images, e.g. images/train/class_0/notes.txt\n" in out  # as before
    assert ("\nWARNING: 1 image lies beside the class folders, in no class, and is left out, e.g. "
            "images/train/stray.png: move each into the folder of its class (images/train/CLASS/)\n") in out
