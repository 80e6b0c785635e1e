"""A user's bad day (issue "Nothing lost, round 3"): full disks (real small tmpfs mounts),
the same job submitted twice on one checkpoint folder, a metrics line cut by a dying node,
damaged caches, file names that are not UTF-8, repeated stop signals. Each ends in one line
and the documented exit status, keeps every finished epoch and the model, and the next run
succeeds once the cause is gone."""

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from conftest import (FAST, REPO, TINY_MODEL, clean_env, error_lines, python_cmd, read_metrics, run, run_main,
                      start, unavailable, wait_held, write_image_folder)
from engine import checkpoints, files, folder_lock, image_cache, stopping, task
from engine import weights as weights_file
from engine.errors import EXIT_STOPPED, ResourceProblem, TrainingStopped, UserError
from engine.folder_lock import FolderLock, lease_is_free
from engine.processes import DistContext
from engine.log import RunLogger, locked_metrics, reconcile_metrics
from tools import gpu_report, report
import train_utils as tu

RUN = ("--synthetic", "--epochs", "2", "--limit-batches", "2", "--batch-size", "4", "--checkpoint-interval", "0",
       *FAST, *TINY_MODEL)


@pytest.fixture
def small_disk(tmp_path):
    """make(kb): a tmpfs of ``kb`` KiB, the test machine's stand-in for a full project disk."""
    mounts = []

    def make(kb):
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kb}k", "tmpfs", folder],
                          capture_output=True).returncode:
            unavailable("MOUNT_TESTS", "needs mount (root) to make a small file system")
        mounts.append(folder)
        return folder

    yield make
    for folder in mounts:
        subprocess.run(["umount", "-l", folder], check=True)


def fill(folder, leave=0):
    """Fill the file system of ``folder`` until ``leave`` bytes are free; returns the filler."""
    filler = folder / "filler"
    free = shutil.disk_usage(folder).free
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def one_error(err):
    [line] = error_lines(err)
    assert "Traceback" not in err
    return line


# ---------------------------------------------------------------------------------------------
# Full disks.

def test_a_checkpoint_that_does_not_fit_keeps_the_previous_one_and_resumes(small_disk, tmp_path, capsys):
    disk = small_disk(256)
    ck, metrics = disk / "ck", tmp_path / "m.jsonl"
    args = (*RUN, "--checkpoint-dir", ck, "--metrics-file", metrics)
    assert run_main("train.py", *args, "--epochs", "1") == 0
    first = sorted(p.name for p in ck.glob("checkpoint_*.pt"))
    filler = fill(disk, leave=4096)  # room for the lock file, not for a checkpoint
    capsys.readouterr()
    assert run_main("train.py", *args, "--resume", "--epochs", "3") == 1  # epoch 2's: not the final one
    out, err = capsys.readouterr()
    line = one_error(err)
    assert line.startswith(f"error: cannot write checkpoint {ck}/checkpoint_") and "No space left on device" in line
    assert "free there" in line and f"the previous checkpoint {ck / first[-1]} is kept" in line
    assert sorted(p.name for p in ck.glob("checkpoint_*.pt")) == first  # nothing half-written, nothing pruned
    assert not [p for p in ck.iterdir() if ".tmp" in p.name]
    filler.unlink()
    assert run_main("train.py", *args, "--resume", "--epochs", "3") == 0
    assert [r["epoch"] for r in read_metrics(metrics)] == [1, 2, 3]  # each finished epoch exactly once


def test_a_final_checkpoint_that_does_not_fit_costs_not_the_trained_model(small_disk, tmp_path, capsys, monkeypatch):
    """Trained to the end, and the final checkpoint does not fit: the weights are written all the
    same, to --save-weights or (without it) to a rescue folder, and the error says where. (A
    new user's walk: a full checkpoint folder lost the model, --save-weights on a roomy disk too.)"""
    disk = small_disk(256)
    ck, rescue = disk / "ck", tmp_path / "scratch"
    rescue.mkdir()
    monkeypatch.setenv("HOME", str(rescue))  # the first rescue folder
    assert run_main("train.py", *RUN, "--epochs", "1", "--checkpoint-dir", ck) == 0
    [first] = ck.glob("checkpoint_*.pt")
    fill(disk, leave=4096)
    for weights in (tmp_path / "w.pt", None):
        capsys.readouterr()
        assert run_main("train.py", *RUN, "--checkpoint-dir", ck, "--resume",
                        *(("--save-weights", weights) if weights else ())) == 1
        line = one_error(capsys.readouterr().err)
        assert line.startswith(f"error: cannot write checkpoint {ck}/checkpoint_") and "No space left" in line
        assert f"; the previous checkpoint {first} is kept: continue from it with --resume" in line
        if weights:
            assert line.endswith(f"; the trained weights were written to {weights}")
        else:
            [weights] = rescue.glob("weights-rescued-*.pt")
            assert line.endswith(f"; the trained weights were written to {weights} instead: move them where they "
                                 "belong")
        state = torch.load(weights, weights_only=True)
        assert state._metadata[""]["task"]["epoch"] == 2  # the model trained to the end, not epoch 1's
        assert not torch.equal(state["layers.6.weight"], torch.load(first, weights_only=True)["model"]["layers.6.weight"])
        assert list(ck.glob("checkpoint_*.pt")) == [first]


class _InterruptedFile(io.RawIOBase):
    """A file whose third write is interrupted by a Ctrl-C, as a second one during a stop checkpoint."""

    def __init__(self):
        self.writes = 0

    def writable(self):
        return True

    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            raise KeyboardInterrupt("a second Ctrl-C")
        return len(data)


def test_a_ctrl_c_within_torch_save_is_not_hidden_by_its_writers_error():
    """torch's zip writer, interrupted within a record, fails again as it closes: the Ctrl-C
    behind that error is what atomic_save raises (its line, exit 130), not a traceback (1)."""
    try:  # torch 2.7 to 2.14: RuntimeError (unexpected pos); a torch that raises the interrupt itself is fine too
        torch.save({"a": torch.zeros(100_000), "b": torch.zeros(10)}, _InterruptedFile())
    except BaseException as err:  # noqa: B036 (the KeyboardInterrupt must not end the test session)
        raised = err
    assert files.interrupt_behind(raised).args == ("a second Ctrl-C",)
    assert files.interrupt_behind(RuntimeError("a bug of ours")) is None


class _FailsAsInterrupted:
    """Pickled, fails as torch's writer does once interrupted: a RuntimeError raised while a
    KeyboardInterrupt was handled."""

    def __reduce__(self):
        try:
            raise KeyboardInterrupt("a second Ctrl-C")
        except KeyboardInterrupt:
            raise RuntimeError("unexpected pos 107470528 vs 107470416") from None


def test_atomic_save_ends_in_the_interrupt_and_leaves_no_file(tmp_path):
    with pytest.raises(KeyboardInterrupt, match="a second Ctrl-C"):
        files.atomic_save({"x": _FailsAsInterrupted()}, tmp_path / "checkpoint_000000004.pt", "checkpoint")
    assert not list(tmp_path.iterdir())


def test_a_killed_saves_partial_files_are_removed_and_nothing_else(tmp_path):
    """SIGKILL during a save leaves its temporary file, as large as a checkpoint: the next run of
    the folder removes those of the folder's own names, and says so; other files stay."""
    ck = tmp_path / "ck"
    ck.mkdir()
    partial = [ck / ".checkpoint_000000012.pt.tmp4242", ck / ".model_best.pt.tmp4242"]
    kept = [ck / "checkpoint_000000008.pt", ck / ".weights.pt.tmp77", ck / "notes.txt"]
    for path in partial + kept:
        path.write_bytes(b"x" * 1000)
    weights_file.save_weights(torch.nn.Linear(2, 2), ck / "model_best.pt", {"val_accuracy": 0.5})
    kept.append(ck / "model_best.pt")
    warnings = []
    checkpoints.Checkpointer(ck, 0, DistContext(device=torch.device("cpu")), {}, warn=warnings.append)
    assert warnings == [f"Removed 2 partial files (2.0 kB) that a killed save left in {ck}: "
                        ".checkpoint_000000012.pt.tmp4242, .model_best.pt.tmp4242"]
    assert sorted(ck.iterdir()) == sorted(kept)
    checkpoints.Checkpointer(ck, 0, DistContext(device=torch.device("cpu")), {}, warn=warnings.append)
    assert len(warnings) == 1  # none left: no line


def test_an_earlier_hangs_flight_recorder_dumps_are_moved_where_the_next_hang_cannot_overwrite_them(tmp_path):
    """A requeued job that hangs again dumps NCCL's flight recorder under the same names: the
    run that holds the folder next moves the earlier dumps into a folder of their own (named
    after the newest dump's time, a new one each time), with their contents, and says where."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "checkpoint_000000008.pt").write_bytes(b"c")
    for attempt in (b"first hang", b"second hang"):
        for rank in (0, 1):
            dump = ck / f"nccl_trace_rank_{rank}"
            dump.write_bytes(attempt + bytes([rank]))
            os.utime(dump, (1_800_000_000, 1_800_000_000))  # both hangs' dumps in the same second
        warnings = []
        checkpoints.Checkpointer(ck, 0, DistContext(device=torch.device("cpu")), {}, warn=warnings.append)
        assert len(warnings) == 1 and "nccl_trace_rank_0, nccl_trace_rank_1" in warnings[0]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(1_800_000_000))
    first, second = ck / f"nccl_traces-{stamp}", ck / f"nccl_traces-{stamp}-2"
    assert warnings[0].endswith(f"read them with torchfrtrace {second}")
    assert sorted(path.name for path in ck.iterdir()) == ["checkpoint_000000008.pt", first.name, second.name]
    # Named so that torchfrtrace CK -p nccl_trace_rank_, which looks below CK too, reads a new hang's alone.
    assert [(first / f"rank_{r}").read_bytes() for r in (0, 1)] == [b"first hang\0", b"first hang\1"]
    assert (second / "rank_1").read_bytes() == b"second hang\1"
    assert not [path for path in ck.rglob("*") if "nccl_trace_rank_" in path.name]


def test_an_evaluation_in_a_training_runs_folder_touches_nothing_there(tmp_path, capsys):
    """--eval-only with the training's --checkpoint-dir and --resume=auto (the job scripts'
    flags): it holds no folder, so a save under way there (its temporary file) is left alone,
    and it starts no "new run" there."""
    assert run_main("train.py", *RUN, "--save-weights", tmp_path / "w.pt") == 0
    ck = tmp_path / "ck"
    ck.mkdir()
    writing = ck / ".checkpoint_000000012.pt.tmp4242"  # the training run's save under way
    writing.write_bytes(b"x" * 1000)
    capsys.readouterr()
    assert run_main("train.py", *RUN, "--eval-only", "--weights", tmp_path / "w.pt", "--checkpoint-dir", ck,
                    "--resume=auto") == 0
    out = capsys.readouterr().out
    assert writing.exists() and "Removed" not in out and "No checkpoint in" not in out
    assert "Evaluation: Loss=" in out


def test_model_best_that_does_not_fit_is_a_warning_and_keeps_the_earlier_weights(small_disk):
    """The file keeps the earlier best, which the warning says, and an epoch that beats those
    (not the one that did not fit) replaces them once there is room."""
    ck, warnings = small_disk(256) / "ck", []
    checkpointer = checkpoints.Checkpointer(ck, 0, DistContext(device=torch.device("cpu")), {}, warn=warnings.append)
    small, large = torch.nn.Linear(2, 2), torch.nn.Linear(512, 512)  # 1 MiB: does not fit
    checkpointer.keep_best(0.5, small, {"val_accuracy": 0.5, "epoch": 1})
    checkpointer.keep_best(0.7, large, {"val_accuracy": 0.7, "epoch": 2})
    [warning] = warnings
    assert warning.startswith(f"WARNING: cannot write model_best.pt {ck / 'model_best.pt'} (No space left on device")
    assert warning.endswith("; this epoch's weights, the best so far, are not kept (model_best.pt keeps the earlier "
                            "weights that validated at 0.5000), training goes on")
    checkpointer.keep_best(0.6, small, {"val_accuracy": 0.6, "epoch": 3})  # better than the file's
    assert weights_file.read_weights(ck / "model_best.pt").metadata["epoch"] == 3 and len(warnings) == 1


def test_no_claim_of_kept_checkpoints_when_there_are_none(small_disk, capsys):
    disk = small_disk(64)
    fill(disk, leave=4096)
    assert run_main("train.py", *RUN, "--checkpoint-dir", disk / "ck") == 1
    line = one_error(capsys.readouterr().err)
    assert line.endswith("; no checkpoint of this run is kept") and "previous" not in line


def test_save_weights_on_a_full_disk_is_rescued_elsewhere(small_disk, tmp_path, capsys, monkeypatch):
    disk = small_disk(64)
    fill(disk, leave=4096)
    rescue = tmp_path / "scratch"
    rescue.mkdir()
    monkeypatch.setenv("HOME", str(rescue))  # the first rescue folder
    assert run_main("train.py", *RUN, "--save-weights", disk / "w.pt") == 1
    line = one_error(capsys.readouterr().err)
    [saved] = rescue.glob("w-rescued-*.pt")
    assert line.startswith(f"error: cannot write --save-weights {disk / 'w.pt'} (No space left on device: needs about ")
    assert line.endswith(f"; the trained weights were written to {saved} instead: move them where they belong")
    state = torch.load(saved, weights_only=True)
    assert state["layers.6.weight"].shape == (100, 8)  # the trained model, loadable as any weights file
    assert not list(disk.glob("*w.pt*"))


def test_weights_rescued_or_written_beside_never_replace_a_file(tmp_path):
    """Runs that finish in the same second (an array job's tasks) each keep their own file:
    the time in the name is made unique, and no file is written over."""
    model = torch.nn.Linear(2, 2)
    first = weights_file.save_beside(model, tmp_path / "weights-rescued.pt", {}, "the weights")
    models = [torch.nn.Linear(2, 2) for _ in range(2)]
    written = [weights_file.save_beside(m, tmp_path / "weights-rescued.pt", {}, "the weights") for m in models]
    if all(p.stem.startswith(first.stem) for p in written):  # all three in the same second
        assert [p.name for p in written] == [first.name.replace(".pt", "-2.pt"), first.name.replace(".pt", "-3.pt")]
    assert len(set(tmp_path.iterdir())) == 3
    for m, path in zip((model, *models), (first, *written)):
        assert torch.equal(torch.load(path, weights_only=True)["weight"], m.weight)


def test_weights_are_rescued_to_the_home_folder_first(tmp_path, monkeypatch):
    """A Slurm job's $TMPDIR is often wiped when the job ends: home keeps the weights."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "scratch"))
    assert weights_file.rescue_folders()[:2] == [tmp_path / "home", tmp_path / "scratch"]


def test_save_weights_on_a_full_disk_names_the_final_checkpoint(small_disk, tmp_path, capsys):
    disk = small_disk(64)
    fill(disk, leave=4096)
    ck = tmp_path / "ck"
    assert run_main("train.py", *RUN, "--checkpoint-dir", ck, "--save-weights", disk / "w.pt") == 1
    line = one_error(capsys.readouterr().err)
    [final] = sorted(ck.glob("checkpoint_*.pt"))[-1:]
    assert line.endswith(f"; the trained model is in the final checkpoint {final} (--weights and predict.py read it "
                         "as a weights file)")


def test_resume_with_the_metrics_file_on_a_full_disk_is_one_line(small_disk, tmp_path, capsys):
    disk = small_disk(64)
    ck, metrics = tmp_path / "ck", disk / "m.jsonl"
    assert run_main("train.py", *RUN, "--epochs", "1", "--checkpoint-dir", ck, "--metrics-file", metrics) == 0
    metrics.write_text(metrics.read_text() + '{"epoch": 1, "run_id": "x", "cut')  # a half line to rewrite
    filler = fill(disk)
    capsys.readouterr()
    assert run_main("train.py", *RUN, "--checkpoint-dir", ck, "--metrics-file", metrics, "--resume") == 1
    line = one_error(capsys.readouterr().err)
    assert line.startswith(f"error: cannot write --metrics-file {metrics} (No space left on device: needs about ")
    filler.unlink()
    assert run_main("train.py", *RUN, "--checkpoint-dir", ck, "--metrics-file", metrics, "--resume") == 0
    assert [r["epoch"] for r in read_metrics(metrics)] == [1, 2]


@pytest.mark.parametrize("output", ["--tensorboard", "--profile-dir"])
def test_diagnostics_on_a_full_disk_are_a_warning_and_training_goes_on(small_disk, tmp_path, capsys, output):
    """TensorBoard events and profiler traces show how a run goes; a disk that cannot take them
    is one warning with the space free, and the run, its metrics and its weights go on."""
    pytest.importorskip("tensorboard") if output == "--tensorboard" else None
    disk = small_disk(64)
    fill(disk, leave=2048)  # the start-up probe fits, an epoch's events or a trace do not
    metrics = tmp_path / "m.jsonl"
    extra = ("--profile-skip", "1", "--profile-steps", "1") if output == "--profile-dir" else ()
    assert run_main("train.py", *RUN, output, disk / "out", *extra, "--metrics-file", metrics,
                    "--save-weights", tmp_path / "w.pt") == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Exception in thread" not in err  # nor from tensorboard's writer thread
    [warning] = [line for line in out.splitlines() if line.startswith("WARNING: cannot write")]
    assert "(No space left on device: needs more, " in warning and " kB free there); " in warning
    assert str(disk / "out") in warning
    assert [r["epoch"] for r in read_metrics(metrics)] == [1, 2] and (tmp_path / "w.pt").exists()
    assert not [p for p in (disk / "out").rglob("*") if p.name.startswith(".tmp-")]  # no half-written trace


def test_reports_on_a_full_disk_are_one_line_and_lose_nothing(small_disk, tmp_path, capsys):
    """tools/report.py --plot and benchmark.py --report's block (gpu_report.write): one line
    with the space free, exit status 1; the report file keeps its earlier blocks whole, and
    the new block is printed instead, so a GPU's minutes of measuring are not lost."""
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "m.jsonl"
    assert run_main("train.py", *RUN, "--metrics-file", metrics) == 0
    disk = small_disk(64)
    report_md = disk / "r.md"
    gpu_report.write(report_md, "# first block\n")
    fill(disk, leave=0)
    capsys.readouterr()
    assert report.main([str(metrics), "--plot", str(disk / "runs.png")]) == 1
    line = one_error(capsys.readouterr().err)
    assert line.startswith(f"report.py: error: cannot write --plot {disk / 'runs.png'} (No space left on device: ")
    assert not [p for p in disk.iterdir() if p.suffix == ".png"]
    block = "| figure | value |\n" * 2000
    with pytest.raises(ResourceProblem, match=r"^cannot write --report .*r\.md \(No space left on device: needs "
                                              r"about 38\.0 kB, 0\.0 kB free there\)$"):
        gpu_report.write(report_md, block)
    assert report_md.read_text() == "# first block\n" and block in capsys.readouterr().out


def test_an_image_cache_that_cannot_fit_fails_before_decoding(small_disk, tmp_path, capsys):
    images = write_image_folder(tmp_path / "images", classes=2, n_train=16, n_test=4, stray=False)
    disk = small_disk(32)
    args = ("--dataset", "folder", "--data-dir", images, "--epochs", "1", "--batch-size", "8", *FAST, *TINY_MODEL)
    assert run_main("train.py", *args, "--cache-dir", disk) == 1
    out, err = capsys.readouterr()
    line = one_error(err)
    needed = 40 * 32 * 32 * 3 + 9 * 40  # uint8 pixels of 40 RGB images of 32x32, their labels and .npy headers
    assert line.startswith(f"error: the image cache of 40 images needs {needed / 1e3:.1f} kB in {disk}/images-")
    assert line.endswith("is free there: free some space, or choose another --cache-dir")
    assert "Decoded" not in out
    assert not [p for p in disk.rglob("*") if p.is_file()]  # nothing half-written
    assert run_main("train.py", *args, "--cache-dir", tmp_path / "cache") == 0


def test_a_disk_that_fills_during_the_decode_is_one_line_not_a_bus_error(small_disk, tmp_path):
    """The space check passes, then the disk fills (another job writes): the preallocation
    fails in one line where a memory-mapped write would die of SIGBUS."""
    images = write_image_folder(tmp_path / "images", classes=2, n_train=16, n_test=4, stray=False)
    disk = small_disk(64)
    code = ("import sys; from engine import image_cache; image_cache.check_space = lambda *a: None; "
            "from engine.cli import run_cli; "
            f"run_cli(lambda: image_cache.prepare_folder({str(images)!r}, {str(disk)!r}, log=lambda _: None))")
    fill(disk, leave=8192)
    result = run([sys.executable, "-c", code], cwd=python_cmd("train.py")[1].parent)
    assert result.returncode == 1, result.stderr
    line = one_error(result.stderr)
    assert line.startswith(f"error: cannot write the image cache in {disk}/images-") and "No space left" in line
    assert not list(disk.glob("*/.*tmp*"))  # the failed build's folder is gone


def test_the_caches_notes_name_files_within_the_data_dir_as_this_run_gives_it(tmp_path, monkeypatch):
    """A cache built from the project folder (--data-dir images) and read by a run elsewhere
    (--data-dir /abs/images): the unreadable and ignored files are named where that run can find them."""
    monkeypatch.chdir(tmp_path)
    write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2)
    (tmp_path / "images" / "train" / "class_1" / "cut.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a whole jpeg")
    target = image_cache.prepare_folder("images", tmp_path / "cache", log=lambda _: None)
    for given in ("images", str(tmp_path / "images")):
        notes = "\n".join(image_cache.read_folder_cache(target, given).notes)
        assert f"\n  {given}/train/class_1/cut.jpg: " in notes, notes
        assert f"Ignored 2 files that are not images, e.g. {given}/train/class_0/notes.txt" in notes, notes
        assert image_cache.DATA_DIR_MARK not in notes
    assert "\n  images/train/class_1/cut.jpg: " in "\n".join(image_cache.read_folder_cache(target).notes)


def test_a_dead_builds_temporary_folder_is_removed_by_the_next_build(tmp_path):
    images = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, stray=False)
    root = image_cache.cache_root(images, tmp_path / "cache")
    dead = root / f".auto-0123.tmp-{socket.gethostname()}-999999999-abc"
    live = root / f".auto-0123.tmp-{socket.gethostname()}-{os.getpid()}-abc"  # a build under way
    deleting = root / ".auto-0042.deleting999999999"  # a removal of an outdated cache that was killed
    for folder in (dead, live, deleting):
        folder.mkdir(parents=True)
        (folder / "train_images.npy").write_bytes(b"\0" * 1000)
    image_cache.prepare_folder(images, tmp_path / "cache", log=lambda _: None)
    assert not dead.exists() and live.exists() and not deleting.exists()


# ---------------------------------------------------------------------------------------------
# Damaged caches and labels.

@pytest.mark.parametrize("damage", ["pixels", "labels", "meta.json", "truncated"])
def test_a_damaged_image_cache_is_rebuilt_never_used(tmp_path, damage):
    images = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, stray=False)
    said = []
    target = image_cache.prepare_folder(images, tmp_path / "cache", log=said.append)
    good = image_cache.read_folder_cache(target)
    pixels, labels = np.array(good.train[0]), np.array(good.train[1])
    if damage == "pixels":
        cached = np.load(target / "train_images.npy", mmap_mode="r+")
        cached[0] = 255 - cached[0]
        cached.flush()
    elif damage == "labels":
        np.save(target / "train_labels.npy", labels[::-1].copy())
    elif damage == "meta.json":
        (target / "meta.json").unlink()
    else:
        with open(target / "test_images.npy", "r+b") as f:
            f.truncate(200)
    said.clear()
    assert image_cache.prepare_folder(images, tmp_path / "cache", log=said.append) == target
    assert said[0].startswith(f"WARNING: the image cache {target} is damaged (") and said[0].endswith("rebuilding it")
    rebuilt = image_cache.read_folder_cache(target)
    assert np.array_equal(rebuilt.train[0], pixels) and np.array_equal(rebuilt.train[1], labels)
    said.clear()
    image_cache.prepare_folder(images, tmp_path / "cache", log=said.append)
    assert not said  # sound now: used as it is


def test_a_label_outside_the_classes_names_the_image():
    task.check_labels(np.array([0, 1, 2]), 3, "x")
    with pytest.raises(UserError, match=r"^CIFAR-100 training image 2 has the label 100, outside 0\.\.99 of its "
                                        r"100 classes \(2 such labels\)$"):
        task.check_labels(np.array([5, 0, 100, -1]), 100, "CIFAR-100 training")


def test_a_file_name_that_is_not_utf8_trains(tmp_path):
    images = write_image_folder(tmp_path / "images", classes=2, n_train=4, n_test=2, stray=False)
    first = sorted((images / "train" / "class_0").iterdir())[0]
    odd = os.fsdecode(bytes(first.parent) + b"/caf\xe9" + first.suffix.encode())
    os.rename(first, odd)
    result = run(python_cmd("train.py", "--dataset", "folder", "--data-dir", images, "--cache-dir", tmp_path / "c",
                            "--epochs", "1", "--batch-size", "4", *FAST, *TINY_MODEL), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # The name's bytes escaped as on disk (caf\xe9.png), not Python's surrogate (caf\udce9)
    assert "WARNING: 1 file name(s) are not UTF-8, e.g. " in result.stdout
    assert f"caf\\xe9{first.suffix}: read all the same" in result.stdout
    assert "Training complete" in result.stdout


# ---------------------------------------------------------------------------------------------
# One run per checkpoint folder.

def test_a_second_run_on_a_checkpoint_folder_is_refused_naming_the_first(tmp_path):
    ck = tmp_path / "ck"
    log = tmp_path / "first.log"
    job = python_cmd("train.py", *RUN, "--checkpoint-dir", ck, "--resume=auto")  # what the job scripts run, twice
    go = tmp_path / "go"
    first = start(job, tmp_path, log, env=clean_env(HOLD_AT=f"1:{go}"))  # held in its first step
    wait_held(go, first)
    second = run(job, cwd=tmp_path)
    assert second.returncode == 1
    line = one_error(second.stderr)
    assert line.startswith(f"error: --checkpoint-dir {ck} is in use by another run (pid {first.pid} on "
                           f"{socket.gethostname()}, since ")
    assert "Training" not in second.stdout
    first.send_signal(signal.SIGTERM)
    go.touch()
    assert first.wait(60) == EXIT_STOPPED
    resumed = run(job, cwd=tmp_path)
    assert resumed.returncode == 0 and "Resuming from" in resumed.stdout  # the kernel released the lock


def test_a_lock_is_released_with_its_process_and_leaves_no_empty_folder(tmp_path):
    ck = tmp_path / "new" / "ck"
    with FolderLock(ck):
        assert json.loads((ck / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(ResourceProblem, match="is in use by another run"):
            FolderLock(ck).__enter__()  # another open file: flock conflicts within a process too
    assert not ck.exists()  # nothing was written in it
    with FolderLock(ck):
        (ck / "checkpoint_000000001.pt").write_bytes(b"x")
    assert [p.name for p in ck.iterdir()] == ["checkpoint_000000001.pt"]


def test_without_flock_the_lock_file_is_a_lease(tmp_path, monkeypatch):
    def no_flock(*args):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(folder_lock.fcntl, "flock", no_flock)
    me = {"job": "77", "host": socket.gethostname(), "pid": os.getpid()}
    assert not lease_is_free({**me, "job": "76", "pid": os.getppid()}, 10, me)  # a live process of another job
    assert lease_is_free({**me, "pid": 999999999, "job": "76"}, 10, me)  # its process is gone
    assert lease_is_free({**me, "host": "elsewhere"}, 10, me)  # a requeue of this very job
    assert lease_is_free({**me, "pid": 999999999}, 10, me)  # requeued on the same node
    assert not lease_is_free({**me, "pid": os.getppid()}, 10, me)  # this job's other run, alive: two in one allocation
    assert not lease_is_free({**me, "host": "elsewhere", "job": "76"}, 10, me)
    assert lease_is_free({**me, "host": "elsewhere", "job": "76"}, folder_lock.LEASE_STALE_S + 1, me)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".lock").write_text(json.dumps({"job": "5", "host": "node9", "pid": 1, "since": "2026-11-25 10:00:00"}))
    with pytest.raises(ResourceProblem, match=r"\(Slurm job 5, pid 1 on node9, since 2026-11-25 10:00:00\)"):
        FolderLock(ck).__enter__()
    old = os.stat(ck / ".lock").st_mtime - folder_lock.LEASE_STALE_S - 1
    os.utime(ck / ".lock", (old, old))
    with FolderLock(ck):  # a stale lease is taken over
        assert json.loads((ck / ".lock").read_text())["pid"] == os.getpid()


# ---------------------------------------------------------------------------------------------
# Metrics, signals.

def test_a_half_written_metrics_line_is_dropped_and_its_epoch_written_again(tmp_path):
    path = tmp_path / "m.jsonl"
    records = [{"run_id": "r", "epoch": 1}, {"run_id": "r", "epoch": 2}]
    path.write_text(json.dumps(records[0]) + "\n" + json.dumps(records[1])[:15])  # the node died mid-line
    [warning] = reconcile_metrics(path, "r", records)
    assert warning.startswith(f"WARNING: --metrics-file {path} ends in a half-written line")
    assert [json.loads(line) for line in path.read_text().splitlines()] == records
    assert reconcile_metrics(path, "r", records) == []


def _opened(path, times, timeout_s=20.0):
    """Wait until this process holds ``path`` open ``times`` times (Linux's /proc)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                held += os.readlink(f"/proc/self/fd/{fd}") == str(path)
            except OSError:
                continue
        if held >= times:
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} was not opened {times} times")


def test_a_shared_metrics_file_loses_no_line_to_a_resumes_rewrite(tmp_path):
    """Two jobs may share --metrics-file (the job scripts' example). A resume rewrites it
    (reconcile_metrics): an append waiting meanwhile goes to the rewritten file, not the one
    it replaced, and the rewrite waits for an append under way."""
    path = tmp_path / "m.jsonl"
    mine = [{"run_id": "r", "epoch": 1}, {"run_id": "r", "epoch": 2}]
    path.write_text(json.dumps(mine[0]) + "\n" + json.dumps({"run_id": "r", "epoch": 3}) + "\n")
    other = RunLogger(True, path)
    with locked_metrics(path):  # the resume holds the file, and replaces it as reconcile_metrics does
        appender = threading.Thread(target=other.record, args=({"run_id": "other", "epoch": 1},))
        appender.start()
        _opened(path, 2)  # the appender has the file open too, and waits for the lock
        tmp = tmp_path / ".m.jsonl.tmp"
        tmp.write_text(json.dumps(mine[0]) + "\n")
        os.replace(tmp, path)
    appender.join(20)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [mine[0], {"run_id": "other", "epoch": 1}]
    with locked_metrics(path) as f:  # the other run appends; the resume waits for it
        resume = threading.Thread(target=reconcile_metrics, args=(path, "r", mine))
        resume.start()
        resume.join(0.5)
        assert resume.is_alive()
        f.write((json.dumps({"run_id": "other", "epoch": 2}) + "\n").encode())
    resume.join(20)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        mine[0], {"run_id": "other", "epoch": 1}, {"run_id": "other", "epoch": 2}, mine[1]]
    with locked_metrics(path):  # a holder that never lets go (a stopped run): the append goes on unlocked
        with locked_metrics(path, wait_s=0.2) as f:
            f.write(b'{"run_id": "third"}\n')
    assert json.loads(path.read_text().splitlines()[-1]) == {"run_id": "third"}


def test_a_copied_checkpoint_folder_goes_on_as_a_run_of_its_own(tmp_path, capsys):
    """A checkpoint folder copied to try something else, both resumed into one --metrics-file:
    the copy's resume drops no line of the original's (it used to share its run ID, and dropped
    the original's later epochs as if they were to run again). A folder moved is the same run."""
    metrics, original, copy = tmp_path / "m.jsonl", tmp_path / "a", tmp_path / "b"
    assert run_main("train.py", *RUN, "--epochs", "1", "--checkpoint-dir", original, "--metrics-file", metrics) == 0
    shutil.copytree(original, copy)
    assert run_main("train.py", *RUN, "--epochs", "3", "--checkpoint-dir", original, "--metrics-file", metrics,
                    "--resume") == 0
    capsys.readouterr()
    assert run_main("train.py", *RUN, "--epochs", "2", "--checkpoint-dir", copy, "--metrics-file", metrics,
                    "--resume") == 0
    [note] = [line for line in capsys.readouterr().out.splitlines() if "is a copy of" in line]
    runs = {}
    for record in read_metrics(metrics):
        runs.setdefault(record["run_id"], []).append(record["epoch"])
    [ours] = [run_id for run_id in runs if f"apart from run {run_id} there" in note]
    [theirs] = [run_id for run_id in runs if run_id != ours]
    assert runs == {ours: [1, 2, 3], theirs: [1, 2]}
    assert note.startswith(f"Note: {copy} is a copy of {original.resolve()}: it goes on as run {theirs}")
    moved = tmp_path / "moved"
    original.rename(moved)
    assert run_main("train.py", *RUN, "--epochs", "4", "--checkpoint-dir", moved, "--metrics-file", metrics,
                    "--resume") == 0
    assert "is a copy of" not in capsys.readouterr().out
    assert [r["epoch"] for r in read_metrics(metrics) if r["run_id"] == ours] == [1, 2, 3, 4]
    # A copy whose original was archived after the copy was made: still a copy, the original's
    # lines kept; the archived original (the same inode) goes on as the original.
    later, archive = tmp_path / "later", tmp_path / "archive"
    shutil.copytree(moved, later)
    moved.rename(archive)
    assert run_main("train.py", *RUN, "--epochs", "5", "--checkpoint-dir", later, "--metrics-file", metrics,
                    "--resume") == 0
    assert "is a copy of" in capsys.readouterr().out
    assert run_main("train.py", *RUN, "--epochs", "5", "--checkpoint-dir", archive, "--metrics-file", metrics,
                    "--resume") == 0
    assert "is a copy of" not in capsys.readouterr().out
    # Moved to another file system (a new path and inode): taken for a copy, which loses no line.
    far = tmp_path / "far"
    shutil.copytree(archive, far)
    shutil.rmtree(archive)
    assert run_main("train.py", *RUN, "--epochs", "6", "--checkpoint-dir", far, "--metrics-file", metrics,
                    "--resume") == 0
    runs = {}
    for record in read_metrics(metrics):
        runs.setdefault(record["run_id"], []).append(record["epoch"])
    assert runs.pop(ours) == [1, 2, 3, 4, 5] and runs.pop(theirs) == [1, 2]
    assert sorted(runs.values()) == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]  # the later copy's, the far one's
    assert checkpoints.forked_run_id(None, copy, ours) is None  # a checkpoint from before the folder was recorded


def test_a_copied_folder_with_its_own_metrics_file_holds_each_epoch_once(tmp_path, capsys):
    """--metrics-file inside the checkpoint folder is copied with it: the copy's file holds the
    copy's epochs, each once, under its new ID, and the original's file is left as it was."""
    original, copy = tmp_path / "a", tmp_path / "b"
    assert run_main("train.py", *RUN, "--epochs", "1", "--checkpoint-dir", original, "--metrics-file",
                    original / "m.jsonl") == 0
    shutil.copytree(original, copy)
    kept = (original / "m.jsonl").read_bytes()
    capsys.readouterr()
    assert run_main("train.py", *RUN, "--epochs", "2", "--checkpoint-dir", copy, "--metrics-file", copy / "m.jsonl",
                    "--resume") == 0
    assert "(its --metrics-file, copied with it, goes on under the new ID)" in capsys.readouterr().out
    [theirs] = {r["run_id"] for r in read_metrics(original / "m.jsonl")}
    records = read_metrics(copy / "m.jsonl")
    assert [r["epoch"] for r in records] == [1, 2] and {r["run_id"] for r in records} != {theirs}
    assert len({r["run_id"] for r in records}) == 1 and (original / "m.jsonl").read_bytes() == kept


def test_a_metrics_file_counts_as_copied_only_where_the_original_has_its_own(tmp_path):
    """train_utils.copied_with: the copy's lines replace the original's only in a file that was
    copied, never in the original's own (a copy that is a parent of the original's folder holds
    it: a review found the original's lines dropped from it)."""
    parent, original = tmp_path / "exp", tmp_path / "exp" / "run1"
    original.mkdir(parents=True)
    (parent / "m.jsonl").write_text("")  # shared: the original's run writes it too
    assert not tu.copied_with(parent / "m.jsonl", parent, original)
    (original / "m.jsonl").write_text("")
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert tu.copied_with(copy / "m.jsonl", copy, original)
    assert not tu.copied_with(original / "m.jsonl", parent, original)  # the original's own file, seen from above
    assert not tu.copied_with(tmp_path / "m.jsonl", copy, original)  # outside the copy


def test_a_folder_seen_under_another_path_or_device_number_is_the_same_run(tmp_path):
    """forked_run_id: a link to the folder, or the folder's device numbered otherwise (a
    network file system mounted on another node), is the same folder, not a copy."""
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / f"{checkpoints.CHECKPOINT_PREFIX}0001.pt").write_bytes(b"")
    (tmp_path / "link").symlink_to(folder)
    written = checkpoints.folder_identity(folder)
    assert written["path"] == str(folder.resolve())
    assert checkpoints.forked_run_id(written, tmp_path / "link", "r") is None
    elsewhere = {**written, "path": str(tmp_path / "link"), "device": written["device"] + 1}  # another node's view
    assert checkpoints.forked_run_id(elsewhere, folder, "r") is None
    copy = tmp_path / "b"
    shutil.copytree(folder, copy)
    fork = checkpoints.forked_run_id(written, copy, "r")
    assert fork and fork == checkpoints.forked_run_id(written, copy, "r")
    assert checkpoints.forked_run_id({**written, "device": written["device"] + 1}, copy, "r") == fork
    shutil.rmtree(folder)  # the original gone: a copy all the same (taken for the same run, it would drop lines)
    assert checkpoints.forked_run_id(written, copy, "r") == fork
    other = tmp_path / "c"
    copy.rename(other)  # another path: another ID, so that no two folders share one
    assert checkpoints.forked_run_id(written, other, "r") not in (None, fork)


def test_a_resume_on_another_loader_says_so(tmp_path, capsys):
    """--loader auto may choose another loader when a requeued job lands on another GPU: the run
    goes on, and the start-up block says why it does not repeat the uninterrupted run exactly."""
    ck = tmp_path / "ck"
    assert run_main("train.py", *RUN, "--epochs", "1", "--checkpoint-dir", ck, "--loader", "device") == 0
    capsys.readouterr()
    assert run_main("train.py", *RUN, "--checkpoint-dir", ck, "--resume", "--loader", "torchvision") == 0
    out = capsys.readouterr().out
    assert ("Note: the run trained on --loader device before, now torchvision: the same images in the same order, "
            "with other random augmentation draws") in out
    # Extended from 1 to 2 epochs: the first schedule's warm-up Note (the whole of this 2-epoch run) is not true of it.
    assert "Extending the run from 1 to 2 epochs" in out and "warm-up epochs are" not in out
    assert run_main("train.py", *RUN, "--epochs", "3", "--checkpoint-dir", ck, "--resume",
                    "--loader", "torchvision") == 0
    assert "Note: the run trained on --loader" not in capsys.readouterr().out


def test_a_new_run_appending_to_a_cut_metrics_file_starts_a_line_of_its_own(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"epoch": 1, "run_id": "old"}\n{"epoch": 2, "ru')
    assert run_main("train.py", *RUN, "--epochs", "1", "--metrics-file", path) == 0
    lines = path.read_text().splitlines()
    assert lines[1] == '{"epoch": 2, "ru' and json.loads(lines[2])["epoch"] == 1


def test_a_metrics_file_that_names_another_file_is_refused_unchanged(tmp_path, capsys):
    """--metrics-file appends: a script, a weights file or notes typed in its place are refused
    before training, unchanged; an empty file, a metrics file and the half-written first line
    of a killed run are appended to."""
    code, weights = tmp_path / "my_net.py", tmp_path / "w.pt"
    code.write_text("\nimport torch.nn as nn\n")  # a blank first line: the first line that is not is looked at
    torch.save({"w": torch.zeros(2)}, weights)
    for path in (code, weights):
        before = path.read_bytes()
        assert run_main("train.py", *RUN, "--epochs", "1", "--metrics-file", path) == 2
        out, err = capsys.readouterr()
        assert error_lines(err) == [f"error: --metrics-file {path} exists and is not a file of JSON lines (another "
                                    "file's name?): its lines would be appended to it; give a new file name, or a "
                                    "metrics file of an earlier run"]
        assert path.read_bytes() == before and "Epoch 1/" not in out
    for first in ("", '{"epoch": 1, "ru'):
        path = tmp_path / "m.jsonl"
        path.write_text(first)
        assert files.check_json_lines(path, "--metrics-file") is None


def test_a_repeated_stop_signal_cannot_turn_exit_75_into_143(tmp_path):
    class Ctx:
        is_main = True

    stop = stopping.StopRequests(Ctx())
    before = {sig: signal.getsignal(sig) for sig in stop.SIGNALS}
    try:
        with stop:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # a second one while tearing down: this test goes on
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]  # Ctrl-C still quits
        # Not SIG_IGN, which a process started now would inherit: it must still die of SIGTERM.
        child = subprocess.Popen(["sleep", "30"])
        child.terminate()
        assert child.wait(10) == -signal.SIGTERM
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    with stopping.StopRequests(Ctx()):
        pass
    assert {sig: signal.getsignal(sig) for sig in stop.SIGNALS} == before  # no stop: the handlers as they were


STOPPED_THEN_SIGNALLED = """
import os, signal, sys
sys.path.insert(0, os.getcwd())
from engine.cli import run_cli
from engine.stopping import STOP_SIGNAL, StopRequests

class Ctx:
    is_main = True
    launcher_pid = None


class SignalledWhileFreed:
    # Freed with the modules, after Python gave its signals their default actions back: a repeated
    # stop signal that comes while PyTorch's destructors run (seconds, in a training run).
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=getattr(signal, sys.argv[1])):
        kill(pid, sig)


freed = SignalledWhileFreed()


def main():
    stop = StopRequests(Ctx())
    with stop:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        raise stop.stopped(STOP_SIGNAL, "after step 3 of epoch 1", "ck/checkpoint_000000003.pt")


run_cli(main)
"""


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGUSR1"])
def test_a_stop_signal_repeated_while_the_process_shuts_down_keeps_exit_75(tmp_path, name):
    """The stop line is printed and its checkpoint written; the same signal again while the
    interpreter frees its modules (docs/checkpoints.md: "a second SIGTERM while a stopped run
    exits") killed the process with it (130, 143), which reads as a run quit without a checkpoint."""
    result = run([sys.executable, "-c", STOPPED_THEN_SIGNALLED, name], cwd=python_cmd("train.py")[1].parent)
    assert (result.returncode, result.stdout) == (EXIT_STOPPED, f"Stopped after step 3 of epoch 1 ({name}); "
                                                  "checkpoint ck/checkpoint_000000003.pt: continue with --resume\n")


def test_a_second_ctrl_c_names_what_is_kept_and_after_the_stop_checkpoint_changes_nothing(tmp_path):
    class Ctx:
        is_main = True

    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt, match=f"^a second Ctrl-C: no checkpoint was written yet "
                                                    f"\\(--checkpoint-dir {tmp_path}\\)$"):
            with stopping.StopRequests(Ctx(), checkpoint_dir=tmp_path):
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)  # before any checkpoint: quits at once, and says so
        (tmp_path / "checkpoint_000000008.pt").write_bytes(b"")
        stop = stopping.StopRequests(Ctx(), checkpoint_dir=tmp_path)
        assert stop.what_is_kept() == f"nothing saved since {tmp_path / 'checkpoint_000000008.pt'}"
        with pytest.raises(TrainingStopped):
            with stop:
                os.kill(os.getpid(), signal.SIGINT)
                raise stop.stopped(stopping.STOP_SIGNAL, "after step 8 of epoch 1", tmp_path / "checkpoint_x.pt")
        os.kill(os.getpid(), signal.SIGINT)  # 0.3 s later, while exiting with status 75: nothing happens
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_stop_signal_while_a_resume_is_prepared_stops_after_its_first_step(tmp_path):
    """scancel (SIGTERM) after the start-up block, which promises a checkpoint on a stop request,
    but before the loop (here as the resumed model is first read: tests/tiny_net.py's
    SIGNAL_AT_SAVE) killed the run: exit 143, no checkpoint, and not even the lines it had
    printed, which were still buffered."""
    first = run(python_cmd("train.py", *RUN, "--epochs", "1", "--checkpoint-dir", "ck"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = run(python_cmd("train.py", *RUN, "--checkpoint-dir", "ck", "--resume"), cwd=tmp_path,
                  env=clean_env(SIGNAL_AT_SAVE="SIGTERM"))
    assert resumed.returncode == EXIT_STOPPED, resumed.stdout + resumed.stderr
    assert resumed.stdout.endswith("Stopped after step 1 of epoch 2 (SIGTERM); checkpoint "
                                   "ck/checkpoint_000000003.pt: continue with --resume\n"), resumed.stdout
    assert "Resuming from ck/checkpoint_000000002.pt" in resumed.stdout


@pytest.mark.parametrize("launcher", ["train.py", "torchrun"])
def test_a_stop_request_before_training_starts_stops_it_after_its_first_step(tmp_path, launcher):
    """A SIGUSR1 (scancel --signal=USR1 reaches every process of a job step) while the run is
    set up (here as the model is built: tests/tiny_net.py's SIGNAL_AT_BUILD; the imports and the
    data's read are the same) killed it with SIGUSR1's default action: no checkpoint, and in a
    job script status 138, which ended the job instead of requeueing it. Under torchrun the
    process group's threads are started by then. An evaluation still ends at once."""
    # tools/torchrun.py, as the job scripts run it, passes the ranks' status 75 on (torchrun reports a crash).
    cmd = python_cmd("train.py", *RUN, "--checkpoint-dir", "ck") if launcher == "train.py" else \
        python_cmd("tools/torchrun.py", "--standalone", "--nproc_per_node=2", REPO / "train_ddp.py", *RUN,
                   "--checkpoint-dir", "ck")
    result = run(cmd, cwd=tmp_path, env=clean_env(SIGNAL_AT_BUILD="SIGUSR1"))
    assert result.returncode == EXIT_STOPPED, result.stdout + result.stderr
    step = 1 if launcher == "train.py" else 2  # the ranks agree on a request one step after it was seen
    assert result.stdout.endswith(f"Stopped after step {step} of epoch 1 (SIGUSR1); checkpoint "
                                  f"ck/checkpoint_00000000{step}.pt: continue with --resume\n"), result.stdout
    if launcher == "train.py":
        evaluation = run(python_cmd("train.py", *RUN, "--weights", "ck/checkpoint_000000001.pt", "--eval-only"),
                         cwd=tmp_path, env=clean_env(SIGNAL_AT_BUILD="SIGUSR1"))
        assert evaluation.returncode == -signal.SIGUSR1, evaluation.stdout + evaluation.stderr


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_stop_request_to_the_whole_job_step_spares_the_loaders_processes(tmp_path, start_method):
    """scancel --signal=USR1 signals every process of the job step: the DataLoader's workers,
    and under forkserver (Python 3.14's default start method; set here by a sitecustomize) the
    forkserver and multiprocessing's resource tracker, which died of it. The run still
    stopped (exit 75), but with a screen of resource-tracker tracebacks after its line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import multiprocessing\nmultiprocessing.set_start_method({start_method!r})\n")
    data = write_image_folder(tmp_path / "data", n_train=12, n_test=4)
    go, log = tmp_path / "go", tmp_path / "run.log"
    cmd = python_cmd("train.py", "--dataset", "folder", "--data-dir", data, "--loader", "torchvision",
                     "--num-workers", "2", "--epochs", "1", "--batch-size", "4", "--cache-dir", tmp_path / "cache",
                     *TINY_MODEL)
    process = start(cmd, tmp_path, log, env=clean_env(HOLD_AT=f"2:{go}", PYTHONPATH=site))
    wait_held(go, process)  # the workers are running, and so are the forkserver and the resource tracker
    os.killpg(process.pid, signal.SIGUSR1)
    go.touch()
    assert process.wait(120) == EXIT_STOPPED, log.read_text()
    output = log.read_text()
    assert output.endswith("Stopped after step 2 of epoch 1 (SIGUSR1); nothing saved (no --checkpoint-dir)\n"), output
    assert "Traceback" not in output and "died unexpectedly" not in output, output


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stop_after_the_last_step_waits_for_the_final_weights(tmp_path, name):
    """Ctrl-C or scancel while the summary is printed and --save-weights written (here: as the
    weights are read to be saved) came after the last step: the run is complete, the weights
    are written, and it ends with 0, saying so. It ended with no weights and 130 (or -15)."""
    weights = tmp_path / "w.pt"
    result = run(python_cmd("train.py", *RUN, "--save-weights", weights), cwd=tmp_path,
                 env=clean_env(SIGNAL_AT_SAVE=name))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"({name} came after the last step: the run is complete)" in result.stdout
    assert "Interrupted" not in result.stderr and "Traceback" not in result.stderr
    assert "layers.0.weight" in torch.load(weights, weights_only=True)  # written whole


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_stop_file_that_names_the_users_own_file_is_refused_and_kept(tmp_path, kind):
    """--stop-file naming a file with data in it (or a folder): the run stopped after its first
    step and deleted the file, as if it were its stop request. Refused at start, kept; an empty
    file (touch, a request made before the start) stops the run after its first step, removed."""
    own = tmp_path / "notes.txt"
    if kind == "file":
        own.write_text("my notes\n")
    else:
        own.mkdir()
    result = run(python_cmd("train.py", *RUN, "--stop-file", own), cwd=tmp_path)
    assert result.returncode == 2 and one_error(result.stderr) == ((
        f"error: --stop-file {own} exists and is not an empty file: the run would take it for a stop request after "
        "its first step; name a path of its own (a stop is requested with: touch PATH)") if kind == "file" else (
        f"error: --stop-file {own} is a folder: name a file of its own, which need not exist (a stop is requested "
        "with: touch PATH)"))
    assert (own.read_text() == "my notes\n") if kind == "file" else own.is_dir()
    request = tmp_path / "STOP"
    request.touch()
    stopped = run(python_cmd("train.py", *RUN, "--stop-file", request), cwd=tmp_path)
    assert stopped.returncode == 0 and "Stopped after step 1 of epoch 1 (--stop-file" in stopped.stdout
    assert not request.exists()


def test_a_run_stopped_after_an_epochs_last_step_checkpoints_that_epochs_end_when_resumed(tmp_path):
    """The resumed run trains no step, evaluates the epoch and saves it: a checkpoint at the same
    optimizer step as the stopped one, which it replaces. It was taken for the stopped one and not
    written, so each later --resume evaluated the epoch again and logged it once more."""
    request = tmp_path / "STOP"
    request.touch()
    one_step = (*RUN, "--epochs", "1", "--limit-batches", "1", "--checkpoint-dir", "ck", "--metrics-file", "m.jsonl")
    stopped = run(python_cmd("train.py", *one_step, "--stop-file", request), cwd=tmp_path)
    assert stopped.returncode == 0 and "Stopped after step 1 of epoch 1 (--stop-file" in stopped.stdout
    resumed = run(python_cmd("train.py", *one_step, "--resume"), cwd=tmp_path)
    assert resumed.returncode == 0 and "Training complete" in resumed.stdout, resumed.stderr
    [checkpoint] = (tmp_path / "ck").glob("checkpoint_*.pt")
    state = torch.load(checkpoint, weights_only=False)["state"]
    assert (state["epoch"], state["step"], len(state["records"])) == (2, 0, 1)
    again = run(python_cmd("train.py", *one_step, "--resume"), cwd=tmp_path)
    assert again.returncode == 0 and "is complete (epoch 1): nothing to train" in again.stdout
    assert "Evaluation after epoch 1" not in again.stdout and "Epoch 1/1:" not in again.stdout
    assert [r["epoch"] for r in read_metrics(tmp_path / "m.jsonl")] == [1]


@pytest.mark.parametrize("loader", ["device", "torchvision"])
def test_a_resume_after_an_epochs_last_step_trains_the_next_epoch_whole(tmp_path, loader):
    """Nothing of the stopped epoch is left to draw, so nothing is skipped: a skip asked of the
    DataLoader (0 workers start nothing) once carried over and cut the next epoch's batches. The
    resumed epoch's record is the uninterrupted one's, its LR too: that of the epoch's last step,
    which the stopped run trained (the resumed run's optimizer holds the next step's)."""
    common = (*RUN, "--limit-batches", "1", "--loader", loader, "--checkpoint-dir")
    whole = run(python_cmd("train.py", *common, "whole", "--metrics-file", "whole.jsonl"), cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    request = tmp_path / "STOP"
    request.touch()
    stopped = run(python_cmd("train.py", *common, "ck", "--metrics-file", "m.jsonl", "--stop-file", request),
                  cwd=tmp_path)
    assert "Stopped after step 1 of epoch 1 (--stop-file" in stopped.stdout
    resumed = run(python_cmd("train.py", *common, "ck", "--metrics-file", "m.jsonl", "--resume"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    compared = ("epoch", "train_loss", "val_loss", "val_accuracy", "train_images", "lr")
    assert [[r[k] for k in compared] for r in read_metrics(tmp_path / "m.jsonl")] == [
        [r[k] for k in compared] for r in read_metrics(tmp_path / "whole.jsonl")]


def test_a_stop_file_given_data_while_the_run_trains_is_not_removed(tmp_path):
    """A stop requested by writing to the file (echo stop > PATH): the run stops on it and
    leaves it, as it holds data; only an empty request is removed."""
    class Ctx:
        is_main = True

    request = tmp_path / "STOP"
    request.write_text("stop\n")
    stop = stopping.StopRequests(Ctx(), request)
    assert isinstance(stop.stopped(stopping.STOP_FILE, "after step 3 of epoch 1", None), TrainingStopped)
    assert request.read_text() == "stop\n"
    request.write_text("")
    stop.stopped(stopping.STOP_FILE, "after step 3 of epoch 1", None)
    assert not request.exists()
