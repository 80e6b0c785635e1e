"""Data never runs code: a pickle planted in any CIFAR file position (what anyone who can write
to a shared data folder could do) is refused by name before anything in it is constructed,
under one and two processes; a file of the official size must have the official md5."""

import os
import pickle

import pytest

from conftest import REPO, TINY_MODEL, error_lines, run, run_main, torchrun_cmd, write_cifar10, write_cifar100
from engine import data_formats, task

POSITIONS = [("cifar100", "cifar-100-python", "train"), ("cifar100", "cifar-100-python", "test"),
             ("cifar100", "cifar-100-python", "meta"), ("cifar10", "cifar-10-batches-py", "data_batch_3"),
             ("cifar10", "cifar-10-batches-py", "test_batch"), ("cifar10", "cifar-10-batches-py", "batches.meta")]


class Planted:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path, marker):
    """Replace the file at ``path`` with a pickle that looks like CIFAR's but runs a command."""
    with open(path, "wb") as f:
        pickle.dump({"data": Planted(marker), "labels": [0], "fine_labels": [0]}, f, protocol=2)


def write(dataset, root):
    return (write_cifar100 if dataset == "cifar100" else write_cifar10)(root)


@pytest.mark.parametrize("dataset, folder, name", POSITIONS)
def test_a_planted_pickle_runs_nothing_and_is_one_line(tmp_path, capsys, dataset, folder, name):
    root = write(dataset, tmp_path / "data")
    marker = tmp_path / "ran"
    plant(root / folder / name, marker)
    status = run_main("train.py", "--dataset", dataset, "--data-dir", root, "--no-download", "--epochs", "1",
                      *TINY_MODEL)
    assert status == 1 and not marker.exists()
    assert error_lines(capsys.readouterr().err) == [
        f"error: {root / folder / name} holds a pickle that would run code (refused global posix.system), not CIFAR "
        "data: refused, nothing in it was run; replace it with the official file"]


def test_a_planted_pickle_is_one_line_under_two_processes(tmp_path):
    root = write_cifar100(tmp_path / "data")
    marker = tmp_path / "ran"
    plant(root / "cifar-100-python" / "test", marker)
    result = run(torchrun_cmd(2, "train_ddp.py", "--data-dir", root, "--no-download", "--epochs", "1",
                              "--batch-size", "8", *TINY_MODEL), cwd=tmp_path)
    assert result.returncode == 1 and not marker.exists()
    lines = error_lines(result.stdout + result.stderr)
    assert len(lines) == 1 and "cifar-100-python/test holds a pickle that would run code" in lines[0]
    frames = [line for line in result.stderr.splitlines() if line.strip().startswith('File "')]
    assert not any(str(REPO) in frame for frame in frames)  # torchrun's own report of the exit only


def test_the_demo_data_and_official_style_pickles_still_load(tmp_path):
    root = write_cifar10(tmp_path / "data")
    images, labels = data_formats.read_split(root, "train", task.DATASETS["cifar10"])
    assert images.shape == (50, 32, 32, 3) and labels.shape == (50,)
    # The official files are Python 2 pickles of numpy 1 arrays (numpy.core.multiarray), read as latin-1.
    assert data_formats.SafeUnpickler.find_class(None, "numpy.core.multiarray", "_reconstruct") is not None
    with pytest.raises(pickle.UnpicklingError, match="refused global builtins.eval"):
        data_formats.SafeUnpickler.find_class(None, "builtins", "eval")


def test_a_file_of_the_official_size_must_have_its_md5(tmp_path, capsys):
    root = write_cifar10(tmp_path / "data")
    official = root / "cifar-10-batches-py" / "test_batch"
    with open(official, "wb") as f:  # 10,000 images' worth of bytes: as large as the official file
        f.truncate(10_000 * 3072 + 1000)
    assert run_main("dataset_utils.py", "--dataset", "cifar10", "--data-dir", root) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: {official} has the official file's size but not its md5 (")
    assert "official 40351d587109b95175f43aff81a1287e): damaged or altered; delete it and fetch again" in line
