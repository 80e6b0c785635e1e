"""From a folder of photos to a trained model: a validation split held out of train/, the
photo augmentation (resized-crop, the same in both loaders), fine-tuning an ImageNet-style
network with a new head, and the checks that keep each of them one line when misused."""

import csv
import os
import re
import shutil
import subprocess
import struct
import sys

import numpy as np
import pytest
import torch
import torchvision
import torchvision.transforms.functional as TF
from torchvision.ops import roi_align
from torchvision.transforms import v2
from PIL import Image, ImageOps, PngImagePlugin

import dataset_utils as du
import recipe
from conftest import (REPO, TINY_MODEL, error_lines, python_cmd, read_metrics, run, run_main, torchrun_cmd,
                      write_image_folder)
from engine.checkpoints import checkpoint_paths
from engine.errors import UserError
from engine.folder_lock import FolderLock
from engine.finetune import finetune, load_fitting
from engine.image_cache import read_folder_cache
from engine.image_folder import Header, Unreadable, cover_size, decode, header, image_notes, scan
from engine.image_list import checked
from engine.models import make_model
from engine.plugins import load_plugin
from engine.task import describe_split, held_out_again, held_out_record, names_sha256, stratified_split
from engine.weights import save_weights
from tools.benchmark import TorchvisionResizedCrops
from tools.demo_data import write_photo_folder

RESNET18 = "torchvision.models:resnet18"


# Every pixel position has its own weight (no pooling): an input cropped, scaled or normalized
# otherwise than validation's changes the outputs, and so the accuracy.
PIXEL_NET = """
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                    nn.Flatten(), nn.Linear(4 * image_size[0] * image_size[1], num_classes))

    def forward(self, x):
        return self.layers(x)
"""
# Three files of the folder that cannot be read, each in its own way: pixels cut short (the header
# reads), text named .jpg, a link to nothing.
BAD_FILES = {"cat/IMG_9001.JPG": "image file is truncated", "dog/notes.jpg": "cannot identify image file",
             "red panda/gone.png": "No such file or directory"}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """A photo folder in the everyday layout (photos/CLASS/IMAGE, 61 readable images of 60x80 to
    500x333 pixels) with BAD_FILES among them, and a 1000-class resnet18 state_dict (ImageNet's
    shape)."""
    root = tmp_path_factory.mktemp("photos")
    folder = write_photo_folder(root / "photos")
    jpeg = next((folder / "cat").glob("*.JPG"))
    (folder / "cat" / "IMG_9001.JPG").write_bytes(jpeg.read_bytes()[:2000])
    (folder / "dog" / "notes.jpg").write_text("not a photo\n")
    (folder / "red panda" / "gone.png").symlink_to(root / "nowhere.png")
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), root / "resnet18.pt")
    (root / "pixel_net.py").write_text(PIXEL_NET)
    return root


def photo_args(*extra):
    return ("--dataset", "folder", "--data-dir", "photos", "--cache-dir", "cache", "--val-fraction", "0.2",
            "--batch-size", "16", *extra)


@pytest.fixture(scope="module")
def trained(photos):
    """(the start-up output, the run's metrics) of 2 epochs of PIXEL_NET, named by its absolute
    path, at --image-size 32 on the photos: w.pt, ck/, m.jsonl in the photos' folder."""
    result = run(python_cmd("train.py", *photo_args("--model", f"{photos}/pixel_net.py:Net", "--image-size", "32",
                                                    "--epochs", "2", "--save-weights", "w.pt", "--checkpoint-dir",
                                                    "ck", "--metrics-file", "m.jsonl", "--log-interval", "0")),
                 cwd=photos)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout, read_metrics(photos / "m.jsonl")


# ---------------------------------------------------------------------------------------------
# The validation split.

def test_the_split_is_stratified_disjoint_and_a_function_of_the_seed():
    labels = np.repeat(np.arange(4), [50, 20, 7, 1])
    split = stratified_split(labels, 0.2, seed=5)
    assert np.array_equal(np.sort(np.concatenate(split)), np.arange(len(labels)))  # every image once
    assert np.bincount(labels[split.val], minlength=4).tolist() == [10, 4, 1, 0]  # a class of one stays in training
    again = stratified_split(labels, 0.2, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(split, again))
    assert not np.array_equal(stratified_split(labels, 0.2, seed=6).val, split.val)
    # Another process (another hash seed, another numpy state) draws the same split: every rank agrees.
    code = ("import numpy as np; from engine.task import stratified_split; np.random.seed(1); "
            "print(stratified_split(np.repeat(np.arange(4), [50, 20, 7, 1]), 0.2, 5).val.tolist())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == str(split.val.tolist())
    # The start-up block names the class of one image, which validation never sees.
    line = describe_split(split, 0.2, 5, ("cat", "dog", "fox", "owl"), labels)
    assert line.endswith("the training split is the other 63; 1 class has a single image, kept for training, so none "
                         "validated (e.g. owl)"), line
    assert describe_split(stratified_split(labels[:-1], 0.2, 5), 0.2, 5, ("cat", "dog", "fox"), labels[:-1]).endswith(
        "the training split is the other 62")


def test_the_held_out_images_are_found_again_only_in_the_same_images():
    labels = np.repeat(np.arange(3), [20, 21, 20])
    record = held_out_record(0.2, 7, labels, skipped=["cat/x.jpg"])
    assert np.array_equal(held_out_again(labels, record, "--held-out photos"), stratified_split(labels, 0.2, 7).val)
    with pytest.raises(UserError, match=r"^--held-out photos is not the folder the weights were trained on, or it has "
                                        r"changed since \(62 training images now, 61 then"):
        held_out_again(np.append(labels, 2), record, "--held-out photos")  # a photo added
    relabelled = labels.copy()
    relabelled[[0, 20]] = relabelled[[20, 0]]  # as many, of other classes: a renamed folder
    with pytest.raises(UserError, match="or other labels"):
        held_out_again(relabelled, record, "--held-out photos")
    # By name: a photo renamed moves others between training and validation, with the same labels.
    names = [f"{c}/IMG_{i:04d}.JPG" for c, n in zip(("cat", "dog", "red panda"), (20, 21, 20)) for i in range(n)]
    named = held_out_record(0.2, 7, labels, names=names_sha256(names))
    assert np.array_equal(held_out_again(labels, named, "--held-out photos", names_sha256(names)),
                          stratified_split(labels, 0.2, 7).val)
    assert np.array_equal(held_out_again(labels, named, "--held-out photos"), stratified_split(labels, 0.2, 7).val)
    renamed = [*names[1:20], "cat/zz.JPG", *names[20:]]
    with pytest.raises(UserError, match=r"changed since \(the same number of images of each class, but other file "
                                        r"names: renamed, moved or replaced\)"):
        held_out_again(labels, named, "--held-out photos", names_sha256(renamed))
    assert np.array_equal(held_out_again(labels, record, "--held-out photos", names_sha256(renamed)),
                          stratified_split(labels, 0.2, 7).val)  # weights that record no names: as before


def test_a_folder_of_class_folders_needs_the_split_and_mixed_layouts_are_one_line(photos, tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.chdir(photos)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", "photos", "--cache-dir", "cache") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --data-dir photos holds its class folders directly (photos/CLASS/IMAGE, 3 classes) and no test/ to "
        "validate on: add --val-fraction 0.2 to hold out 20% of each class for validation"]
    mixed = tmp_path / "mixed"
    for name in ("train/cat/a.png", "cat/b.png", "dog/c.png"):
        (mixed / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(mixed / name)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", mixed, "--val-fraction", "0.2") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --data-dir {mixed} mixes two layouts: train/ beside the class folder(s) cat, dog; keep either "
        f"{mixed}/CLASS/IMAGE or {mixed}/train/CLASS/IMAGE (with {mixed}/test/CLASS/IMAGE)"]


def test_a_folder_of_one_class_is_one_line_naming_the_folder_meant(photos, tmp_path, capsys, monkeypatch):
    """--data-dir one level too high (a folder holding the folder of class folders) has one
    "class": one line naming the folder meant; a folder of one real class, one line too; so is
    --eval-only of weights trained on one class (predict.py: tests/test_predict.py)."""
    monkeypatch.chdir(photos)
    shutil.copytree(photos / "photos", tmp_path / "wrap" / "photos", symlinks=True)
    (tmp_path / "solo" / "cat").mkdir(parents=True)
    for path in sorted((photos / "photos" / "cat").glob("IMG_*"))[:4]:
        shutil.copy(path, tmp_path / "solo" / "cat")
    hints = {"wrap": f"did you mean --data-dir {tmp_path / 'wrap' / 'photos'}?",
             "solo": f"add a folder of images for each other class ({tmp_path / 'solo'}/CLASS/IMAGE)"}
    # With --val-fraction or without: the one class is the first thing to fix, not the missing validation.
    for folder, split in (("wrap", ["--val-fraction", "0.2"]), ("solo", ["--val-fraction", "0.2"]), ("solo", [])):
        assert run_main("train.py", "--dataset", "folder", "--data-dir", tmp_path / folder, *split,
                        "--cache-dir", tmp_path / "cache") == 2
        hint = hints[folder]
        inner = "photos" if folder == "wrap" else "cat"
        assert error_lines(capsys.readouterr().err) == [
            f"error: {tmp_path / folder} holds 1 class folder ({inner}): a classifier needs at least two; {hint}"]
    assert not (tmp_path / "cache").exists()  # refused before anything is decoded
    model = make_model(load_plugin(f"{photos}/pixel_net.py:Net", "--model"), "Net", num_classes=1, in_channels=3,
                       image_size=(8, 8))[0]
    save_weights(model, tmp_path / "one.pt", {"classes": ["photos"], "dataset": "folder", "image_size": [8, 8],
                                              "in_channels": 3, "mean": [0.5] * 3, "std": [0.25] * 3})
    assert run_main("train.py", "--eval-only", "--weights", tmp_path / "one.pt") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --weights {tmp_path / 'one.pt'} were trained on 1 class (photos): a classifier needs at least two; "
        "train again on a folder of class folders (did --data-dir name the folder that holds them?)"]


# ---------------------------------------------------------------------------------------------
# resized-crop.

def test_crop_resize_is_torchvisions_resized_crop():
    images = torch.randint(0, 256, (6, 40, 50, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    rng = np.random.default_rng(0)
    for image in images:
        height, width = int(rng.integers(8, 41)), int(rng.integers(8, 51))
        top, left = int(rng.integers(0, 41 - height)), int(rng.integers(0, 51 - width))
        box = [torch.tensor([float(v)], dtype=torch.float64) for v in (top, left, height, width)]
        ours = recipe.crop_resize(image[None], *box, (24, 30))[0]
        theirs = TF.resized_crop(image.permute(2, 0, 1), top, left, height, width, [24, 30],
                                 antialias=False).permute(1, 2, 0)
        assert (ours.int() - theirs.int()).abs().max() <= 1  # both round a float; ties may differ


def test_crop_resize_of_fractional_boxes_is_torchvisions_roi_align():
    """Training's boxes are fractional (recipe.resized_crop draws them continuously): each output
    pixel samples the box bilinearly at its centre, which is torchvision.ops.roi_align with
    aligned=True and one sample per bin. Boxes that shrink compare whole; boxes that enlarge
    compare inside their first and last rows and columns, which crop_resize keeps within the
    box (roi_align samples half a pixel outside it)."""
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (64, 40, 50, 3), dtype=torch.uint8, generator=generator)
    size = (12, 15)
    shrink = torch.rand(64, generator=generator, dtype=torch.float64) < 0.5
    low = torch.where(shrink, torch.tensor(12.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64))
    height = low + torch.rand(64, generator=generator, dtype=torch.float64) * (40 - low)
    width = low + 3 + torch.rand(64, generator=generator, dtype=torch.float64) * (50 - low - 3)
    top = torch.rand(64, generator=generator, dtype=torch.float64) * (40 - height)
    left = torch.rand(64, generator=generator, dtype=torch.float64) * (50 - width)
    assert (height.frac() > 0).all() and (top.frac() > 0).all()  # fractional boxes, as training draws them
    ours = recipe.crop_resize(images, top, left, height, width, size).int()  # (B, h, w, C)
    boxes = torch.stack([torch.arange(64, dtype=torch.float64), left, top, left + width, top + height], 1).float()
    theirs = roi_align(images.permute(0, 3, 1, 2).float(), boxes, size, spatial_scale=1.0, sampling_ratio=1,
                       aligned=True).round().int().permute(0, 2, 3, 1)
    enlarged = (height < size[0]) | (width < size[1])
    assert enlarged.any() and (~enlarged).any()
    assert (ours[~enlarged] - theirs[~enlarged]).abs().max() <= 1  # both round a float; ties may differ
    assert (ours[enlarged, 1:-1, 1:-1] - theirs[enlarged, 1:-1, 1:-1]).abs().max() <= 1


def test_resized_crops_cover_the_scale_and_ratio_range():
    """Each crop's box, recovered from an image whose pixels are their own coordinates, has an
    area of 1/4 to all of the image and an aspect ratio of 3/4 to 4/3 (clamped at the edges)."""
    size = 64
    rows, cols = np.mgrid[:size, :size]
    coordinates = np.stack([rows * 4, cols * 4, np.zeros_like(rows)], -1).astype(np.uint8)  # 0..252
    images = torch.from_numpy(np.repeat(coordinates[None], 2000, 0))
    prep = du.preprocessing((16, 16, 3), (0.5,) * 3, (0.25,) * 3, "resized-crop")
    rand = torch.rand((2000, recipe.RANDOM_PER_OP), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    crops = recipe.resized_crop(images, rand, prep).float() / 4  # (B, 16, 16, 3), back in pixels
    height = (crops[:, -1, :, 0] - crops[:, 0, :, 0]).mean(1) * 16 / 15  # centre spacing x 16 = the box side
    width = (crops[:, :, -1, 1] - crops[:, :, 0, 1]).mean(1) * 16 / 15
    area = height * width / size**2
    assert area.min() > 0.2 and area.max() <= 1.02 and area.quantile(0.5) > 0.45
    assert (width / height).min() > 0.7 and (width / height).max() < 1.4


def two_sample_ks(a, b):
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = np.sort(np.asarray(a)), np.sort(np.asarray(b))
    both = np.concatenate([a, b])
    return np.abs(np.searchsorted(a, both, "right") / len(a) - np.searchsorted(b, both, "right") / len(b)).max()


def ks_limit(n, m):
    """The statistic that equal distributions exceed with probability 1e-4 (samples n and m)."""
    return 2.15 * ((n + m) / (n * m)) ** 0.5


@pytest.mark.oldest_torch  # RandomResizedCrop.get_params of torchvision 0.22
@pytest.mark.parametrize("height, width", [(64, 64), (300, 900)])
def test_resized_crop_boxes_are_drawn_as_torchvisions(height, width):
    """The device loader's batched boxes against RandomResizedCrop.get_params (ten draws, then the
    centre): the same distribution of area, aspect and position, and as often the centre, also
    on an image so wide that most draws miss."""
    n = 4000
    rand = torch.rand((n, 4), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    top, left, box_h, box_w = (v.numpy() for v in recipe.random_boxes(rand, height, width, (0.25, 1.0),
                                                                             (3 / 4, 4 / 3)))
    torch.manual_seed(3)
    image = torch.zeros(3, height, width)
    theirs = np.array([torchvision.transforms.RandomResizedCrop.get_params(image, [0.25, 1.0], [3 / 4, 4 / 3])
                       for _ in range(n)], dtype=np.float64)  # (n, 4): top, left, height, width
    ours = np.stack([top, left, box_h, box_w], 1)
    for name, f in [("area", lambda b: b[:, 2] * b[:, 3]), ("aspect", lambda b: b[:, 3] / b[:, 2])]:
        assert two_sample_ks(f(ours), f(theirs)) < ks_limit(n, n), name
    for axis in (0, 1):  # the box's centre: whole pixels in torchvision's, so its mean and spread
        centre, centre_ref = ours[:, axis] + ours[:, axis + 2] / 2, theirs[:, axis] + theirs[:, axis + 2] / 2
        assert abs(centre.mean() - centre_ref.mean()) < 5 * ((centre.var() + centre_ref.var()) / n) ** 0.5, axis
        assert abs(centre.std() / centre_ref.std() - 1) < 0.1, axis
    centred = lambda b: np.isclose(b[:, 1], (width - b[:, 3]) / 2, atol=0.5) & (b[:, 2] == height)  # noqa: E731
    assert abs(centred(ours).mean() - centred(theirs).mean()) < 5 * 0.5 / n**0.5


@pytest.mark.oldest_torch  # v2.RandomResizedCrop on uint8 tensors in torchvision 0.22
def test_both_loaders_draw_resized_crops_alike_and_test_on_the_same_centre_crop():
    """Each loader's crops (the boxes read back from an image whose pixels are their own
    coordinates) have one distribution of area and aspect, the batched one's and torchvision's
    RandomResizedCrop's; test images are the same centre crop in both."""
    n, size, out = 1500, 64, 56  # stored at 8/7 of the training size, as resized-crop stores photos
    rows, cols = np.mgrid[:size, :size]
    coordinates = np.stack([rows * 4, cols * 4, np.zeros_like(rows)], -1).astype(np.uint8)  # 0..252
    prep = du.preprocessing((out, out, 3), (0.0,) * 3, (1.0,) * 3, "resized-crop", stored_size=(size, size))
    train_set = du.InMemoryImages(np.repeat(coordinates[None], n, 0), np.arange(n), prep)
    boxes, tests = [], []
    for kind in ("device", "torchvision"):
        train, test = du.build_loaders(train_set, train_set.subset(range(8)), 500, loader=kind, seed=1,
                                       device=torch.device("cpu"))
        x = torch.cat([images for images, _ in train]) * 255 / 4  # (n, 3, out, out): source coordinates
        box_h = (x[:, 0, -1, :] - x[:, 0, 0, :]).mean(1) * out / (out - 1)  # first to last pixel centre
        box_w = (x[:, 1, :, -1] - x[:, 1, :, 0]).abs().mean(1) * out / (out - 1)  # abs: flipped ones too
        boxes.append((box_h * box_w / size**2, box_w / box_h))
        tests.append(torch.cat([images for images, _ in test]))
    (area, aspect), (area_ref, aspect_ref) = boxes
    assert len(area) == len(area_ref) == n
    assert two_sample_ks(area, area_ref) < ks_limit(n, n) and two_sample_ks(aspect, aspect_ref) < ks_limit(n, n)
    assert 0.24 < area.min() and area.max() < 1.02 and 0.74 < aspect.min() and aspect.max() < 1.35
    assert torch.equal(tests[0], tests[1])
    expected = torch.from_numpy(coordinates[4:60, 4:60]).float().div(255).permute(2, 0, 1)  # offsets (64 - 56) / 2
    assert torch.allclose(tests[0], expected.expand(8, -1, -1, -1), atol=1e-6)


def test_augment_auto_picks_resized_crop_for_photos_only():
    assert recipe.auto_augment(65) == "resized-crop" and recipe.auto_augment(64) == "flip-crop"
    # --loader dali checks the operations of both before the images are measured (dataset_utils.dali_choice)
    assert {recipe.auto_augment(65), recipe.auto_augment(64)} == set(recipe.AUGMENT_AUTO) <= set(recipe.AUGMENTATIONS)
    assert recipe.stored_size("resized-crop", (224, 224)) == (256, 256)
    assert recipe.training_size("resized-crop", (256, 256)) == (224, 224)
    assert recipe.stored_size("flip-crop", (32, 48)) == (32, 48)


# ---------------------------------------------------------------------------------------------
# Fine-tuning.

def test_finetune_keeps_what_fits_and_names_the_new_head(tmp_path):
    torch.manual_seed(0)
    source = torchvision.models.resnet18()
    torch.save(source.state_dict(), tmp_path / "r18.pt")
    model = torchvision.models.resnet18(num_classes=3)
    fresh_fc = model.fc.weight.detach().clone()
    note = finetune(model, tmp_path / "r18.pt", True, "resnet18", ("a", "b", "c"))
    assert note == (f"fine-tuning from {tmp_path / 'r18.pt'}: 120 of 122 tensors loaded; new: fc.weight, fc.bias "
                    "(1000 -> 3 classes); --freeze-backbone: only fc.weight, fc.bias train")
    assert torch.equal(model.conv1.weight, source.conv1.weight) and torch.equal(model.fc.weight, fresh_fc)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]


def test_finetune_refuses_other_networks_in_one_line(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "r18.pt")
    with pytest.raises(UserError, match=r"does not fit resnet34 beyond its last layers: layer1.2.conv1.weight is "
                                        r"missing in the file, \(64, 64, 3, 3\) in the model \(and \d+ more\)"):
        load_fitting(torchvision.models.resnet34(num_classes=3), tmp_path / "r18.pt", "resnet34", ("a", "b", "c"))
    with pytest.raises(UserError, match=r"none of its 122 tensors fits Net \(the model's first, 0.weight, is missing "
                                        r"in the file, \(3, 2\) in the model\)"):
        load_fitting(torch.nn.Sequential(torch.nn.Linear(2, 3)), tmp_path / "r18.pt", "Net", ("a", "b", "c"))
    # A deeper network of the same family: its first layers fit by name and shape, most of the file is unused.
    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "r34.pt")
    with pytest.raises(UserError, match=rf"^--finetune {tmp_path / 'r34.pt'}: only 120 of its 218 tensors \(55%\) fit "
                                        r"resnet18, and 98 have no place in it \(e.g. [\w.]+\): the weights of another "
                                        r"network \(another depth or width\?\); use weights of the --model you train$"):
        load_fitting(torchvision.models.resnet18(num_classes=3), tmp_path / "r34.pt", "resnet18", ("a", "b", "c"))
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "same.pt")
    with pytest.raises(UserError, match="none is new, so nothing would train; drop --freeze-backbone"):
        finetune(torchvision.models.resnet18(num_classes=3), tmp_path / "same.pt", True, "resnet18", ("a", "b", "c"))


def test_finetune_on_as_many_other_classes_starts_a_new_head(tmp_path):
    """Weights trained on cat, dog, red panda fine-tuned for apple, leaf, sky: the head fits by
    shape, but its rows are the file's classes; it starts fresh, as the start-up block says. The
    same classes keep it (a run continued on its own classes)."""
    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=3)
    save_weights(source, tmp_path / "pets.pt", {"classes": ["cat", "dog", "red panda"]})
    model = torchvision.models.resnet18(num_classes=3)
    fresh_fc = model.fc.weight.detach().clone()
    note = finetune(model, tmp_path / "pets.pt", False, "resnet18", ("apple", "leaf", "sky"))
    assert note == (f"fine-tuning from {tmp_path / 'pets.pt'}: 120 of 122 tensors loaded; new: fc.weight, fc.bias "
                    "(the file's 3 classes are others: cat, dog, red panda)")
    assert torch.equal(model.conv1.weight, source.conv1.weight) and torch.equal(model.fc.weight, fresh_fc)
    same = torchvision.models.resnet18(num_classes=3)
    note = finetune(same, tmp_path / "pets.pt", False, "resnet18", ("cat", "dog", "red panda"))
    assert note.endswith("122 of 122 tensors loaded; none new") and torch.equal(same.fc.weight, source.fc.weight)
    fewer = torchvision.models.resnet18(num_classes=2)  # other classes, fewer of them: both counts named
    note = finetune(fewer, tmp_path / "pets.pt", False, "resnet18", ("apple", "leaf"))
    assert note.endswith("new: fc.weight, fc.bias (3 -> 2 classes; the file's were cat, dog, red panda)"), note


def test_torchvision_models_get_no_in_channels_and_refuse_gray_data():
    factory = load_plugin(RESNET18, "--model")
    model, name = make_model(factory, RESNET18, num_classes=3, in_channels=3, image_size=(64, 64))
    assert name == "resnet18(num_classes=3) from torchvision.models" and model.fc.out_features == 3
    with pytest.raises(UserError, match="takes no in_channels, so it expects RGB images, but the data has 1 channel"):
        make_model(factory, RESNET18, num_classes=3, in_channels=1, image_size=(64, 64))


# ---------------------------------------------------------------------------------------------
# The whole way, as a user goes it.

def test_every_unreadable_photo_is_named_in_one_run_and_left_out(photos, trained):
    out, records = trained
    assert "Decoding 64 images of 3 classes" in out  # 61 photos, BAD_FILES; README.txt, Thumbs.db ignored
    assert "Ignored 4 files that are not images" in out
    warning = out.index("WARNING: skipped 3 unreadable images, not trained or validated on")
    named = sorted(out[warning:].splitlines()[1:4])
    for line, (path, why) in zip(named, sorted(BAD_FILES.items())):  # each, with why
        assert line.startswith(f"  photos/{path}: {why}"), line
    cache = next(line for line in out.splitlines() if line.startswith("Cache: ")).split()[1]
    listed = (photos / cache / "unreadable.txt").read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in listed) == sorted(f"photos/{path}" for path in BAD_FILES)
    # The 61 readable photos are what the split and training see.
    assert ("Validation: 12 of the 61 training images held out (--val-fraction 0.2 of each of the 3 classes, chosen "
            "by --seed 0); the training split is the other 49") in out
    assert [r["val_samples"] for r in records] == [12, 12] and [r["train_images"] for r in records] == [48, 48]
    assert f"Final Accuracy: {records[-1]['val_accuracy']:.4f} on all 12 held-out images" in out


def test_augment_auto_looks_at_the_photos_not_at_the_image_size(trained):
    out, _ = trained
    assert ("--augment auto: resized-crop, as the images are photos (median shorter side 96 pixels, larger than 64)"
            in out)  # trained at 32 pixels all the same
    assert "Images: 37x37 (8/7 of --image-size 32x32 for resized-crop; 61 resized" in out
    assert "Augmentation: resized-crop (resized_crop, flip; stored 37x37, trained on 32x32 crops" in out


def test_held_out_predictions_are_validations_own(photos, trained, tmp_path):
    """predict.py --held-out classifies exactly the images validation held out, from another
    folder and without --model (the absolute path of pixel_net.py is in the weights), with
    training's validation accuracy."""
    _, records = trained
    result = run(python_cmd("predict.py", "--weights", photos / "w.pt", "--held-out", photos / "photos", "--output",
                            "val.csv"), cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    with open(tmp_path / "val.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == records[-1]["val_samples"] == 12
    assert all(row["label"] == row["path"].split("/")[-2] for row in rows)  # each photo's own class folder
    accuracy = sum(row["label"] == row["prediction"] for row in rows) / len(rows)
    assert accuracy == pytest.approx(records[-1]["val_accuracy"], abs=1e-9) and 0 < accuracy < 1
    assert f"Accuracy: {accuracy:.4f} ({round(accuracy * 12)} of 12) on the 12 images --val-fraction 0.2 (--seed 0) " \
           f"held out of {photos / 'photos'}" in result.stdout
    # Exactly those training held out: of the readable photos in the order training read them, its split.
    files, labels = scan(photos / "photos", held_out=True).splits["train"]
    readable = [i for i, path in enumerate(files) if str(path.relative_to(photos / "photos")) not in BAD_FILES]
    cached = read_folder_cache(next((photos / "cache").glob("*/32x32-auto-*"))).train[1]
    assert np.array_equal(labels[readable], cached)
    held = stratified_split(cached, 0.2, 0).val
    assert [row["path"] for row in rows] == [str(files[readable[i]]) for i in held]


def test_eval_only_takes_everything_from_the_weights(photos, trained, tmp_path, capsys, monkeypatch):
    """--eval-only --weights W alone, elsewhere: the model, the folder, the image size, the
    augment (the stored size), the normalization and the split come from W, and the
    accuracy is validation's. A flag that contradicts W is one line."""
    _, records = trained
    monkeypatch.chdir(tmp_path)
    assert run_main("train.py", "--eval-only", "--weights", photos / "w.pt", "--cache-dir", photos / "cache",
                    "--metrics-file", "e.jsonl") == 0
    out = capsys.readouterr().out
    assert "Decoding" not in out  # training's cache
    assert (f"Preprocessing: from --weights {photos / 'w.pt'}: 32x32 input, stored 37x37, trained with --augment "
            "resized-crop; normalization mean") in out
    [record] = read_metrics(tmp_path / "e.jsonl")
    assert (record["val_accuracy"], record["val_samples"]) == (records[-1]["val_accuracy"], 12)
    assert record["val_loss"] == pytest.approx(records[-1]["val_loss"], abs=1e-6)
    assert run_main("train.py", "--eval-only", "--weights", photos / "w.pt", "--image-size", "48") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"train.py: error: --image-size 48x48 contradicts --weights {photos / 'w.pt'}, whose training's image "
        "size was 32x32: leave it out, the weights say how their images were prepared (see --help)"]


def test_eval_only_with_a_val_fraction_the_weights_never_held_out_is_one_line(tmp_path, capsys, monkeypatch):
    """Weights trained on all of train/ (no --val-fraction), then --eval-only --val-fraction 0.5:
    it evaluated half the training images as "held-out images", every one of them trained on,
    and reported that accuracy with exit 0. And --dataset cifar10 on them downloaded CIFAR-10,
    and a folder of 3 classes was decoded whole, before the classes were found to differ."""
    images = write_image_folder(tmp_path / "images", classes=2, n_train=8, n_test=4, stray=False)
    monkeypatch.chdir(tmp_path)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", images, *TINY_MODEL, "--epochs", "1",
                    "--batch-size", "4", "--save-weights", "w.pt") == 0
    capsys.readouterr()
    assert run_main("train.py", "--eval-only", "--weights", "w.pt", "--val-fraction", "0.5") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"train.py: error: --val-fraction 0.5: --weights w.pt were trained on all the training images of {images} (no "
        "--val-fraction), so none is held out: these would score images the weights trained on; leave it out to "
        "evaluate the test images, or classify images never trained on with predict.py --labelled (see --help)"]
    # Another data set's class count is known without its files: not downloaded first (no internet here).
    assert run_main("train.py", "--eval-only", "--weights", "w.pt", "--dataset", "cifar10") == 2
    assert error_lines(capsys.readouterr().err) == [
        "train.py: error: --weights w.pt were trained on other classes (2 classes there, 10 in --dataset cifar10): "
        "their outputs would be read as the wrong labels; use the data set they were trained on (see --help)"]
    assert not (tmp_path / "datasets").exists()
    # So is an image folder's, from its class folders' names: not after its images are decoded into a cache.
    other = write_image_folder(tmp_path / "other", classes=3, n_train=2, n_test=1, stray=False)
    assert run_main("train.py", "--eval-only", "--weights", "w.pt", "--data-dir", other, "--cache-dir", "c") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --weights w.pt were trained on other classes (2 classes there, 3 here): their outputs would be read "
        "as the wrong labels; use the data set they were trained on"]
    assert not (tmp_path / "c").exists()
    assert run_main("train.py", "--eval-only", "--weights", "w.pt") == 0  # the test images, as training's
    assert re.search(r"Evaluation: Loss=[\d.]+, Accuracy=[\d.]+ on all 8 test images\n", capsys.readouterr().out)


def test_eval_only_on_a_folder_changed_since_training_is_one_line(photos, trained, capsys, monkeypatch):
    """Images added after training: the split drawn again holds out other images, some of them
    trained on, and the accuracy was that of another split, without a word (predict.py --held-out
    refused it already)."""
    added = photos / "photos" / "cat" / "added_later.png"
    Image.new("RGB", (80, 60), (200, 30, 30)).save(added)
    try:
        monkeypatch.chdir(photos)
        assert run_main("train.py", "--eval-only", "--weights", "w.pt", "--cache-dir", "cache") == 2
        assert error_lines(capsys.readouterr().err) == [
            f"error: --data-dir {photos / 'photos'} is not the folder the weights were trained on, or it has changed "
            "since (62 training images now, 61 then, or other labels): the images validation held out cannot be found "
            "again"]
    finally:
        added.unlink()
    assert run_main("train.py", "--eval-only", "--weights", "w.pt", "--cache-dir", "cache") == 0  # as trained: taken
    capsys.readouterr()
    # A photo renamed: as many of each class, but the split, which goes by the files' order, holds out others.
    first = sorted((photos / "photos" / "cat").glob("*.JPG"))[0]
    first.rename(first.with_name("zz_renamed.JPG"))
    try:
        changed = ("is not the folder the weights were trained on, or it has changed since (the same number of "
                   "images of each class, but other file names: renamed, moved or replaced): the images validation "
                   "held out cannot be found again")
        assert run_main("train.py", "--eval-only", "--weights", "w.pt", "--cache-dir", "cache") == 2
        assert error_lines(capsys.readouterr().err) == [f"error: --data-dir {photos / 'photos'} {changed}"]
        assert run_main("predict.py", "--weights", "w.pt", "--held-out", "photos") == 2
        assert error_lines(capsys.readouterr().err) == [f"error: --held-out photos {changed}"]
        resumed = photo_args("--model", f"{photos}/pixel_net.py:Net", "--image-size", "32", "--epochs", "2",
                             "--checkpoint-dir", "ck", "--resume", "--log-interval", "0")
        assert run_main("train.py", *resumed) == 2
        out, err = capsys.readouterr()
        assert "Training " not in out  # refused before the start-up block: the error is all there is to read
        [line] = error_lines(err)
        assert line.startswith("error: the checkpoint was trained on other data (61 training images, as then; "
                               "other file names (renamed, moved or replaced)"), line
    finally:
        first.with_name("zz_renamed.JPG").rename(first)


def test_a_photo_mended_after_training_is_left_out_of_the_evaluation_again(photos, trained, tmp_path, capsys,
                                                                          monkeypatch):
    """Training's warning says to fix or remove an unreadable photo; once fixed, --eval-only
    (like predict.py --held-out) leaves it out again and evaluates validation's own images,
    where it refused the weights as of another folder."""
    _, records = trained
    broken = photos / "photos" / "cat" / "IMG_9001.JPG"
    cut, when = broken.read_bytes(), broken.stat()
    broken.write_bytes(next((photos / "photos" / "cat").glob("IMG_000*.JPG")).read_bytes())
    try:
        monkeypatch.chdir(photos)
        assert run_main("train.py", "--eval-only", "--weights", "w.pt", "--cache-dir", "cache", "--metrics-file",
                        tmp_path / "e.jsonl") == 0
        [record] = read_metrics(tmp_path / "e.jsonl")
        assert (record["val_accuracy"], record["val_samples"]) == (records[-1]["val_accuracy"], 12)
        out = capsys.readouterr().out
        assert "Validation: 12 of the 61 training images held out" in out  # 62 read, 61 trained
        assert ("Left out: 1 image unreadable in training and readable now (cat/IMG_9001.JPG), as training had them"
                in out)
    finally:  # as it was, its time too: the cache's version goes by it, and later tests reuse the cache
        broken.write_bytes(cut)
        os.utime(broken, ns=(when.st_atime_ns, when.st_mtime_ns))


def test_eval_only_on_a_new_folder_of_class_folders_points_to_predict_labelled(photos, trained, tmp_path, capsys):
    """Without test/ there is nothing to evaluate; training's advice, --val-fraction, would
    evaluate a part and call the rest training images."""
    for name in ("cat", "dog"):  # one of them nested a level deeper, as a scan accepts it
        shutil.copytree(photos / "photos" / name, tmp_path / "new" / name / ("2023" if name == "cat" else ""))
    assert run_main("train.py", "--eval-only", "--weights", photos / "w.pt", "--data-dir", tmp_path / "new") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --eval-only evaluates the test/ images of an image folder, and --data-dir {tmp_path / 'new'} holds "
        f"its class folders directly: python predict.py --weights {photos / 'w.pt'} --labelled {tmp_path / 'new'} "
        "gives the accuracy over all of its images"]


def test_eval_only_on_the_training_folder_moved_points_to_predict_held_out(photos, trained, tmp_path, capsys):
    """The folder the weights trained on with --val-fraction, moved: --labelled, the advice for
    a new folder, would score the images they trained on too. --held-out finds the same images
    by name and scores those validation held out, as it said."""
    _, records = trained
    shutil.copytree(photos / "photos", tmp_path / "moved", symlinks=True)  # its dangling link too
    weights, moved = photos / "w.pt", tmp_path / "moved"
    assert run_main("train.py", "--eval-only", "--weights", weights, "--data-dir", moved) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --eval-only evaluates the test/ images of an image folder, and --data-dir {moved} holds its class "
        f"folders directly: the images --weights {weights} trained on, of which validation held 0.2 out "
        f"(--val-fraction); python predict.py --weights {weights} --held-out {moved} evaluates those again"]
    assert run_main("predict.py", "--weights", weights, "--held-out", moved, "--output", tmp_path / "val.csv") == 0
    out = capsys.readouterr().out
    assert "Classified 12 images" in out and f"12 images --val-fraction 0.2 (--seed 0) held out of {moved}" in out, out

def test_two_processes_evaluate_the_same_held_out_photos(photos, trained):
    _, records = trained
    two = run(torchrun_cmd(2, "train_ddp.py", "--eval-only", "--weights", "w.pt", "--cache-dir", "cache",
                           "--metrics-file", "eval2.jsonl"), cwd=photos)
    assert two.returncode == 0, two.stderr
    [record] = read_metrics(photos / "eval2.jsonl")
    assert record["world_size"] == 2 and record["val_samples"] == 12  # each held-out photo once
    assert record["val_accuracy"] == records[-1]["val_accuracy"]
    assert record["val_loss"] == pytest.approx(records[-1]["val_loss"], abs=1e-6)


def test_a_moved_model_file_is_found_beside_the_weights_or_named(photos, trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", sys.path[:])  # predict.py imports pixel_net.py in this process: not for others
    monkeypatch.setitem(sys.modules, "pixel_net", None)
    state = torch.load(photos / "w.pt", weights_only=True)
    task = state._metadata[""]["task"]
    assert task["model"] == "pixel_net:Net" and task["model_file"] == str(photos / "pixel_net.py")
    assert task["model_file_near"] == "pixel_net.py"
    task["model_file"] = "/gone/pixel_net.py"  # the project folder moved, with the weights beside the model
    torch.save(state, tmp_path / "w.pt")
    shutil.copy(photos / "pixel_net.py", tmp_path / "pixel_net.py")
    assert run_main("predict.py", "--weights", tmp_path / "w.pt", photos / "photos" / "cat") == 0
    assert "Classified 21 images with Net" in capsys.readouterr().err
    (tmp_path / "pixel_net.py").unlink()
    assert run_main("predict.py", "--weights", tmp_path / "w.pt", photos / "photos" / "cat") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --weights {tmp_path / 'w.pt'} were trained with --model /gone/pixel_net.py:Net, which is no longer "
        f"there (nor at {tmp_path / 'pixel_net.py'}); pass --model path/to/pixel_net.py:Net"]
    task["model_file"] = str(tmp_path / "pixel_net.py")  # removed from beside the weights: one place, named once
    torch.save(state, tmp_path / "w.pt")
    assert run_main("predict.py", "--weights", tmp_path / "w.pt", photos / "photos" / "cat") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --weights {tmp_path / 'w.pt'} were trained with --model {tmp_path / 'pixel_net.py'}:Net, which is no "
        "longer there; pass --model path/to/pixel_net.py:Net"]


def test_a_resume_with_other_data_flags_is_refused_before_any_decoding(photos, trained, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.chdir(photos)
    shutil.copytree(photos / "ck", tmp_path / "ck")
    common = photo_args("--model", "pixel_net.py:Net", "--checkpoint-dir", tmp_path / "ck", "--resume")
    assert run_main("train.py", *common, "--image-size", "40", "--epochs", "3") == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no start-up block, nothing decoded at 40
    assert error_lines(captured.err) == [
        "error: --resume continues the checkpoint's run, which had --image-size 32x32 (now 40x40); rerun with its "
        "values or start a new --checkpoint-dir"]
    assert run_main("train.py", *common, "--image-size", "32", "--epochs", "3", "--seed", "1",
                    "--val-fraction", "0.3") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --resume continues the checkpoint's run, which had --seed 0 (now 1), --val-fraction 0.2 (now 0.3); "
        "rerun with its values or start a new --checkpoint-dir"]
    # Another built-in data set: refused before it is looked for (and downloaded), not after.
    assert run_main("train.py", "--model", "pixel_net.py:Net", "--checkpoint-dir", tmp_path / "ck", "--resume",
                    "--dataset", "cifar10", "--data-dir", tmp_path / "none", "--epochs", "3") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: the checkpoint was trained on --dataset folder, this run is --dataset cifar10; resume with --dataset "
        "folder, or start a new run in another --checkpoint-dir"]
    assert not (tmp_path / "none").exists()
    resumed = run(python_cmd("train.py", *common, "--image-size", "32", "--epochs", "3", "--metrics-file",
                             tmp_path / "m.jsonl"), cwd=photos)
    assert resumed.returncode == 0, resumed.stderr
    assert "Decoding" not in resumed.stdout and "Validation: 12 of the 61 training images held out" in resumed.stdout
    assert [r["epoch"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3]


def test_what_the_outputs_claim_would_refuse_is_refused_before_any_decoding(photos, trained, tmp_path, capsys,
                                                                           monkeypatch):
    """A mistyped --weights or --finetune, a --resume with nothing to continue, another run's
    checkpoint folder or --save-weights file, a folder a live run holds (the same job submitted
    twice: --resume=auto): each was one line only after the whole folder was decoded into a new
    cache (minutes, for a large one). Now before: no cache is made."""
    monkeypatch.chdir(photos)
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken.pt").write_bytes(b"someone's weights")
    cases = [(("--weights", tmp_path / "nope.pt"), f"error: --weights {tmp_path / 'nope.pt'}: no such file"),
             (("--finetune", tmp_path / "nope.pt"), f"error: --finetune {tmp_path / 'nope.pt'}: no such file"),
             (("--checkpoint-dir", tmp_path / "empty", "--resume"),
              f"error: --resume: no checkpoint in {tmp_path / 'empty'}, nothing to continue (--resume=auto starts a "
              "new run where there is none)"),
             (("--checkpoint-dir", photos / "ck"),
              f"error: --checkpoint-dir {photos / 'ck'} already holds checkpoints of an earlier run (newest: "
              f"{checkpoint_paths(photos / 'ck')[0].name}); continue that run with --resume, or give this run another "
              "--checkpoint-dir"),
             (("--save-weights", tmp_path / "taken.pt"),
              f"error: --save-weights {tmp_path / 'taken.pt'} exists already and is not this run's: choose a new file "
              "name, or move that file away first; nothing is overwritten")]
    with FolderLock(tmp_path / "held"):  # another run's, in this process: flock refuses a second open
        cases.append((("--checkpoint-dir", tmp_path / "held", "--resume=auto"),
                      f"error: --checkpoint-dir {tmp_path / 'held'} is in use by another run (pid {os.getpid()} on "))
        for flags, line in cases:
            args = photo_args("--model", "pixel_net.py:Net", "--image-size", "32", "--epochs", "3", *flags)
            args = tuple(tmp_path / "new-cache" if a == "cache" else a for a in args)
            in_use = "is in use by another run" in line  # a ResourceProblem (exit 1), its line ending in the time
            assert run_main("train.py", *args) == (1 if in_use else 2)
            captured = capsys.readouterr()
            [error] = error_lines(captured.err)
            assert (error.startswith(line) if in_use else error == line) and "Decoding" not in captured.out
            assert not (tmp_path / "new-cache").exists()
    assert (tmp_path / "taken.pt").read_bytes() == b"someone's weights"


def test_weights_for_other_classes_name_finetune(photos, trained, capsys, monkeypatch):
    monkeypatch.chdir(photos)
    assert run_main("train.py", *photo_args("--model", RESNET18, "--weights", "resnet18.pt", "--image-size", "32",
                                            "--epochs", "1")) == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --weights resnet18.pt does not fit resnet18(num_classes=3) from torchvision.models: its last layers "
        "have other shapes (fc.weight is (1000, 512) there, (3, 512) here: weights for other classes); to start from "
        "them with a new head for your classes, use --finetune resnet18.pt instead of --weights"]


@pytest.mark.oldest_torch  # torchvision 0.22's resize and crop of PIL images, as README's transform uses them
def test_decoding_is_torchvisions_resize_and_centre_crop(tmp_path):
    """What README promises: for a square size, a photo's stored pixels are exactly v2.Resize
    then v2.CenterCrop; for any size, the image covers it undistorted."""
    rng = np.random.default_rng(0)
    for height, width in ((333, 500), (500, 333), (90, 120), (37, 37)):
        path = tmp_path / f"{height}x{width}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        for size in (37, 64):
            expected = v2.CenterCrop(size)(v2.Resize(size)(Image.open(path)))
            assert np.array_equal(decode(path, (size, size), "RGB"), np.asarray(expected))
        for size in ((48, 64), (64, 48)):
            covering = cover_size(height, width, size)
            assert covering[0] >= size[0] and covering[1] >= size[1]  # covers it
            assert covering[0] == size[0] or covering[1] == size[1]  # and no more than needed
            assert abs(covering[1] / covering[0] - width / height) < 2 / min(covering)  # the aspect ratio kept
            assert decode(path, size, "RGB").shape == (*size, 3)


def test_a_phone_photo_is_decoded_upright_as_dali_decodes_it(tmp_path):
    """A portrait photo a phone stores sideways with an EXIF orientation: every decode (the
    cache's, --loader dali's check pass, predict.py's) and the header pass that picks the
    stored size see it upright, as DALI's decoder and image viewers do (a new user's walk: it
    was trained sideways on the device and torchvision loaders, upright on DALI)."""
    stored = np.zeros((60, 80, 3), dtype=np.uint8)  # (H, W, C) as the file holds it: landscape
    stored[:, :40] = 255  # the left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: portrait, the white half on top
    path = tmp_path / "portrait.jpg"
    Image.fromarray(stored).save(path, exif=exif, quality=100)
    shown = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB"))
    assert shown.shape == (80, 60, 3) and shown[:30].mean() > 200 > 50 > shown[50:].mean()
    assert header(path).size == (80, 60)
    assert np.array_equal(decode(path, (80, 60), "RGB"), shown)
    mode, size, counts = checked(path)
    assert size == (80, 60) and counts.sum() == 3 * 80 * 60
    png = tmp_path / "portrait.png"  # a PNG's eXIf chunk, before its pixels
    Image.fromarray(stored).save(png, exif=exif)
    assert header(png).size == (80, 60) and np.array_equal(decode(png, (80, 60), "RGB"), np.asarray(
        Image.open(png).transpose(Image.Transpose.ROTATE_270)))
    xmp = tmp_path / "portrait_xmp.png"  # the orientation in XMP, a text chunk, as editors write it
    text = PngImagePlugin.PngInfo()
    text.add_itxt("XML:com.adobe.xmp", '<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>')
    Image.fromarray(stored).save(xmp, pnginfo=text)
    assert header(xmp).size == (80, 60) and np.array_equal(decode(xmp, (80, 60), "RGB"), shown)


def test_a_photo_with_a_wrong_exif_tag_is_decoded_upright_and_a_header_decodes_no_pixels(tmp_path):
    """Pillow's ImageOps.exif_transpose raises on a tag some cameras write wrong (a signed
    XResolution): such a photo, which Pillow reads fine, is still turned upright, not left out
    as unreadable. And the header pass reads no pixels, a PNG's neither (Pillow's getexif
    decodes a PNG without an eXIf chunk whole): a truncated one is found by its decode."""
    stored = np.zeros((60, 80, 3), dtype=np.uint8)
    stored[:, :40] = 255
    # EXIF: a little-endian TIFF block whose IFD0 holds Orientation 6 (SHORT) and XResolution as a
    # negative SRATIONAL (type 10), -1/1, stored after the IFD (at offset 8 + 2 + 2 * 12 + 4 = 38).
    entry = struct.Struct("<HHI4s")
    bad = (b"Exif\0\0" + b"II*\0" + struct.pack("<IH", 8, 2) + entry.pack(0x0112, 3, 1, struct.pack("<HH", 6, 0))
           + entry.pack(0x011A, 10, 1, struct.pack("<I", 38)) + struct.pack("<I", 0) + struct.pack("<ii", -1, 1))
    path = tmp_path / "portrait.jpg"
    Image.fromarray(stored).save(path, exif=bad, quality=100)
    with pytest.raises(Exception):  # Pillow's own function fails on it
        ImageOps.exif_transpose(Image.open(path))
    upright = np.asarray(Image.fromarray(stored).transpose(Image.Transpose.ROTATE_270))
    assert header(path).size == (80, 60)
    assert np.abs(decode(path, (80, 60), "RGB").astype(int) - upright).max() < 8  # JPEG's rounding
    png = tmp_path / "truncated.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(png)
    png.write_bytes(png.read_bytes()[:2000])  # the header and part of the pixels
    assert header(png).size == (64, 64)
    with pytest.raises(Unreadable):
        decode(png, (64, 64), "RGB")


def test_images_enlarged_far_beyond_their_size_are_noted():
    """--image-size 2000 on phone-camera thumbnails: a Note with the factor, not a silent 123x
    cache; a size near the images' own, or a few small ones among large, stays quiet."""
    thumbnails = [Header("RGB", (180, 240))] * 3 + [Header("RGB", (480, 640))]
    notes = image_notes({"train": thumbnails}, (2000, 2000), "RGB", "--image-size 2000", [], {})
    assert ("Note: 4 of 4 images are enlarged to 2000x2000, the median one 11.1x: no detail is added, while "
            "memory and time per image grow 93x") in "\n".join(notes)  # 2000 x 2000 pixels for 180 x 240
    wide = image_notes({"train": [Header("RGB", (32, 32))] * 3}, (2000, 10), "RGB", "--image-size 2000x10", [], {})
    assert "the median one 62.5x: no detail is added, while memory and time per image grow 20x" in "\n".join(wide)
    photos = [Header("RGB", (480, 640))] * 3 + [Header("RGB", (180, 240))]
    for headers, size in ((thumbnails, (256, 256)), (photos, (480, 480))):  # 1.4x; one of four at 2.7x: quiet
        assert not any("enlarged" in note for note in image_notes({"train": headers}, size, "RGB", "", [], {}))


def test_the_images_line_counts_the_conversions_in_words():
    mixed = [Header("RGB", (32, 32)), Header("P", (32, 32)), Header("L", (40, 32))]
    first = image_notes({"train": mixed}, (32, 32), "RGB", "most common", [], {})[0]
    assert first == ("Images: 32x32 (most common; 1 resized: scaled to cover, centre-cropped), RGB (2 converted from "
                     "other modes)")
    first = image_notes({"train": mixed[:1]}, (32, 32), "RGB", "most common", [], {})[0]
    assert first.endswith("0 resized: scaled to cover, centre-cropped), RGB (every image is RGB)")


def test_photos_finetune_a_resnet18_on_two_processes(photos):
    args = photo_args("--model", RESNET18, "--finetune", "resnet18.pt", "--image-size", "72", "--epochs", "1",
                      "--limit-batches", "2", "--base-lr", "0.05")
    two = run(torchrun_cmd(2, "train_ddp.py", *args, "--freeze-backbone", "--metrics-file", "two.jsonl"), cwd=photos)
    assert two.returncode == 0, two.stderr
    assert ("Weights: fine-tuning from resnet18.pt: 120 of 122 tensors loaded; new: fc.weight, fc.bias (1000 -> 3 "
            "classes); --freeze-backbone: only fc.weight, fc.bias train") in two.stdout
    (record,) = read_metrics(photos / "two.jsonl")
    assert record["world_size"] == 2 and record["val_samples"] == 12


def test_a_data_set_of_your_code_without_test_split_is_held_out_from(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_data.py").write_text(
        "import torch\n\n\n"
        "def make(data_dir):\n"
        "    labels = torch.arange(40) % 4\n"
        "    noise = torch.randint(0, 20, (40, 3, 16, 16), generator=torch.Generator().manual_seed(0))\n"
        "    images = (labels[:, None, None, None] * 60 + noise).to(torch.uint8)\n"
        "    return list(zip(images, labels.tolist())), None\n")
    monkeypatch.chdir(tmp_path)
    assert run_main("train.py", "--dataset", "my_data.py:make", "--epochs", "1") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: --dataset my_data.py:make has no test split: hold out part of the training images for validation "
        "with --val-fraction 0.2 (20% of each class)"]
    result = run(python_cmd("train.py", "--dataset", "my_data.py:make", "--val-fraction", "0.2", "--epochs", "1",
                            "--batch-size", "8", "--metrics-file", "m.jsonl", *TINY_MODEL), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Validation: 8 of the 40 training images held out (--val-fraction 0.2 of each of the 4 classes" in (
        result.stdout)
    assert read_metrics(tmp_path / "m.jsonl")[0]["val_samples"] == 8


def test_the_benchmarks_reference_is_torchvisions_random_resized_crop():
    """tools/benchmark.py's baseline is torchvision's own RandomResizedCrop of the documented
    recipe (1/4 to all of the area, aspect 3/4 to 4/3), flip, ToTensor and Normalize: the same
    tensor as those calls make with the same random numbers."""
    prep = du.preprocessing((32, 32, 3), (0.5, 0.4, 0.3), (0.25, 0.2, 0.3), "resized-crop", stored_size=(37, 37))
    images = np.random.default_rng(0).integers(0, 256, (4, 37, 37, 3), dtype=np.uint8)
    reference = TorchvisionResizedCrops(du.InMemoryImages(images, np.arange(4), prep))
    for seed in range(8):
        torch.manual_seed(seed)
        image, label = reference[2]
        torch.manual_seed(seed)
        pil = Image.fromarray(images[2])
        top, left, height, width = torchvision.transforms.RandomResizedCrop.get_params(pil, (0.25, 1.0), (3 / 4, 4 / 3))
        expected = TF.resized_crop(pil, top, left, height, width, [32, 32])
        expected = TF.hflip(expected) if torch.rand(1) < 0.5 else expected
        assert label == 2
        torch.testing.assert_close(image, TF.normalize(TF.to_tensor(expected), prep.mean, prep.std), rtol=0, atol=1e-6)
