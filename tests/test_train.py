"""train.py end to end, as users run it: output, metrics file, reproducibility, early
stopping, and bad input (one line, exit 2, nothing lost)."""

import pytest
import torch

from conftest import FAST, error_lines, python_cmd, read_metrics, run, run_main, write_cifar100
from model import WideResNet

REQUIRED = {"epoch", "train_loss", "val_loss", "val_accuracy", "epoch_time_s", "images_per_sec", "lr", "world_size"}


@pytest.fixture
def cifar_dir(tmp_path):
    """Small enough for a few seconds of CPU training: 4 steps of 8 images, 20 test images."""
    return write_cifar100(tmp_path / "data", n_train=32, n_test=20)


def train(tmp_path, data_dir, *args, env=None):
    return run(python_cmd("train.py", "--data-dir", data_dir, *FAST, *args), cwd=tmp_path, env=env)


def test_training_run_prints_writes_metrics_and_weights(tmp_path, cifar_dir):
    metrics, weights = tmp_path / "m.jsonl", tmp_path / "out" / "final.pt"
    result = train(tmp_path, cifar_dir, "--epochs", "2", "--batch-size", "8", "--base-lr", "0.05",
                   "--metrics-file", metrics, "--save-weights", weights)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Batch Size: 8 (8 per process x 1 CPU processes, 1 node(s))" in out
    assert "32 training / 20 test images, 4 steps per epoch" in out
    assert out.count("Epoch 1/2: Time=") == 1 and "Epoch 2/2: Time=" in out
    assert "Training complete. Final Accuracy:" in out and "Total Time:" in out
    records = read_metrics(metrics)
    assert [r["epoch"] for r in records] == [1, 2]
    for record in records:
        assert REQUIRED <= record.keys()
        assert record["train_images"] == 32 and record["val_samples"] == 20 and record["world_size"] == 1
        assert record["images_per_sec"] == pytest.approx(32 / record["epoch_time_s"])
    assert records[0]["lr"] == pytest.approx(0.05 * 4 / 8)  # last step of epoch 1 of a 2-epoch warm-up
    model = WideResNet(num_classes=100)
    model.load_state_dict(torch.load(weights, weights_only=True), strict=True)


def test_same_seed_same_run_and_another_seed_differs(tmp_path, cifar_dir):
    def losses(seed, name):
        result = train(tmp_path, cifar_dir, "--epochs", "1", "--batch-size", "8", "--limit-batches", "2", "--seed", seed,
                       "--metrics-file", tmp_path / name)
        assert result.returncode == 0, result.stderr
        record = read_metrics(tmp_path / name)[0]
        return record["train_loss"], record["val_loss"]
    first = losses("3", "a.jsonl")
    assert losses("3", "b.jsonl") == first  # bitwise
    assert losses("4", "c.jsonl") != first


def test_early_stopping_after_patience_epochs(tmp_path, cifar_dir):
    result = train(tmp_path, cifar_dir, "--epochs", "5", "--batch-size", "4", "--limit-batches", "1",
                   "--target-accuracy", "0", "--patience", "2", "--metrics-file", tmp_path / "m.jsonl")
    assert result.returncode == 0, result.stderr
    assert "Target accuracy reached. Early stopping after epoch 2." in result.stdout
    assert len(read_metrics(tmp_path / "m.jsonl")) == 2


def test_synthetic_run_needs_no_files_and_says_accuracy_is_meaningless(tmp_path):
    result = run(python_cmd("train.py", "--synthetic", *FAST, "--epochs", "1", "--batch-size", "4",
                            "--limit-batches", "1", "--data-dir", tmp_path / "none"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "50000 training / 10000 test images" in result.stdout
    assert "accuracy is meaningless" in result.stdout and not (tmp_path / "none").exists()


def assert_one_line_error(returncode, stderr, expected):
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1 and expected in lines[0], stderr


def test_missing_data_offline_as_a_real_process(tmp_path):
    result = run(python_cmd("train.py", "--no-download", "--data-dir", tmp_path / "empty"), cwd=tmp_path)
    assert_one_line_error(result.returncode, result.stderr,
                          f"fetch it first with: python dataset_utils.py --data-dir {tmp_path / 'empty'}")
    assert result.stdout == ""


def test_truncated_data_file_is_named(cifar_dir, capsys):
    path = cifar_dir / "cifar-100-python" / "test"
    path.write_bytes(path.read_bytes()[:-100])
    code = run_main("train.py", "--data-dir", cifar_dir, *FAST)
    assert_one_line_error(code, capsys.readouterr().err, f"{path} is truncated or corrupted")


@pytest.mark.parametrize("args, env, expected", [
    (["--batch-size", "0"], {}, "'0' is not a positive integer"),
    (["--precision", "fp16"], {}, "--precision fp16 needs a CUDA GPU"),
    (["--batch-size", "64"], {}, "the 32 training images give no full batch of 64 per process"),
    ([], {"WORLD_SIZE": "2"}, "train.py trains with one process but WORLD_SIZE=2"),
])
def test_bad_input(cifar_dir, capsys, monkeypatch, args, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = run_main("train.py", "--data-dir", cifar_dir, *FAST, *args)
    assert_one_line_error(code, capsys.readouterr().err, expected)


def test_metrics_file_is_appended_and_a_bad_path_fails_before_training(tmp_path, cifar_dir, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"epoch": 7}\n')  # an earlier run's line
    result = train(tmp_path, cifar_dir, "--epochs", "1", "--batch-size", "4", "--limit-batches", "1",
                   "--metrics-file", metrics)
    assert result.returncode == 0, result.stderr
    records = read_metrics(metrics)
    assert records[0] == {"epoch": 7} and [r["epoch"] for r in records[1:]] == [1]
    code = run_main("train.py", "--data-dir", cifar_dir, *FAST, "--metrics-file", tmp_path)  # a directory
    captured = capsys.readouterr()
    assert_one_line_error(code, captured.err, "not a writable file path")
    assert "Epoch 1/" not in captured.out
