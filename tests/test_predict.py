"""predict.py: weights from train.py classify new images as training's evaluation did (the same
accuracy on the test images), from a --save-weights file or a checkpoint; odd folders (an
unreadable image, a file name that is not UTF-8, stray files) and every mistake are lines,
never a traceback, and nothing a user wrote is overwritten. --held-out adds each class's
accuracy and a confusion matrix (a CSV, and a PNG with matplotlib)."""

import csv
import importlib.util
import io
import math
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from engine.errors import UserError
from engine.image_folder import scan
from engine.task import held_out_record, names_sha256
from engine.weights import save_weights
from predict import confusion_matrix, confusion_rows, held_out_images, per_class_accuracy, per_class_lines
from predict import report as summary_report
from conftest import (FAST, TINY_MODEL, clean_env, error_lines, python_cmd, read_metrics, run, run_main,
                      write_image_folder)
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
    assert "--synthetic" not in result.stderr  # weights of real images: no warning

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
    counted = dict(pair.rsplit(": ", 1) for pair in predicted.split(": ", 1)[1].split(", "))
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
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out" / "p.csv").stat().st_mode) == 0o666 & ~umask  # colleagues read it too


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
    for folder in (f"{tmp_path / 'new'}/", str(tmp_path)):  # not the file new, nor a CSV beside a folder
        code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "imgs/test", "--output", folder)
        assert (code, line) == (2, f"predict.py: error: argument --output: {folder} names a folder: name the CSV file "
                                   f"in it, e.g. {os.path.join(folder, 'predictions.csv')} (see --help)")
    assert not (tmp_path / "new").exists()
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "imgs/test", "--image-size", "64")  # train.py's
    assert (code, line) == (2, "predict.py: error: unrecognized arguments: --image-size 64; --image-size: not needed, "
                               "each image is prepared as the --weights' training prepared its own (size, crop, "
                               "colours) (see --help)")
    code, line = one_line_error(capsys, *MODEL, "--weight", "w.pt", "imgs/test")  # the typo, not the missing flag
    assert (code, line) == (2, "predict.py: error: unrecognized arguments: --weight; did you mean --weights? (see "
                               "--help)")
    for images in (["imgs/test"], ["--", "imgs/test"]):  # after "--" no word is a flag
        code, line = one_line_error(capsys, *MODEL, *images)
        assert (code, line) == (2, "predict.py: error: the following arguments are required: --weights (see --help)")
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "--held-out", "no/such")
    assert (code, line) == (2, "error: --held-out no/such: no such folder")  # the flag given, not --data-dir
    one = tmp_path / "one"  # a class folder alone: not the folder w.pt trained on
    (one / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(one / "cat" / "a.png")
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "--held-out", one)
    assert (code, line) == (2, f"error: --held-out {one} holds 1 class folder (cat): not the folder --weights w.pt "
                               "were trained on, of 3 classes (class_0, class_1, class_2); --held-out takes that folder")
    shutil.copytree("imgs", one / "photos")  # one level too high: the scan's own line names the folder meant
    shutil.rmtree(one / "cat")
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "--held-out", one)
    assert (code, line) == (2, f"error: {one} holds 1 class folder (photos): a classifier needs at least two; did you "
                               f"mean --held-out {one / 'photos'}?")
    shutil.rmtree(one)

    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", "imgs/test", "no/such/images")
    assert (code, line) == (2, "error: no/such/images: no such file or folder")

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no images here\n")
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", tmp_path / "empty")
    assert code == 2 and line.startswith(f"error: no image files in {tmp_path / 'empty'} (")
    assert line.endswith("; 1 other file ignored)")

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.png").write_bytes(b"\x89PNG garbage")
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", tmp_path / "broken",
                                "--output", tmp_path / "none.csv")
    assert code == 2 and line.startswith(f"error: {tmp_path / 'broken' / 'x.png'}: not a readable image (")
    assert not (tmp_path / "none.csv").exists() and sorted(os.listdir(tmp_path)) == ["broken", "empty", "mine.csv",
                                                                                   "old.pt", "plain.pt"]
    code, line = one_line_error(capsys, *MODEL, "--weights", "w.pt", tmp_path / "broken", trained / "m.jsonl")
    assert code == 2 and "none of the 2 image files could be read (listed above)" in line
    assert capsys.readouterr().out == ""  # to stdout: no CSV header alone either


def test_a_checkpoint_folder_given_as_weights_names_the_weights_in_it(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(trained)
    folder = tmp_path / "ck"
    folder.mkdir()
    assert one_line_error(capsys, *MODEL, "--weights", folder, "imgs/test") == (
        2, f"error: --weights {folder} is a folder, not a weights file")
    shutil.copy(trained / "w.pt", folder / "model_best.pt")  # what --checkpoint-dir keeps: its best epoch's
    assert one_line_error(capsys, *MODEL, "--weights", folder, "imgs/test") == (
        2, f"error: --weights {folder} is a folder, not a weights file; did you mean {folder / 'model_best.pt'}?")


def test_a_reader_that_closes_stdout_ends_it_quietly(trained, tmp_path):
    """predict.py ... | head: once the reader has the rows it wanted and closes the pipe,
    predict.py ends as Unix tools do: no line, and 141, the status SIGPIPE gives them; but only
    after the files it was asked for (--confusion-matrix) are written."""
    for images in (["imgs/test", "--output", "/dev/stdout"],  # a pipe here: stdout under its other name
                   ["--held-out", "imgs", "--output", tmp_path / "h.csv"],  # the summary on the closed stdout
                   ["--held-out", "imgs", "--confusion-matrix", tmp_path / "cm.csv"]):
        process = subprocess.Popen([str(c) for c in python_cmd("predict.py", *MODEL, "--weights", "w.pt", *images)],
                                   cwd=trained, env=CPU, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        process.stdout.close()  # gone before the first row: any write to the pipe fails
        err = process.stderr.read()
        assert process.wait(timeout=300) == 141 and "Traceback" not in err and error_lines(err) == [], err
    assert f"written to {tmp_path / 'cm.csv'}" in err  # the summary, on stderr as ever with rows on stdout
    assert confusion_csv(tmp_path / "cm.csv")[1] == TEST_CLASSES
    assert len(read_csv(tmp_path / "h.csv")) == CLASSES * 8 and confusion_csv(tmp_path / "h-confusion.csv")[1]


def test_a_file_named_twice_is_classified_once(tmp_path):
    """A folder and a file in it, or one file by two names: one row each, the first name kept."""
    from predict import find_images
    folder = tmp_path / "new"
    folder.mkdir()
    for name in ("a.png", "img 2.png"):
        Image.new("RGB", (8, 8)).save(folder / name)
    images, ignored = find_images([folder, folder / "img 2.png", tmp_path / "new" / ".." / "new" / "a.png"])
    assert images == [folder / "a.png", folder / "img 2.png"] and ignored == 0


def test_the_summary_counts_in_words():
    """One image is "1 image", not "1 images"; the classes most predicted come first."""
    out = io.StringIO()
    summary_report(out, Counter(cat=1), 0, 1, "cpu", 0.5, "Net", None)
    assert out.getvalue().splitlines() == [
        "Classified 1 image with Net on cpu in 0.5 s (2 images/s)",
        "Skipped 0 unreadable images; ignored 1 file that is not an image",
        "Predicted (images per class): cat: 1", "Predictions written to stdout"]
    out = io.StringIO()
    summary_report(out, Counter(dog=3, cat=1), 2, 0, "cpu", 1.0, "Net", None)
    assert out.getvalue().splitlines()[:3] == [
        "Classified 4 images with Net on cpu in 1.0 s (4 images/s)",
        "Skipped 2 unreadable images (listed on stderr); ignored 0 files that are not images",
        "Predicted (images per class): dog: 3, cat: 1"]
    out = io.StringIO()
    summary_report(out, Counter(cat=1), 0, None, "cpu", 2.7, "Net", None)
    assert out.getvalue().splitlines()[0] == "Classified 1 image with Net on cpu in 2.7 s (0.37 images/s)"


TEST_CLASSES = [f"class_{i}" for i in range(CLASSES)]


def images_of(project):
    """The image files of the project's imgs/test, as the CSV names them."""
    return sorted(str(p.relative_to(project)) for p in (project / "imgs" / "test").rglob("*.*")
                  if p.suffix in (".png", ".jpg"))


@pytest.fixture
def here(trained, monkeypatch):
    """For run_main of predict.py in this process, from the trained project: the pixel_net.py
    it imports and the folder it adds to sys.path are this test's alone."""
    monkeypatch.chdir(trained)
    monkeypatch.setattr(sys, "path", sys.path[:])
    monkeypatch.setitem(sys.modules, "pixel_net", None)
    return trained


def test_output_dash_and_dev_stdout_are_stdout(trained):
    """--output - is stdout, as no --output is; /dev/stdout (a pipe here) is not a regular file,
    so it is written to instead of refused as existing. The summary goes to stderr, not among
    the rows."""
    dash = predict(trained, "--weights", "w.pt", "imgs/test", "--output", "-")
    dev = predict(trained, "--weights", "w.pt", "imgs/test", "--output", "/dev/stdout")
    assert dash.returncode == dev.returncode == 0, dash.stderr + dev.stderr
    lines = dash.stdout.splitlines()
    assert lines[0] == "path,prediction,probability,top_k" and len(lines) == 1 + CLASSES * 8
    assert sorted(line.split(",")[0] for line in lines[1:]) == images_of(trained)
    assert dev.stdout == dash.stdout
    assert "Predictions written to stdout" in dash.stderr.splitlines()
    assert "Predictions written to /dev/stdout" in dev.stderr.splitlines()
    assert not (trained / "-").exists()


def test_dev_stdout_redirected_into_a_file_is_refused_as_any_existing_file(trained, tmp_path):
    """/dev/stdout is then the regular file the shell opened: refused as existing (the line
    says how to write to stdout), and nothing is written to it."""
    with open(tmp_path / "out.csv", "w") as out:
        result = subprocess.run([str(c) for c in python_cmd("predict.py", *MODEL, "--weights", "w.pt", "imgs/test",
                                                            "--output", "/dev/stdout")],
                                cwd=trained, env=CPU, stdout=out, stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert error_lines(result.stderr) == [
        "error: --output /dev/stdout exists already; choose a new file name (nothing is overwritten); leave out "
        "--output (or give --output -) to write to stdout"]
    assert (tmp_path / "out.csv").read_text() == ""


def test_a_fifo_is_written_to_and_an_existing_file_refused(here, tmp_path, capsys):
    fifo = tmp_path / "rows"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    try:
        code = run_main("predict.py", *MODEL, "--weights", "w.pt", "imgs/test", "--output", fifo)
    finally:
        if reader.is_alive():  # predict.py failed before opening the FIFO: let the reader's open return
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        reader.join(timeout=60)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = received[0].splitlines()
    assert lines[0] == "path,prediction,probability,top_k" and len(lines) == 1 + CLASSES * 8
    assert sorted(line.split(",")[0] for line in lines[1:]) == images_of(here)
    assert f"Predictions written to {fifo}" in captured.out.splitlines()  # the summary to stdout, as for a file
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.listdir(tmp_path) == ["rows"]  # no temporary file left

    (tmp_path / "mine.csv").write_text("my own work\n")  # a regular file is still refused
    assert one_line_error(capsys, *MODEL, "--weights", "w.pt", "imgs/test", "--output", tmp_path / "mine.csv") == (
        2, f"error: --output {tmp_path / 'mine.csv'} exists already; choose a new file name (nothing is overwritten)")
    assert (tmp_path / "mine.csv").read_text() == "my own work\n"


def test_weights_of_one_class_are_refused_in_one_line(here, tmp_path, capsys):
    """Before the model is built: the weights name a model that does not exist."""
    task = {"image_size": [28, 28], "in_channels": 3, "mean": [0.5] * 3, "std": [0.25] * 3,
            "model": "no_such_module:Net"}
    save_weights(Net(1, 3), tmp_path / "one.pt", {**task, "classes": ["PHOTOS"]})
    assert one_line_error(capsys, "--weights", tmp_path / "one.pt", "imgs/test") == (
        2, f"error: --weights {tmp_path / 'one.pt'} were trained on 1 class (PHOTOS): a classifier needs at least two; "
           "train again on a folder of class folders (did --data-dir point one level too high?)")
    save_weights(Net(1, 3), tmp_path / "none.pt", {**task, "classes": []})
    code, line = one_line_error(capsys, "--weights", tmp_path / "none.pt", "--held-out", "imgs")
    assert code == 2 and line.startswith(f"error: --weights {tmp_path / 'none.pt'} were trained on 0 classes: a ")


def test_weights_of_synthetic_data_say_their_predictions_mean_nothing(here, tmp_path, capsys):
    weights = tmp_path / "syn.pt"
    assert run_main("train.py", "--synthetic", *TINY_MODEL, "--epochs", "1", "--limit-batches", "1", "--batch-size",
                    "8", "--save-weights", weights, *FAST) == 0
    capsys.readouterr()
    assert run_main("predict.py", "--weights", weights, "imgs/test", "--output", tmp_path / "p.csv") == 0
    out, err = capsys.readouterr()
    assert (f"WARNING: --weights {weights} learnt --synthetic data (random images and labels): these predictions "
            "mean nothing") in out + err
    assert len(read_csv(tmp_path / "p.csv")) == CLASSES * 8  # classified all the same


def confusion_csv(path):
    """(header, [true class of each row], [[count per predicted class] of each row])."""
    with open(path, newline="", encoding="utf-8") as f:
        header, *rows = list(csv.reader(f))
    return header, [row[0] for row in rows], [[int(n) for n in row[1:]] for row in rows]


def test_held_out_prints_each_class_and_writes_the_confusion_matrix_beside(trained, tmp_path):
    result = predict(trained, "--weights", "w.pt", "--held-out", "imgs", "--output", tmp_path / "held.csv")
    assert result.returncode == 0, result.stderr
    rows = read_csv(tmp_path / "held.csv")
    assert len(rows) == CLASSES * 8 and all(row["label"] == true_class(row) for row in rows)
    header, true_classes, counts = confusion_csv(tmp_path / "held-confusion.csv")
    assert header == ["true \\ predicted", *TEST_CLASSES] and true_classes == TEST_CLASSES
    pairs = Counter((row["label"], row["prediction"]) for row in rows)
    assert counts == [[pairs[(true, guess)] for guess in TEST_CLASSES] for true in TEST_CLASSES]
    correct = sum(row["label"] == row["prediction"] for row in rows)
    assert sum(map(sum, counts)) == len(rows) and sum(counts[i][i] for i in range(CLASSES)) == correct
    assert 0 < correct < len(rows)  # mistakes off the diagonal: the matrix's layout is tested

    out = result.stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("Accuracy: "))
    assert out[at] == f"Accuracy: {correct / len(rows):.4f} ({correct} of {len(rows)}) on the 24 test images of imgs"
    per_class = out[at + 1:at + 1 + CLASSES]
    for name, line, row in zip(TEST_CLASSES, per_class, counts):
        right = sum(r["label"] == r["prediction"] == name for r in rows)
        total = sum(r["label"] == name for r in rows)
        assert (right, total) == (row[TEST_CLASSES.index(name)], sum(row))
        assert line == f"  {name}: {right / total:.4f} ({right} of {total})"
    picture = tmp_path / "held-confusion.png"
    if importlib.util.find_spec("matplotlib"):
        assert out[at + 1 + CLASSES:] == [f"Confusion matrix (rows: true class, columns: predicted) written to "
                                          f"{tmp_path / 'held-confusion.csv'} and, as a picture, {picture}"]
        with Image.open(picture) as image:
            assert image.format == "PNG" and min(image.size) >= 300
            assert len(image.convert("RGB").getcolors(maxcolors=1 << 16)) > 10  # cells, names, numbers: not blank
        assert sorted(os.listdir(tmp_path)) == ["held-confusion.csv", "held-confusion.png", "held.csv"]
    else:
        assert "matplotlib is not installed" in out[at + 1 + CLASSES]
        assert sorted(os.listdir(tmp_path)) == ["held-confusion.csv", "held.csv"]


def test_labelled_classifies_a_whole_folder_of_class_folders_as_held_out_does(trained, tmp_path):
    """--labelled imgs/test is the test set --held-out imgs finds: the same rows, accuracy and
    matrix; a folder of some of the classes (a file that is not an image among them) is
    labelled by the weights' class indices, the class without images said so."""
    held = predict(trained, "--weights", "w.pt", "--held-out", "imgs", "--output", tmp_path / "held.csv")
    labelled = predict(trained, "--weights", "w.pt", "--labelled", "imgs/test", "--output", tmp_path / "new.csv")
    assert held.returncode == labelled.returncode == 0, held.stderr + labelled.stderr
    assert read_csv(tmp_path / "new.csv") == read_csv(tmp_path / "held.csv")
    assert confusion_csv(tmp_path / "new-confusion.csv") == confusion_csv(tmp_path / "held-confusion.csv")
    [accuracy] = [line for line in labelled.stdout.splitlines() if line.startswith("Accuracy: ")]
    [held_accuracy] = [line for line in held.stdout.splitlines() if line.startswith("Accuracy: ")]
    assert accuracy == held_accuracy.replace("the 24 test images of imgs",
                                             "the 24 labelled images of imgs/test (3 of the 3 classes)")
    trained_on = predict(trained, "--weights", "w.pt", "--labelled", "imgs/train", "--output", tmp_path / "train.csv")
    out = trained_on.stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("Accuracy: "))
    assert out[at].endswith("on the 48 labelled images of imgs/train (3 of the 3 classes)")
    assert out[at + 1] == (f"WARNING: the weights were trained on images of imgs/train, so this is no validation "
                           f"accuracy (--held-out {trained / 'imgs'} classifies the images its training validated on)")
    assert not any(line.startswith("WARNING") for line in labelled.stdout.splitlines())  # imgs/test: not trained on

    some = tmp_path / "some"
    for name in TEST_CLASSES[1:]:  # the first class left out
        shutil.copytree(trained / "imgs" / "test" / name, some / name / "nested")
    (some / TEST_CLASSES[2] / "notes.txt").write_text("not an image\n")
    (some / "README.txt").write_text("beside the class folders: ignored too\n")
    (some / TEST_CLASSES[0]).mkdir()  # a class folder without images: a class without images
    result = predict(trained, "--weights", "w.pt", "--labelled", some, "--output", tmp_path / "some.csv")
    assert result.returncode == 0, result.stderr
    rows = read_csv(tmp_path / "some.csv")
    assert len(rows) == 16 and all(row["label"] == row["path"].split("/")[-3] for row in rows)
    def predictions(csv_rows):  # (class, file name) -> prediction
        return {(row["label"], Path(row["path"]).name): row["prediction"] for row in csv_rows}

    held_rows = [row for row in read_csv(tmp_path / "held.csv") if row["label"] != TEST_CLASSES[0]]
    assert predictions(rows) == predictions(held_rows) and len(predictions(rows)) == 16  # the same images' classes
    out = result.stdout.splitlines()
    assert "ignored 2 files that are not images" in out[1]
    at = next(i for i, line in enumerate(out) if line.startswith("Accuracy: "))
    assert out[at].endswith(f" on the 16 labelled images of {some} (2 of the 3 classes)")
    assert out[at + 3] == f"  no images: {TEST_CLASSES[0]}"
    header, true_classes, counts = confusion_csv(tmp_path / "some-confusion.csv")
    assert header[1:] == true_classes == TEST_CLASSES and sum(counts[0]) == 0 and sum(map(sum, counts)) == 16


def test_labelled_mistakes_are_one_line(here, tmp_path, capsys):
    (tmp_path / "split" / "train" / "class_0").mkdir(parents=True)
    (tmp_path / "split" / "test" / "class_0").mkdir(parents=True)
    (tmp_path / "other" / "class_0").mkdir(parents=True)
    (tmp_path / "other" / "zebra").mkdir()
    shutil.copytree(here / "imgs" / "test" / "class_1", tmp_path / "flat")
    shutil.copytree(here / "imgs" / "test" / "class_1", tmp_path / "one" / "class_1")  # a class folder itself
    shutil.copytree(here / "imgs" / "test" / "class_1", tmp_path / "beside" / "class_1")
    shutil.copy(next((tmp_path / "flat").iterdir()), tmp_path / "beside")
    (tmp_path / "empty" / "class_0").mkdir(parents=True)
    weights = ("--weights", "w.pt")
    assert one_line_error(capsys, *weights, "--labelled", tmp_path / "split") == (
        2, f"error: --labelled {tmp_path / 'split'}: test, train are not among the 3 classes the weights were "
           f"trained on; did you mean --labelled {tmp_path / 'split' / 'test'}?")
    for split in ("test", "train"):  # not the weights' data set: no split to suggest
        (tmp_path / "split" / split / "zebra").mkdir()
    assert one_line_error(capsys, *weights, "--labelled", tmp_path / "split") == (
        2, f"error: --labelled {tmp_path / 'split'}: test, train are not among the 3 classes the weights were "
           "trained on (class_0, class_1, class_2)")
    assert one_line_error(capsys, *weights, "--labelled", tmp_path / "other") == (
        2, f"error: --labelled {tmp_path / 'other'}: zebra is not among the 3 classes the weights were trained on "
           "(class_0, class_1, class_2)")
    code, line = one_line_error(capsys, *weights, "--labelled", tmp_path / "flat")
    assert code == 2 and line.startswith(f"error: --labelled {tmp_path / 'flat'} holds images (") and line.endswith(
        f"but no class folders (ROOT/CLASS/IMAGE: an image's label is the folder it is in); to classify them without "
        f"labels, give the folder itself: predict.py ... {tmp_path / 'flat'}")
    code, line = one_line_error(capsys, *weights, "--labelled", tmp_path / "one" / "class_1")
    assert code == 2 and line.endswith(f"it is class class_1's folder: give the folder above it, --labelled "
                                       f"{tmp_path / 'one'}")
    code, line = one_line_error(capsys, *weights, "--labelled", tmp_path / "beside")
    assert code == 2 and line.startswith(f"error: --labelled {tmp_path / 'beside'} holds ") and "beside its class" in line
    assert one_line_error(capsys, *weights, "--labelled", tmp_path / "empty") == (
        2, f"error: --labelled {tmp_path / 'empty'} holds no image files in class folders (ROOT/CLASS/IMAGE)")
    assert one_line_error(capsys, *weights, "--labelled", tmp_path / "none") == (
        2, f"error: --labelled {tmp_path / 'none'}: no such folder")
    code, line = one_line_error(capsys, *weights, "--labelled", "imgs/test", "--confusion-matrix", tmp_path / "cm.png")
    assert (code, line) == (2, f"error: --confusion-matrix {tmp_path / 'cm.png'}: name the CSV file (FILE.csv); its "
                               "picture is written beside it as FILE.png")
    code, line = one_line_error(capsys, *weights, "--labelled", "imgs/test", "imgs/test")
    assert code == 2 and "--held-out DIR or --labelled DIR, one of them" in line


def test_an_unreadable_held_out_image_is_counted_as_left_out(trained, tmp_path):
    shutil.copytree(trained / "imgs", tmp_path / "imgs")
    (tmp_path / "imgs" / "test" / TEST_CLASSES[0] / "broken.png").write_bytes(b"\x89PNG cut short")
    result = predict(trained, "--weights", "w.pt", "--held-out", tmp_path / "imgs", "--output", tmp_path / "h.csv")
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("Accuracy: ")]
    assert f" of 24) on the 25 test images of {tmp_path / 'imgs'}, 1 unreadable one left out" in line


def test_held_out_to_stdout_names_the_flag_and_without_matplotlib_no_picture(here, tmp_path, capsys, monkeypatch):
    assert run_main("predict.py", *MODEL, "--weights", "w.pt", "--held-out", "imgs") == 0
    captured = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(captured.out)))
    assert len(rows) == CLASSES * 8 and all(row["label"] == true_class(row) for row in rows)
    summary = captured.err.splitlines()
    assert len([line for line in summary if line.startswith("  class_")]) == CLASSES
    assert summary[-1] == ("Confusion matrix not written: the predictions went to stdout, with no file to put it "
                           "beside; pass --confusion-matrix FILE.csv to write it")
    assert not list(here.rglob("*confusion*"))

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert run_main("predict.py", *MODEL, "--weights", "w.pt", "--held-out", "imgs",
                    "--confusion-matrix", tmp_path / "cm" / "m.csv") == 0
    captured = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(captured.out)))
    pairs = Counter((row["label"], row["prediction"]) for row in rows)
    header, true_classes, counts = confusion_csv(tmp_path / "cm" / "m.csv")
    assert header[1:] == true_classes == TEST_CLASSES
    assert counts == [[pairs[(true, guess)] for guess in TEST_CLASSES] for true in TEST_CLASSES]
    assert captured.err.splitlines()[-1] == (
        f"Confusion matrix (rows: true class, columns: predicted) written to {tmp_path / 'cm' / 'm.csv'}; its picture "
        f"({tmp_path / 'cm' / 'm.png'}) was not written: matplotlib is not installed (pip install matplotlib)")
    assert os.listdir(tmp_path / "cm") == ["m.csv"]


def test_an_existing_confusion_matrix_is_refused_before_any_work(here, tmp_path, capsys):
    """Checked with --output, before the weights (here: none) or the folder (none) are read;
    nothing is written."""
    mine = {"held-confusion.csv": "my own work\n", "cm.csv": "mine too\n", "pic.png": "a picture\n"}
    for name, text in mine.items():
        (tmp_path / name).write_text(text)
    nothing = ("--weights", "nope.pt", "--held-out", "no/such/folder")
    assert one_line_error(capsys, *nothing, "--output", tmp_path / "held.csv") == (
        2, f"error: --confusion-matrix {tmp_path / 'held-confusion.csv'} (the default, beside --output "
           f"{tmp_path / 'held.csv'}) exists already; choose a new file name (nothing is overwritten)")
    assert one_line_error(capsys, *nothing, "--output", tmp_path / "held.csv", "--confusion-matrix",
                          tmp_path / "cm.csv") == (
        2, f"error: --confusion-matrix {tmp_path / 'cm.csv'} exists already; choose a new file name (nothing is "
           "overwritten)")
    if importlib.util.find_spec("matplotlib"):
        assert one_line_error(capsys, *nothing, "--confusion-matrix", tmp_path / "pic.csv") == (
            2, f"error: {tmp_path / 'pic.png'}, the picture beside --confusion-matrix {tmp_path / 'pic.csv'}, exists "
               "already; choose a new file name (nothing is overwritten)")
    assert one_line_error(capsys, *nothing, "--output", tmp_path / "a.csv", "--confusion-matrix",
                          tmp_path / "a.csv") == (
        2, f"error: --confusion-matrix {tmp_path / 'a.csv'} and --output would be the same file ({tmp_path / 'a.csv'}); "
           "choose other names")
    code, line = one_line_error(capsys, "--weights", "w.pt", "imgs/test", "--confusion-matrix", tmp_path / "b.csv")
    assert code == 2 and line.startswith("predict.py: error: --confusion-matrix needs --held-out DIR")
    assert sorted(os.listdir(tmp_path)) == sorted(mine)
    assert all((tmp_path / name).read_text() == text for name, text in mine.items())


def test_confusion_matrix_and_per_class_accuracy_of_a_small_example():
    """Rows are true classes, columns predicted ones; a class without images says so."""
    matrix = confusion_matrix([0, 0, 0, 1, 2, 2], [0, 1, 0, 1, 0, 2], 4)
    assert matrix.tolist() == [[2, 1, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]
    right, total = per_class_accuracy(matrix)
    assert right.tolist() == [2, 1, 1, 0] and total.tolist() == [3, 1, 2, 0]
    names = ["cat", "dog", "red, panda", "yak"]
    assert per_class_lines(matrix, names) == ["  cat: 0.6667 (2 of 3)", "  dog: 1.0000 (1 of 1)",
                                              "  red, panda: 0.5000 (1 of 2)", "  no images: yak"]
    many = [f"c{i}" for i in range(100)]  # a folder of 2 of 100 classes: one line for the other 98
    assert per_class_lines(confusion_matrix([5, 7], [5, 5], 100), many) == [
        "  c5: 1.0000 (1 of 1)", "  c7: 0.0000 (0 of 1)",
        "  no images: c0, c1, c2, c3, c4, c6, c8, c9, c10, c11, ... (98 classes)"]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(confusion_rows(matrix, names))
    assert out.getvalue().splitlines() == ['true \\ predicted,cat,dog,"red, panda",yak', "cat,2,1,0,0", "dog,0,1,0,0",
                                           '"red, panda",1,0,1,0', "yak,0,0,0,0"]
    assert confusion_matrix([], [], 2).tolist() == [[0, 0], [0, 0]]


def test_held_out_images_of_a_split_that_held_out_none_is_one_line(tmp_path):
    """Weights trained (before that was refused) with --val-fraction on one image per class: the
    split they record holds out nothing, and --held-out ended in an IndexError traceback."""
    root = write_image_folder(tmp_path / "images", classes=2, n_train=1, n_test=0, gray_every=0, stray=False)
    shutil.rmtree(root / "test")
    files, labels = scan(root, held_out=True).splits["train"]
    record = held_out_record(0.2, 0, labels, names=names_sha256(path.relative_to(root) for path in files))
    meta = {"dataset": "folder", "classes": ["class_0", "class_1"], "split": record}
    with pytest.raises(UserError) as raised:
        held_out_images(root, meta, tmp_path / "w.pt")
    assert str(raised.value) == (f"--held-out {root}: the --val-fraction 0.2 of --weights {tmp_path / 'w.pt'} held "
                                 "out no image (each class had a single one, kept for training)")


def test_held_out_on_the_test_folder_itself_names_the_folder_meant(tmp_path):
    """--held-out my_images/test, for weights validated on my_images/test/: the line said only
    that it has no test/ folder."""
    root = write_image_folder(tmp_path / "images", classes=2, n_train=1, n_test=1, gray_every=0, stray=False)
    meta = {"dataset": "folder", "classes": ["class_0", "class_1"]}
    with pytest.raises(UserError) as raised:
        held_out_images(root / "test", meta, "w.pt")
    assert str(raised.value) == (f"--weights w.pt were validated on a test/ (or val/) folder, and --held-out "
                                 f"{root / 'test'} has none; did you mean --held-out {root}?")
    assert len(held_out_images(root, meta, "w.pt")[0]) == 2  # the folder meant: its two test images
