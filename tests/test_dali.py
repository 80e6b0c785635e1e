"""--loader dali: NVIDIA DALI's CPU pipeline (the GPU's "mixed" decoder: tests/test_gpu.py) on a
folder of photos: it learns, names the files it cannot read before DALI sees them, shards and
orders as the project decides, evaluates alike on 1 and 2 processes, resumes exactly after a
stop mid-epoch and after kill -9, and prepares validation images as predict.py does."""

import os
import re
import shutil
import signal
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

import dataset_utils as du
import recipe
from conftest import (REPO, TINY_MODEL, clean_env, error_lines, read_metrics, run, start, torchrun_cmd,
                      wait_held)
from engine.dali_loader import DaliLoader, choose_dali, dali_installed, dali_package, epoch_rows
from dataset_utils import FileImages, centre_crop, normalization, normalize
from engine.errors import UserError
from engine.image_folder import decode
from engine.seeds import resumed_steps, rng_snapshot
from test_photos import ks_limit, two_sample_ks
from test_resilience import _rank_pid
from tools.demo_data import PHOTO_SIZES, write_photo_folder
from tools.gpu_report import kill_tree

needs_dali = pytest.mark.skipif(not dali_installed(), reason="NVIDIA DALI is not installed (requirements-dev.txt)")
DALI = ("--dataset", "folder", "--data-dir", "photos", "--val-fraction", "0.25", "--image-size", "32", "--loader",
        "dali", "--cache-dir", "cache", *TINY_MODEL, "--batch-size", "8", "--num-workers", "1", "--log-interval", "0",
        "--checkpoint-interval", "0")
CLASSES = 3


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """A folder of photos (JPEG and PNG, colour, gray and CMYK, 60x80 to 500x333) with a truncated
    JPEG and a GIF (Pillow reads it, DALI does not)."""
    root = write_photo_folder(tmp_path_factory.mktemp("dali") / "photos", per_class=20)
    whole = (root / "dog" / "IMG_0001.JPG").read_bytes()
    (root / "dog" / "cut.jpg").write_bytes(whole[:len(whole) // 2])
    Image.new("RGB", (80, 60), (40, 180, 70)).save(root / "dog" / "anim.gif")
    return root


def project(photos, folder):
    folder.mkdir()
    shutil.copytree(photos, folder / "photos")
    return folder


@needs_dali
@pytest.mark.parametrize("processes", [1, 2])
def test_dali_learns_resumes_exactly_and_evaluates_alike_on_1_and_2_processes(photos, tmp_path, processes):
    """A run that learns, naming the files it cannot read before DALI sees them; the same run
    stopped mid-epoch 2 (SIGUSR1) and resumed, then killed (kill -9) in epoch 3 and resumed
    from epoch 2's checkpoint: the uninterrupted run's metrics and weights, bit for bit. Its
    weights evaluated by the other number of processes: the same sums (each image once)."""
    def launcher(count, *args):
        return [sys.executable, REPO / "train.py", *args] if count == 1 else torchrun_cmd(2, "train_ddp.py", *args)

    whole, broken = (project(photos, tmp_path / name) for name in ("whole", "broken"))
    flags = (*DALI, "--epochs", "4", "--checkpoint-dir", "ckpt", "--metrics-file", "m.jsonl", "--save-weights", "w.pt")
    trained = run(launcher(processes, *flags), cwd=whole)
    assert trained.returncode == 0, trained.stderr
    out = trained.stdout
    assert "Loader: NVIDIA DALI (decoding and augmentation on the CPU, 1 CPU thread per process); --loader dali" in out
    assert re.search(r"^  \S*photos/dog/cut\.jpg: image file is truncated", out, re.M), out  # named, before DALI
    assert re.search(r"^  \S*photos/dog/anim\.gif: a \.gif file, which DALI does not decode", out, re.M), out
    assert "Critical error" not in trained.stderr
    records = read_metrics(whole / "m.jsonl")
    assert [r["loader"] for r in records] == ["dali"] * 4 and records[-1]["val_samples"] == 15  # a quarter of 60
    assert records[-1]["train_loss"] < records[0]["train_loss"] and records[-1]["val_accuracy"] >= 0.6, records

    go, go2, rank = broken / "go", broken / "go2", processes - 1
    process = start(launcher(processes, *flags), broken, broken / "log1", env=clean_env(HOLD_AT=f"7:{go}"))
    wait_held(go, process, rank)  # at step 2 of epoch 2 (5 steps per epoch)
    os.kill(process.pid if processes == 1 else _rank_pid(process.pid, 1), signal.SIGUSR1)
    go.touch()
    process.wait(timeout=120)
    assert re.search(r"Stopped after step \d of epoch 2", (broken / "log1").read_text())
    process = start(launcher(processes, *flags, "--resume"), broken, broken / "log2", env=clean_env(HOLD_AT=f"5:{go2}"))
    wait_held(go2, process, rank)  # in epoch 3, after epoch 2's checkpoint
    kill_tree(process)  # SIGKILL to the run (torchrun: and its ranks, each in a session of its own)
    resumed = run(launcher(processes, *flags, "--resume"), cwd=broken)
    assert resumed.returncode == 0, resumed.stderr
    assert "epoch 3, step 0" in resumed.stdout or "after epoch 2" in resumed.stdout, resumed.stdout
    compared = ("epoch", "train_loss", "val_loss", "val_accuracy", "lr")
    assert ([[r[k] for k in compared] for r in read_metrics(broken / "m.jsonl")]
            == [[r[k] for k in compared] for r in records])
    a, b = (torch.load(folder / "w.pt", weights_only=True) for folder in (whole, broken))
    assert all(torch.equal(a[k], b[k]) for k in a)

    other = 3 - processes
    done = run([*launcher(other, *DALI, "--eval-only", "--weights", "w.pt", "--metrics-file", "e.jsonl")], cwd=whole)
    assert done.returncode == 0, done.stderr
    evaluated = read_metrics(whole / "e.jsonl")[-1]
    assert evaluated["val_samples"] == 15 and evaluated["val_accuracy"] == records[-1]["val_accuracy"]
    assert evaluated["val_loss"] == pytest.approx(records[-1]["val_loss"], rel=1e-6)


@needs_dali
def test_a_run_continued_by_another_loader_keeps_its_normalization(photos, tmp_path):
    """DALI measures mean and std on the whole photos, the cache's loaders on the stored crops:
    a run resumed with another --loader normalizes as its checkpoint records, says so, and its
    --save-weights file keeps those statistics."""
    folder = project(photos, tmp_path / "p")
    (folder / "photos" / "dog" / "anim.gif").unlink()  # DALI and the cache then read the same images
    flags = (*DALI, "--epochs", "1", "--checkpoint-dir", "ckpt", "--metrics-file", "m.jsonl", "--save-weights", "w.pt")
    first = run([sys.executable, REPO / "train.py", *flags], cwd=folder)
    assert first.returncode == 0, first.stderr
    before = torch.load(folder / "w.pt", weights_only=True)._metadata[""]["task"]
    device = [("device" if flag == "dali" else flag) for flag in flags]
    more = run([sys.executable, REPO / "train.py", *device, "--epochs", "2", "--resume"], cwd=folder)
    assert more.returncode == 0, more.stderr
    measured = re.search(r"^Normalization: the run's own, from its checkpoint: mean (\(.*?\)), std (\(.*?\)) "
                         r"\(measured here: mean (\(.*?\)), std", more.stdout, re.M)
    assert measured and measured[1] == str(tuple(before["mean"])) and measured[2] == str(tuple(before["std"]))
    assert measured[3] != measured[1]  # the cache's crops measure otherwise
    after = torch.load(folder / "w.pt", weights_only=True)._metadata[""]["task"]
    assert (after["mean"], after["std"]) == (before["mean"], before["std"])
    assert [r["loader"] for r in read_metrics(folder / "m.jsonl")] == ["dali", "device"]


@needs_dali
def test_two_ranks_get_every_image_once_per_epoch_and_the_same_steps(photos):
    """Through DALI itself: labels that are the image's index show what each rank was served."""
    prep = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "resized-crop", stored_size=(37, 37))
    files = sorted(str(p) for p in photos.glob("*/*.png"))
    n = len(files)  # 30
    images = FileImages(files, np.arange(n), prep)
    for epoch in (0, 1):
        served, steps = [], []
        for rank in (0, 1):
            loader = DaliLoader(images, 4, recipe.dali_images, torch.device("cpu"), True, rank=rank, world_size=2)
            loader.set_epoch(epoch)
            batches = [(x, y) for x, y in loader]
            assert all(x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 for x, _ in batches)
            # DALI's HWC output as a view: channels-last in memory, no copy into the model's layout
            assert all(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() for x, _ in batches)
            assert loader.batches is None  # the finished epoch's pipeline let go, its memory back to DALI's pool
            steps.append(len(batches))
            served += [int(i) for _, y in batches for i in y]
        assert steps == [n // 8] * 2 and len(served) == len(set(served)) == n // 8 * 8  # batches of 4 on 2 ranks
        assert served == [i for rank in (0, 1) for i in epoch_rows(n, rank, 2, 0, epoch, 4)]
    first, second = (epoch_rows(n, 0, 2, 0, epoch, 4) for epoch in (0, 1))
    assert first != second  # reshuffled each epoch
    evaluated = []
    for rank in (0, 1):  # validation: every image once, the last batch partial
        loader = DaliLoader(images, 4, recipe.dali_images, torch.device("cpu"), False, rank=rank, world_size=2)
        evaluated += [int(i) for _, y in loader for i in y]
    assert sorted(evaluated) == list(range(n))


@needs_dali
def test_a_dali_graph_that_ends_in_chw_is_one_line_naming_the_layout(photos):
    """recipe.dali_images ends in HWC, which the loader hands out as a channels-last view; a graph
    of your own that still ends in CHW would reach the model as (B, W, C, H): one line instead."""
    def chw(encoded, prep, training, gpu):
        from nvidia.dali import fn
        return fn.transpose(recipe.dali_images(encoded, prep, training, gpu), perm=[2, 0, 1])
    prep = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "resized-crop", stored_size=(37, 37))
    files = sorted(str(p) for p in photos.glob("*/*.png"))
    loader = DaliLoader(FileImages(files, np.arange(len(files)), prep), 4, chw, torch.device("cpu"), True)
    with pytest.raises(UserError, match=r'^recipe.dali_images returned images of shape \(3, 32, 32\), not \(H, W, 3\): '
                                        r'end it with output_layout="HWC"$'):
        next(iter(loader))


@needs_dali
def test_a_stopped_epoch_goes_on_from_dalis_checkpoint_without_decoding_again(photos):
    """position() after 2 of an epoch's batches, given to a new loader (a resumed run): it hands
    out the other batches only, bit for bit the uninterrupted epoch's; the snapshot of a mid-epoch
    checkpoint carries it, and a position of another epoch is not used (the loop skips then)."""
    prep = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "resized-crop", stored_size=(37, 37))
    files = sorted(str(p) for p in photos.glob("*/*.png"))
    images = FileImages(files, np.arange(len(files)), prep)

    def loader():
        made = DaliLoader(images, 4, recipe.dali_images, torch.device("cpu"), True, rank=1, world_size=2, seed=5)
        made.set_epoch(3)
        return made
    whole = list(loader())
    stopped = loader()
    batches = iter(stopped)
    first = [next(batches) for _ in range(2)]
    snapshot = rng_snapshot(stopped)
    assert snapshot["loader"]["epoch"] == 3
    batches.close()  # the loop let go of the stopped epoch (the run's checkpoint has its place)
    assert stopped.batches is None and stopped.position() is None
    resumed = loader()
    assert resumed_steps(resumed, snapshot, 2) == 2
    rest = list(resumed)
    assert len(first) + len(rest) == len(whole) == 3
    for (x, y), (x_ref, y_ref) in zip(first + rest, whole, strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    other = loader()
    other.set_epoch(4)
    assert resumed_steps(other, snapshot, 2) == 0 and len(list(other)) == 3  # from the start: skipped by the loop
    assert resumed_steps(loader(), None, 2) == 0  # a checkpoint of another number of ranks has no snapshot here


@needs_dali
@pytest.mark.parametrize("size, stored", [((32, 32), (37, 37)), ((224, 224), (256, 256))])
def test_dali_validation_images_are_predict_pys(tmp_path, size, stored):
    """Smooth photos of the demo's sizes as DALI prepares them for validation and as predict.py
    does (Pillow's resize to cover the stored size, centre crops): the same images, up to the
    two resizers' filters and rounding (DALI rounds a resized side that Pillow rounds down)."""
    files = []
    for i, (height, width) in enumerate(PHOTO_SIZES):
        y, x = np.mgrid[:height, :width]
        wave = 128 + 100 * np.sin(6 * x / width) * np.cos(5 * y / height)
        pixels = np.stack([255 * x / width, 255 * y / height, wave], axis=-1)
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(pixels.astype(np.uint8)).save(files[-1])
    mean, std = (0.4, 0.45, 0.5), (0.2, 0.25, 0.3)
    prep = du.preprocessing((*size, 3), mean, std, "resized-crop", stored_size=stored)
    loader = DaliLoader(FileImages(files, np.zeros(len(files)), prep), len(files), recipe.dali_images,
                        torch.device("cpu"), False)
    (dali, _), = list(loader)
    pillow = torch.stack([torch.from_numpy(np.array(decode(path, stored, "RGB"))) for path in files])
    ours = normalize(centre_crop(pillow, size), *normalization(mean, std, torch.uint8))
    difference = (dali - ours).abs() * torch.tensor(std)[:, None, None] * 255  # in pixel values 0..255
    assert difference.mean() < 0.6, difference.mean(dim=(1, 2, 3))


@needs_dali
@pytest.mark.parametrize("height, width", [(64, 64), (64, 96)])
def test_dali_draws_resized_crops_as_torchvision_draws_them(tmp_path, height, width):
    """DALI's crops of an image whose pixels are their own coordinates, read back, against
    RandomResizedCrop.get_params: one distribution of area and aspect (photos up to 3:2 here; past
    2:1, where most of the ten draws miss, the two fall back differently)."""
    n, out = 1500, 56
    rows, cols = np.mgrid[:height, :width]
    Image.fromarray(np.stack([rows * 3, cols * 2, np.zeros_like(rows)], -1).astype(np.uint8)).save(tmp_path / "c.png")
    prep = du.preprocessing((out, out, 3), (0.0,) * 3, (1 / 255,) * 3, "resized-crop", stored_size=(64, 64))
    loader = DaliLoader(FileImages([tmp_path / "c.png"] * n, np.zeros(n), prep), 500, recipe.dali_images,
                        torch.device("cpu"), True)
    x = torch.cat([images for images, _ in loader])  # (n, 3, out, out): 3 x the source row, 2 x its column
    box_h = (x[:, 0, -1, :] - x[:, 0, 0, :]).mean(1) / 3 * out / (out - 1)  # first to last pixel centre
    box_w = (x[:, 1, :, -1] - x[:, 1, :, 0]).abs().mean(1) / 2 * out / (out - 1)  # abs: flipped ones too
    torch.manual_seed(3)
    theirs = np.array([torchvision.transforms.RandomResizedCrop.get_params(torch.zeros(3, height, width), [0.25, 1.0],
                                                                           [3 / 4, 4 / 3]) for _ in range(n)])
    assert two_sample_ks(box_h * box_w, theirs[:, 2] * theirs[:, 3]) < ks_limit(n, n)
    assert two_sample_ks(box_w / box_h, theirs[:, 3] / theirs[:, 2]) < ks_limit(n, n)
    flipped = (x[:, 1, 0, -1] < x[:, 1, 0, 0]).float().mean()
    assert abs(flipped - 0.5) < 4 * 0.5 / n**0.5


@needs_dali
def test_dali_pad_crop_offsets_are_uniform(tmp_path):
    """--augment crop through DALI: the offsets 0..2 x padding pixels, each as often (chi-square)."""
    n, padding = 900, 4
    rows, cols = np.mgrid[:32, :32]
    Image.fromarray(np.stack([10 + 4 * rows, 10 + 4 * cols, np.zeros_like(rows)], -1).astype(np.uint8)).save(
        tmp_path / "c.png")
    prep = du.preprocessing((32, 32, 3), (0.0,) * 3, (1 / 255,) * 3, "crop", padding=padding)
    loader = DaliLoader(FileImages([tmp_path / "c.png"] * n, np.zeros(n), prep), 300, recipe.dali_images,
                        torch.device("cpu"), True)
    x = torch.cat([images for images, _ in loader])
    for channel, pixel in ((0, (8, 16)), (1, (16, 8))):  # pixel 8 is never padding: it holds source pixel 4 + offset
        offsets = ((x[:, channel, pixel[0], pixel[1]] - 10) / 4).round().long() - 8 + padding
        counts = torch.bincount(offsets, minlength=2 * padding + 1).double()
        assert len(counts) == 2 * padding + 1
        expected = n / (2 * padding + 1)
        assert ((counts - expected) ** 2 / expected).sum() < 26.1  # chi-square, 8 degrees of freedom, p = 0.001


def test_dali_is_chosen_and_refused_in_one_line(tmp_path):
    assert dali_package("12.8") == "nvidia-dali-cuda120" and dali_package("13.0") == dali_package(None) == \
        "nvidia-dali-cuda130"
    use, why = choose_dali(32e9, 86e9)
    assert use and why == ("auto: the image folder decoded (32 GB) does not fit in 25% of the GPU's 86 GB: DALI "
                           "decodes the files on the GPU every epoch")
    assert not choose_dali(21e9, 86e9)[0]
    def flags(**given):
        return Namespace(**{**dict(loader="dali", dataset="folder", augment="auto", auto_augment=None, eval_only=False), **given})

    with pytest.raises(UserError, match="^--loader dali reads image files: it takes --dataset folder, not cifar10"):
        du.dali_choice(flags(dataset="cifar10"), torch.device("cpu"))
    # recipe.py's per-image transforms, --auto-augment's or a user's, run in the DataLoader's workers only.
    with pytest.raises(UserError, match="^recipe.py's per-image TrivialAugmentWide transforms each image in the "
                                        "DataLoader's workers, which DALI has no operator for: use --loader torchvision"):
        du.dali_choice(flags(), torch.device("cpu"), per_image=recipe.image_transforms(flags(auto_augment="ta_wide")))
    with pytest.raises(UserError, match="^recipe.py's per-image ColorJitter transforms each image"):
        du.dali_choice(flags(), torch.device("cpu"), per_image=torchvision.transforms.v2.Compose(
            [torchvision.transforms.v2.ColorJitter(0.4)]))
    # auto never takes DALI on the CPU: the folder is not even read.
    assert du.dali_choice(flags(loader="auto", data_dir=str(tmp_path / "none")), torch.device("cpu")) == (None, None)


def test_the_list_is_made_ahead_of_a_job_once_and_reused(photos, tmp_path, capsys):
    """python dataset_utils.py --dataset folder --loader dali: the folder pass, on a login node."""
    flags = ["--dataset", "folder", "--data-dir", str(photos), "--val-fraction", "0.25", "--loader", "dali",
             "--cache-dir", str(tmp_path)]
    assert du.main(flags) == 0
    out = capsys.readouterr().out
    assert out.startswith("Checking 63 images of 3 classes for --loader dali (each decoded once) ...")
    assert re.search(r"^  \S*dog/cut\.jpg: image file is truncated", out, re.M)
    assert out.splitlines()[-1] == f"Image folder {photos} ready for --loader dali: 61 training images of 3 classes"
    lists = list(tmp_path.glob("photos-*/list-*.json"))
    assert len(lists) == 1 and du.main(flags) == 0 and "Checking" not in capsys.readouterr().out  # found again
    with pytest.raises(SystemExit):
        du.main(["--dataset", "cifar10", "--loader", "dali"])
    assert capsys.readouterr().err.endswith("error: --loader dali lists an image folder (--dataset folder); cifar10 "
                                            "needs no list (see --help)\n")


def test_the_list_names_unreadable_files_within_the_data_dir_as_given(photos, tmp_path, capsys, monkeypatch):
    """As the cache names them for the other loaders (--data-dir as typed, then the file within
    it), not by the absolute path DALI reads: when the list is made and when it is found again."""
    monkeypatch.chdir(project(photos, tmp_path / "p"))
    flags = ["--dataset", "folder", "--data-dir", "photos", "--val-fraction", "0.25", "--loader", "dali", "--cache-dir",
             "cache"]
    absolute = (tmp_path / "p" / "photos").resolve()
    for _ in ("made", "found again"):
        assert du.main(flags) == 0
        out = capsys.readouterr().out
        assert re.search(r"^  photos/dog/cut\.jpg: image file is truncated", out, re.M), out
        assert "\n  photos/dog/anim.gif: a .gif file, which DALI does not decode" in out
        assert "\nIgnored 4 files that are not images, e.g. photos/cat/Thumbs.db\n" in out  # as the cache says too
        assert f"{absolute}/dog" not in out and f"{tmp_path}/p/photos/dog" not in out


@needs_dali
def test_a_cmyk_tiff_is_one_note_and_dali_reads_pillows_pixels(tmp_path, capsys):
    """DALI's libtiff decoder refuses a CMYK TIFF, printing an [ERROR] line each time it meets
    one, and its next decoder reads it: the list says so once, naming the file, and the pixels
    DALI gives are Pillow's, the same as the image saved as RGB."""
    root = write_photo_folder(tmp_path / "photos", per_class=4)
    pixels = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert("CMYK").save(root / "cat" / "scan.tif")
    Image.fromarray(pixels).save(root / "cat" / "plain.tif")
    flags = ["--dataset", "folder", "--data-dir", str(root), "--val-fraction", "0.25", "--loader", "dali", "--cache-dir",
             str(tmp_path / "c")]
    for _ in ("made", "found again"):
        assert du.main(flags) == 0
        out = capsys.readouterr().out
        assert (f"\nNote: 1 CMYK TIFF file, {root / 'cat' / 'scan.tif'}: DALI's TIFF decoder prints an [ERROR] "
                "line for it every time it decodes it, then its next decoder reads it correctly (saved as RGB, or "
                "as JPEG, the line goes)\n") in out, out
    prep = du.preprocessing((40, 48, 3), (0.5,) * 3, (0.25,) * 3, "none")
    loader = DaliLoader(FileImages([root / "cat" / "scan.tif", root / "cat" / "plain.tif"], np.zeros(2), prep), 2,
                        recipe.dali_images, torch.device("cpu"), False)
    (images, _), = list(loader)
    expected = normalize(torch.from_numpy(pixels)[None], *normalization(prep.mean, prep.std, torch.uint8))[0]
    assert torch.equal(images[0], images[1]) and (images[0] - expected).abs().max() < 1e-5


@pytest.mark.oldest_torch  # its environment has no DALI
def test_loader_dali_without_dali_is_one_line_naming_the_package(photos, tmp_path):
    if dali_installed():
        pytest.skip("DALI is installed here: the environment without it (.ci/run's second pass) runs this")
    folder = project(photos, tmp_path / "p")
    done = run([sys.executable, REPO / "train.py", *DALI, "--epochs", "1"], cwd=folder)
    assert done.returncode != 0 and error_lines(done.stderr) == [
        f"error: --loader dali needs NVIDIA DALI, which is not installed: pip install {dali_package()} (NVIDIA's "
        "PyTorch containers have it), or use --loader auto"], done.stderr
    assert not Path(folder / "cache").exists()  # refused before the folder is read
