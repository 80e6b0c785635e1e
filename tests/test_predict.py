"""predict.py: weights from train.py classify new images as training's evaluation did (the same
accuracy on the test images), from a --save-weights file or a checkpoint; odd folders (an
unreadable image, a file name that is not UTF-8, stray files) and every mistake are lines,
never a traceback, and nothing a user wrote is overwritten."""

import csv
import io
import math
import os
import shutil
from collections import Counter

import pytest
import torch
from PIL import Image

from predict import report as summary_report
from conftest import clean_env, error_lines, python_cmd, read_metrics, run, run_main, write_image_folder
from tiny_net import Net

CLASSES = 3
# Every pixel position has its own weight (no pooling), so an input cropped or scaled otherwise than training's
# test images changes the outputs; BatchNorm and dropout, so that a model left in training mode does too.
PIXEL_NET = '''
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                    nn.Dropout(0.5), nn.Flatten(), nn.Linear(4 * image_size[0] * image_size[1],
                                                                             num_classes))

    def forward(self, x):
        return self.layers(x)
'''
MODEL = ("--model", "pixel_net.py:Net")
TRAIN = (*MODEL, "--dataset", "folder", "--data-dir", "imgs", "--cache-dir", "cache", "--num-workers", "0",
         "--loader", "device", "--batch-size", "16", "--log-interval", "0",
         # resized-crop stores the images at 32x32 and tests on their 28x28 centre: predict.py must do the same
         "--augment", "resized-crop")
CPU = clean_env(CUDA_VISIBLE_DEVICES="")  # the module's fixture runs before conftest's cpu_only


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A project folder after 2 epochs of PIXEL_NET on 3 classes (24 test images, of two
    sizes, PNG and JPEG, RGB and gray): w.pt, ckpt/checkpoint_*.pt, m.jsonl."""
    project = tmp_path_factory.mktemp("project")
    (project / "pixel_net.py").write_text(PIXEL_NET)
    write_image_folder(project / "imgs", classes=CLASSES, n_train=16, n_test=8)
    result = run(python_cmd("train.py", *TRAIN, "--epochs", "2", "--save-weights", "w.pt", "--metrics-file", "m.jsonl",
                            "--checkpoint-dir", "ckpt"), cwd=project, env=CPU)
    assert result.returncode == 0, result.stdout + result.stderr
    return project


def predict(project, *args):
    result = run(python_cmd("predict.py", *MODEL, *args), cwd=project, env=CPU)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def true_class(row):
    return row["path"].split("/")[-2]  # imgs/test/CLASS/IMAGE


def top_k(row):
    """{class: probability} of the top_k column, in its order."""
    return {name: float(p) for name, p in (pair.split(" ") for pair in row["top_k"].split("; "))}


def test_predictions_agree_with_the_accuracy_training_reported(trained):
    result = predict(trained, "--weights", "w.pt", "imgs/test", "--output", "preds.csv")
    assert result.returncode == 0, result.stderr
    rows = read_csv(trained / "preds.csv")
    test_images = sorted(str(p.relative_to(trained)) for p in (trained / "imgs" / "test").rglob("*.*")
                         if p.suffix in (".png", ".jpg"))
    assert sorted(row["path"] for row in rows) == test_images and len(rows) == CLASSES * 8
    accuracy = sum(row["prediction"] == true_class(row) for row in rows) / len(rows)
    last = read_metrics(trained / "m.jsonl")[-1]
    assert last["val_samples"] == len(rows)
    assert abs(accuracy - last["val_accuracy"]) < 1e-9, (accuracy, last["val_accuracy"])
    assert 0 < accuracy < 1  # neither trivially right nor wrong: the rows carry information

    for row in rows:  # top_k: every class (3 <= --top-k 3), most probable first, the first one the prediction
        top = top_k(row)
        assert sorted(top) == [f"class_{i}" for i in range(CLASSES)]
        assert next(iter(top)) == row["prediction"] and abs(top[row["prediction"]] - float(row["probability"])) <= 5e-4
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert abs(sum(top.values()) - 1) <= 2e-3
    # The probabilities, not just their argmax, are training's: its val_loss from each true class's probability.
    loss = sum(-math.log(top_k(row)[true_class(row)]) for row in rows) / len(rows)
    assert abs(loss - last["val_loss"]) < 1e-3, (loss, last["val_loss"])

    summary = result.stdout
    assert (f"Classified {len(rows)} images with Net(num_classes=3, in_channels=3, image_size=(28, 28)) from "
            "pixel_net.py on cpu in ") in summary
    assert "images/s" in summary
    assert "Skipped 0 unreadable images; ignored 1 file that is not an image" in summary  # notes.txt
    predicted = next(line for line in summary.splitlines() if line.startswith("Predicted (images per class): "))
    counted = dict(pair.rsplit(" ", 1) for pair in predicted.split(": ", 1)[1].split(", "))
    assert counted == {name: str(n) for name, n in Counter(row["prediction"] for row in rows).items()}
    assert "Predictions written to preds.csv" in summary

    # Other batch sizes (a last batch of 4, and the next batch decoded ahead) give the same rows, to stdout.
    again = predict(trained, "--weights", "w.pt", "imgs/test", "--batch-size", "5", "--top-k", "1")
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert lines[0] == "path,prediction,probability,top_k" and len(lines) == len(rows) + 1
    assert [line.split(",")[:2] for line in lines[1:]] == [[r["path"], r["prediction"]] for r in rows]
    assert all(line.split(",")[3].count(" ") == 1 for line in lines[1:])  # --top-k 1: one class
    assert f"Classified {len(rows)} images" in again.stderr  # the summary leaves stdout to the CSV


def test_a_checkpoint_predicts_what_the_saved_weights_of_its_run_predict(trained):
    checkpoints = sorted((trained / "ckpt").glob("checkpoint_*.pt"))
    assert checkpoints
    from_weights = predict(trained, "--weights", "w.pt", "imgs/test", "--top-k", "10")
    from_checkpoint = predict(trained, "--weights", checkpoints[-1], "imgs/test", "--top-k", "10")
    assert from_weights.returncode == from_checkpoint.returncode == 0, from_checkpoint.stderr
    assert from_checkpoint.stdout == from_weights.stdout
    rows = from_weights.stdout.splitlines()[1:]
    assert len(rows) == CLASSES * 8 and all(row.count(";") == CLASSES - 1 for row in rows)  # --top-k 10: all 3


def test_odd_files_are_skipped_listed_or_ignored_never_a_traceback(trained, tmp_path):
    folder = tmp_path / "photos"
    (folder / "nested" / "deeper").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    source = next((trained / "imgs" / "test" / "class_1").glob("*.png"))
    shutil.copy(source, folder / "a.png")
    shutil.copy(source, os.path.join(os.fsencode(folder), b"caf\xe9.png"))  # a Latin-1 name: not UTF-8
    Image.open(source).convert("RGB").save(folder / "nested" / "deeper" / "UPPER.JPG")
    Image.open(source).convert("L").save(folder / "nested" / "gray.png")
    shutil.copy(source, folder / ".hidden" / "skipped.png")
    shutil.copy(source, folder / ".skipped.png")
    (folder / "x.jpg").write_bytes(b"this is no JPEG" * 10)
    (folder / "notes.txt").write_text("not an image\n")
    single = tmp_path / "single.png"
    shutil.copy(source, single)

    result = predict(trained, "--weights", "w.pt", folder, single, "--output", tmp_path / "out" / "p.csv")
    assert result.returncode == 0, result.stderr
    paths = [row["path"] for row in read_csv(tmp_path / "out" / "p.csv")]
    assert paths == [f"{folder}/a.png", f"{folder}/caf\\xe9.png", f"{folder}/nested/gray.png",
                     f"{folder}/nested/deeper/UPPER.JPG", str(single)]  # a folder's files, then its subfolders
    assert error_lines(result.stderr) == []
    assert [line for line in result.stderr.splitlines() if "x.jpg" in line] == [
        line for line in result.stderr.splitlines() if line.startswith(f"unreadable, skipped: {folder}/x.jpg: ")]
    assert "x.jpg" in result.stderr
    assert "Skipped 1 unreadable image (listed on stderr); ignored 1 file that is not an image" in result.stdout
    assert "Classified 5 images" in result.stdout
    assert os.listdir(tmp_path / "out") == ["p.csv"]  # its temporary file gone


def one_line_error(capsys, *args):
    """The exit status and the one error line of predict.py run with ``args``."""
    code = run_main("predict.py", *args)
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


def test_mistakes_are_one_line(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(trained)
    assert one_line_error(capsys, "--weights", "nope.pt", "imgs/test") == (2, "error: --weights nope.pt: no such file")

    plain = tmp_path / "plain.pt"
    torch.save(Net(CLASSES, 3).state_dict(), plain)
    code, line = one_line_error(capsys, *MODEL, "--weights", plain, "imgs/test")
    assert code == 2 and f"--weights {plain} does not record classes" in line and "train.py --save-weights" in line

    # Weights of before the model's file was recorded name --model pixel_net:Net (its stem) alone, which does
    # not import from predict.py's folder.
    state = torch.load(trained / "w.pt", weights_only=True)
    for key in ("model_file", "model_file_near"):
        del state._metadata[""]["task"][key]
    torch.save(state, tmp_path / "old.pt")
    result = run(python_cmd("predict.py", "--weights", tmp_path / "old.pt", "imgs/test"), cwd=trained, env=CPU)
    lines = error_lines(result.stderr)  # a process of its own: no pixel_net imported by another test
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr and not result.stdout
    assert "--model pixel_net:Net" in lines[0] and "pass --model path/to/pixel_net.py:Net" in lines[0]

    (tmp_path / "mine.csv").write_text("my own work\n")
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "no/such/images",
                                "--output", tmp_path / "mine.csv")  # refused first, before the paths are looked at
    assert (code, line) == (2, f"error: --output {tmp_path / 'mine.csv'} exists already; choose a new file name "
                                "(nothing is overwritten)")
    assert (tmp_path / "mine.csv").read_text() == "my own work\n"

    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "imgs/test", "--out", tmp_path / "p.csv")
    assert (code, line) == (2, f"predict.py: error: unrecognized arguments: --out {tmp_path / 'p.csv'}; did you "
                               "mean --output? (see --help)")  # an abbreviation is a typo, not taken as --output
    assert not (tmp_path / "p.csv").exists()

    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "imgs/test", "no/such/images")
    assert (code, line) == (2, "error: no/such/images: no such file or folder")

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no images here\n")
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", tmp_path / "empty")
    assert code == 2 and line.startswith(f"error: no image files in {tmp_path / 'empty'} (") and "1 other" in line

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.png").write_bytes(b"\x89PNG garbage")
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", tmp_path / "broken",
                                "--output", tmp_path / "none.csv")
    assert code == 2 and "none of the 1 image file(s) could be read" in line
    assert not (tmp_path / "none.csv").exists() and sorted(os.listdir(tmp_path)) == ["broken", "empty", "mine.csv",
                                                                                   "old.pt", "plain.pt"]


def test_the_summary_counts_in_words():
    """One image is "1 image", not "1 images"; the classes most predicted come first."""
    out = io.StringIO()
    summary_report(out, Counter(cat=1), 0, 1, "cpu", 0.5, "Net", None)
    assert out.getvalue().splitlines() == [
        "Classified 1 image with Net on cpu in 0.5 s (2 images/s)",
        "Skipped 0 unreadable images; ignored 1 file that is not an image",
        "Predicted (images per class): cat 1", "Predictions written to stdout"]
    out = io.StringIO()
    summary_report(out, Counter(dog=3, cat=1), 2, 0, "cpu", 1.0, "Net", None)
    assert out.getvalue().splitlines()[:3] == [
        "Classified 4 images with Net on cpu in 1.0 s (4 images/s)",
        "Skipped 2 unreadable images (listed on stderr); ignored 0 files that are not images",
        "Predicted (images per class): dog 3, cat 1"]
