"""From a folder of photos to a trained model: a validation split held out of train/, the
photo augmentation (resized-crop, the same in both loaders), fine-tuning an ImageNet-style
network with a new head, and the checks that keep each of them one line when misused."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision
import torchvision.transforms.functional as TF

import dataset_utils as du
import recipe
from conftest import REPO, TINY_MODEL, error_lines, python_cmd, read_metrics, run, run_main, torchrun_cmd
from engine.errors import UserError
from engine.finetune import finetune, load_fitting
from engine.models import make_model
from engine.plugins import load_plugin
from engine.splits import stratified_split
from tools.benchmark import TorchvisionResizedCrops
from tools.demo_data import PHOTO_CLASSES as CLASSES, write_photo_folder

RESNET18 = "torchvision.models:resnet18"


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """A photo folder of train/ alone and a 1000-class resnet18 state_dict (ImageNet's shape)."""
    root = tmp_path_factory.mktemp("photos")
    write_photo_folder(root / "photos")
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), root / "resnet18.pt")
    return root


def photo_args(*extra):
    return ("--dataset", "folder", "--data-dir", "photos", "--cache-dir", "cache", "--val-fraction", "0.2",
            "--batch-size", "16", *extra)


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
    code = ("import numpy as np; from engine.splits import stratified_split; np.random.seed(1); "
            "print(stratified_split(np.repeat(np.arange(4), [50, 20, 7, 1]), 0.2, 5).val.tolist())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == str(split.val.tolist())


def test_a_folder_without_test_split_names_the_flag(photos, capsys, monkeypatch):
    monkeypatch.chdir(photos)
    assert run_main("train.py", "--dataset", "folder", "--data-dir", "photos", "--cache-dir", "cache") == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "no photos/test/ or photos/val/" in line and "add --val-fraction 0.2" in line


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


def test_both_loaders_serve_the_same_resized_crops_and_centre_crops_of_larger_images():
    images = np.random.default_rng(0).integers(0, 256, (24, 37, 37, 3), dtype=np.uint8)  # stored 8/7 of 32
    prep = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "resized-crop", stored_size=(37, 37))
    train_set = du.InMemoryImages(images, np.arange(24), prep)
    loaders = {kind: du.build_loaders(train_set, train_set, 8, loader=kind, seed=3, device=torch.device("cpu"))
               for kind in ("device", "torchvision")}
    for epoch in (0, 1):
        for loader, _ in loaders.values():
            du.set_loader_epoch(loader, epoch)
        served = [list(loader) for loader, _ in loaders.values()]
        assert all(torch.equal(x, x_ref) and torch.equal(y, y_ref) for (x, y), (x_ref, y_ref) in zip(*served))
        assert served[0][0][0].shape == (8, 3, 32, 32)
    tests = [torch.cat([x for x, _ in test]) for _, test in loaders.values()]
    assert torch.equal(tests[0], tests[1])
    expected = torch.from_numpy(images[:, 2:34, 2:34]).float().div(255).sub(0.5).div(0.25).permute(0, 3, 1, 2)
    assert torch.allclose(tests[0], expected, atol=1e-5)  # the centre 32x32 of 37x37: offsets round(2.5) = 2


def test_augment_auto_picks_resized_crop_for_photos_only():
    assert recipe.auto_augment((65, 200)) == "resized-crop" and recipe.auto_augment((64, 200)) == "flip-crop"
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
    note = finetune(model, tmp_path / "r18.pt", True, "resnet18", 3)
    assert note == (f"fine-tuning from {tmp_path / 'r18.pt'}: 120 of 122 tensors loaded; new: fc.weight, fc.bias "
                    "(1000 -> 3 classes); --freeze-backbone: only fc.weight, fc.bias train")
    assert torch.equal(model.conv1.weight, source.conv1.weight) and torch.equal(model.fc.weight, fresh_fc)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]


def test_finetune_refuses_other_networks_in_one_line(tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "r18.pt")
    with pytest.raises(UserError, match=r"does not fit resnet34 beyond its last layers: layer1.2.conv1.weight is "
                                        r"missing there, \(64, 64, 3, 3\) here \(and \d+ more\)"):
        load_fitting(torchvision.models.resnet34(num_classes=3), tmp_path / "r18.pt", "resnet34", 3)
    with pytest.raises(UserError, match="none of its 122 tensors fits Net"):
        load_fitting(torch.nn.Sequential(torch.nn.Linear(2, 3)), tmp_path / "r18.pt", "Net", 3)
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "same.pt")
    with pytest.raises(UserError, match="none is new, so nothing would train; drop --freeze-backbone"):
        finetune(torchvision.models.resnet18(num_classes=3), tmp_path / "same.pt", True, "resnet18", 3)


def test_torchvision_models_get_no_in_channels_and_refuse_gray_data():
    factory = load_plugin(RESNET18, "--model")
    model, name = make_model(factory, RESNET18, num_classes=3, in_channels=3, image_size=(64, 64))
    assert name == "resnet18(num_classes=3) from torchvision.models" and model.fc.out_features == 3
    with pytest.raises(UserError, match="takes no in_channels, so it expects RGB images, but the data has 1 channel"):
        make_model(factory, RESNET18, num_classes=3, in_channels=1, image_size=(64, 64))


# ---------------------------------------------------------------------------------------------
# The whole way, as a user goes it.

def test_photos_train_with_the_default_model_and_resume_with_the_same_split(photos):
    first = run(python_cmd("train.py", *photo_args("--augment", "resized-crop", "--image-size", "40", "--epochs", "1",
                                                   "--limit-batches", "1", "--checkpoint-dir", "ck",
                                                   "--metrics-file", "m.jsonl")), cwd=photos)
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "Decoding 61 images of 3 classes" in out  # 20 per class and the CMYK print; README.txt, Thumbs.db ignored
    assert "Ignored 4 files that are not images" in out
    assert "(3 classes: cat, dog, red panda), 49 training / 12 held-out images" in out
    split_line = next(line for line in out.splitlines() if line.startswith("Validation: "))
    assert split_line == ("Validation: 12 of the 61 training images held out (--val-fraction 0.2 of each of the 3 "
                          "classes, chosen by --seed 0); training on the other 49")
    assert "Augmentation: resized-crop (resized_crop, flip; stored 46x46, trained on 40x40 crops" in out
    resumed = run(python_cmd("train.py", *photo_args("--augment", "resized-crop", "--image-size", "40", "--epochs",
                                                     "2", "--limit-batches", "1", "--checkpoint-dir", "ck",
                                                     "--metrics-file", "m.jsonl", "--resume")), cwd=photos)
    assert resumed.returncode == 0, resumed.stderr
    assert split_line in resumed.stdout and "Decoding" not in resumed.stdout
    assert [r["val_samples"] for r in read_metrics(photos / "m.jsonl")] == [12, 12]
    other = run(python_cmd("train.py", *photo_args("--augment", "resized-crop", "--image-size", "40", "--epochs", "3",
                                                   "--limit-batches", "1", "--checkpoint-dir", "ck", "--resume",
                                                   "--seed", "1", "--val-fraction", "0.3")), cwd=photos)
    assert other.returncode == 2 and error_lines(other.stderr) == [
        "error: --resume needs the checkpoint's recipe, but it had --seed 0 (now 1), --val-fraction 0.2 (now 0.3); "
        "rerun with its values or start a new --checkpoint-dir"]


def test_photos_finetune_a_resnet18_under_one_and_two_processes(photos):
    args = photo_args("--model", RESNET18, "--finetune", "resnet18.pt", "--image-size", "72", "--epochs", "1",
                      "--limit-batches", "2", "--base-lr", "0.05")
    result = run(python_cmd("train.py", *args, "--save-weights", "r18-photos.pt"), cwd=photos)
    assert result.returncode == 0, result.stderr
    assert "--augment auto: resized-crop, for images larger than 64 pixels" in result.stdout
    assert ("Weights: fine-tuning from resnet18.pt: 120 of 122 tensors loaded; new: fc.weight, fc.bias (1000 -> 3 "
            "classes)") in result.stdout
    saved = torch.load(photos / "r18-photos.pt", weights_only=True)
    assert saved._metadata[""]["task"]["classes"] == list(CLASSES)
    assert saved._metadata[""]["task"]["stored_size"] == [82, 82] and saved["fc.weight"].shape == (3, 512)
    # The saved weights load into the model the user named, in plain PyTorch.
    torchvision.models.resnet18(num_classes=3).load_state_dict(saved)

    two = run(torchrun_cmd(2, "train_ddp.py", *args, "--freeze-backbone", "--metrics-file", "two.jsonl"), cwd=photos)
    assert two.returncode == 0, two.stderr
    assert "--freeze-backbone: only fc.weight, fc.bias train" in two.stdout
    (record,) = read_metrics(photos / "two.jsonl")
    assert record["world_size"] == 2 and record["val_samples"] == 12  # the same split on both ranks, counted once


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
    prep = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "resized-crop", stored_size=(37, 37))
    images = np.zeros((4, 37, 37, 3), dtype=np.uint8)
    images[:, :, 18:] = 255  # left half black, right half white
    reference = TorchvisionResizedCrops(du.InMemoryImages(images, np.arange(4), prep))
    transform = reference.transform.transforms
    assert transform[0].scale == recipe.RESIZED_CROP_SCALE and transform[0].size == (32, 32)
    image, label = reference[2]
    assert image.shape == (3, 32, 32) and label == 2
    assert image.min() >= -2.0 and image.max() <= 2.0  # 0 and 255, normalized with mean 0.5 and std 0.25
