"""train.py end to end, as users run it: output, metrics file, reproducibility, early
stopping, and bad input (one line, exit 2, nothing lost)."""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

import train_utils as tu
from conftest import FAST, TINY_MODEL, clean_env, error_lines, python_cmd, read_metrics, run, run_main, write_cifar100
from engine import optimization
from engine.errors import UserError
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
                   "--metrics-file", metrics, "--save-weights", weights, "--log-interval", "0.001")
    assert result.returncode == 0, result.stderr
    out = result.stdout  # a pipe, as in a batch job's .out file
    assert "Batch Size: 8 (8 per process x 1 CPU process, 1 node)" in out
    assert "32 training / 20 test images, 4 steps per epoch" in out
    assert "WARNING: this CIFAR-100 has 32 training images instead of 50000 and 20 test images instead of 10000" in out
    assert "Device: cpu (CPU: " in out and "Weights: random initialization (--seed 0)" in out
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "
    epoch_lines = re.findall(rf"^{stamp}Epoch (\d)/2: Time=.* \| elapsed \d:\d\d:\d\d, ETA (\d:\d\d:\d\d)$", out, re.M)
    assert [epoch for epoch, _ in epoch_lines] == ["1", "2"] and epoch_lines[-1][1] == "0:00:00"
    # Progress lines at most every --log-interval, with one per batch here, but none for the last
    # batch (the epoch's or the evaluation's own line follows).
    steps = re.findall(rf"^{stamp}Epoch 1/2 \[(\d)/4\] loss \d+\.\d{{4}}, [\d.]+ img/s, \d:\d\d:\d\d left$", out, re.M)
    evals = re.findall(rf"^{stamp}Evaluation after epoch 1 \[(\d)/3\] accuracy [\d.]+ \(rank 0\), .* left$", out, re.M)
    assert steps == ["1", "2", "3"] and evals == ["1", "2"]
    assert "\r" not in out  # no terminal line in a log file
    assert re.search(rf"^{stamp}Training complete. Final Accuracy: [\d.]+ on all 20 test images", out, re.M)
    assert re.search(r"^Time: training [\d.]+s \+ evaluation [\d.]+s over the run's 2 epochs; wall time [\d.]+s "
                     r"\(reading the data, start-up and checkpoints included", out, re.M)
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
    def losses(seed, name):  # the tiny network: dropout and BatchNorm, as the Wide ResNet, in a fraction of the time
        result = train(tmp_path, cifar_dir, "--epochs", "1", "--batch-size", "8", "--limit-batches", "2",
                       "--seed", seed, "--metrics-file", tmp_path / name, *TINY_MODEL)
        assert result.returncode == 0, result.stderr
        assert "Note: the 2 warm-up epochs are longer than this 1-epoch run: the learning rate peaks at 50%" \
            in result.stdout  # the default warm-up, said, not refused: smoke runs stay one command
        record = read_metrics(tmp_path / name)[0]
        return record["train_loss"], record["val_loss"]
    first = losses("3", "a.jsonl")
    assert losses("3", "b.jsonl") == first  # bitwise
    assert losses("4", "c.jsonl") != first


def test_early_stopping_after_patience_epochs(tmp_path, cifar_dir):
    def tiny(*args):  # the tiny network: the Wide ResNet's step takes seconds on a CPU; the length is the loop's
        return train(tmp_path, cifar_dir, *TINY_MODEL, *args)

    result = tiny("--epochs", "5", "--batch-size", "4", "--limit-batches", "1", "--target-accuracy", "0", "--patience",
                  "2", "--metrics-file", tmp_path / "m.jsonl")
    assert result.returncode == 0, result.stderr
    assert ("Length: 5 epochs, or fewer: early stop once validation accuracy is at least 0 for 2 epochs in a row "
            "(--target-accuracy, --patience; --target-accuracy off trains them all)") in result.stdout
    records = read_metrics(tmp_path / "m.jsonl")
    assert (f"Target accuracy reached. Early stopping after epoch 2 of 5 (--target-accuracy 0 for --patience 2; the "
            f"LR schedule had not finished: LR {records[-1]['lr']:.3g}; --target-accuracy off trains all --epochs)."
            ) in result.stdout
    assert re.search(r"Final Accuracy: [\d.]+ on 4 of 20 test images \(--limit-batches\)", result.stdout)
    # CIFAR-100's 100 classes: top-5 accuracy too, in the metrics and the summary.
    assert f"Top-5 Accuracy: {records[-1]['val_top5']:.4f}" in result.stdout
    assert all(r["val_accuracy"] <= r["val_top5"] <= 1 for r in records)
    never = tiny("--epochs", "2", "--batch-size", "4", "--limit-batches", "1", "--target-accuracy", "1", "--patience", "1")
    assert "Early stop not reached (--target-accuracy 1 for --patience 1): trained to --epochs 2." in never.stdout
    last = tiny("--epochs", "2", "--batch-size", "4", "--limit-batches", "1", "--target-accuracy", "0", "--patience", "2")
    assert "Target accuracy reached (--target-accuracy 0 for --patience 2) in the last of the 2 epochs." in last.stdout
    assert "Early stopping" not in last.stdout  # nothing was cut short
    assert "[1/1]" not in result.stdout  # the default --log-interval (a minute): no progress line
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
    hint = f"fetch it first with: python dataset_utils.py --dataset cifar100 --data-dir {tmp_path / 'empty'}"
    assert_one_line_error(result.returncode, result.stderr, hint)
    assert result.stdout == ""


def test_truncated_data_file_is_named(cifar_dir, capsys):
    path = cifar_dir / "cifar-100-python" / "test"
    path.write_bytes(path.read_bytes()[:-100])
    code = run_main("train.py", "--data-dir", cifar_dir, *FAST)
    assert_one_line_error(code, capsys.readouterr().err, f"{path} is truncated or corrupted")


@pytest.mark.parametrize("args, env, expected", [
    (["--batch-size", "0"], {}, "'0' is not a positive integer"),
    (["--precision", "fp16"], {}, "--precision fp16 needs a CUDA GPU"),
    (["--batch-size", "64"], {}, "the 32 training images give no full batch of 64 per process; lower --batch-size"),
    (["--val-fraction", "0.9", "--batch-size", "32"], {},
     "the 26 training images (--val-fraction 0.9 held out 6 of 32) give no full batch of 32 per process; lower "
     "--batch-size or --val-fraction"),
    ([], {"WORLD_SIZE": "2"}, "train.py trains with one process but WORLD_SIZE=2; use train_ddp.py for several "
                              "processes (python tools/torchrun.py --standalone --nproc_per_node=N train_ddp.py)"),
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
    code = run_main("train.py", "--data-dir", cifar_dir, *FAST, "--save-weights", f"{tmp_path / 'new'}/")
    captured = capsys.readouterr()  # Path() would make the folder's name the file new
    assert_one_line_error(code, captured.err, f"error: --save-weights {tmp_path / 'new'}/: not a writable file path "
                                              "(it ends in /, as a folder's name does)")
    assert not (tmp_path / "new").exists()


def test_a_failed_command_leaves_no_empty_folders(tmp_path, cifar_dir, capsys):
    new = tmp_path / "new"
    code = run_main("train.py", "--data-dir", cifar_dir, *FAST, "--batch-size", "64", "--checkpoint-dir", new / "ck",
                    "--metrics-file", new / "logs" / "m.jsonl", "--save-weights", new / "out" / "w.pt")
    assert_one_line_error(code, capsys.readouterr().err, "no full batch")
    assert not new.exists()
    code = run_main("train.py", "--data-dir", cifar_dir, *FAST, "--checkpoint-dir", cifar_dir / "cifar-100-python" /
                    "meta" / "ck")
    assert_one_line_error(code, capsys.readouterr().err, f"{cifar_dir / 'cifar-100-python' / 'meta'} is a file")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a disk that is always full)")
def test_a_metrics_file_that_cannot_be_written_mid_run_is_a_warning(tmp_path, cifar_dir):
    """/dev/full accepts the start-up check and fails every write with ENOSPC, as a full disk does."""
    result = train(tmp_path, cifar_dir, "--epochs", "2", "--batch-size", "8", "--limit-batches", "1",
                   "--metrics-file", "/dev/full", "--checkpoint-dir", tmp_path / "ck", *TINY_MODEL)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    warning = ("WARNING: cannot append to --metrics-file /dev/full (No space left on device); 1 line kept in memory "
               "for the next epoch, and in the checkpoints")
    assert warning in result.stdout
    assert "2 lines kept" in result.stdout and "Epoch 2/2: Time=" in result.stdout  # training went on
    state = torch.load(next(Path(tmp_path / "ck").glob("*.pt")), weights_only=True)["state"]
    assert [r["epoch"] for r in state["records"]] == [1, 2]  # the lines are kept in the checkpoint


def test_the_start_up_block_confirms_the_weights(tmp_path, cifar_dir, capsys):
    weights = tmp_path / "w.pt"
    torch.save(WideResNet(num_classes=100).state_dict(), weights)
    code = run_main("train.py", "--data-dir", cifar_dir, *FAST, "--epochs", "1", "--limit-batches", "1",
                    "--batch-size", "4", "--weights", weights)
    out = capsys.readouterr().out
    assert code == 0 and f"\nWeights: loaded from {weights}\n" in out


def test_an_epochs_too_long_to_tabulate_is_one_line_before_the_start_up_block(tmp_path):
    """--epochs 1000000000 (3 steps each): lr_factor's schedule, computed per step at start, was
    minutes of start-up with gigabytes of memory growing, and a SIGTERM meanwhile was not taken.
    Now one line, before anything else; the longest schedule tabulated still starts."""
    cmd = python_cmd("train.py", "--synthetic", *TINY_MODEL, "--epochs", "1000000000", "--limit-batches", "3",
                     "--batch-size", "4")
    result = run(cmd, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert error_lines(result.stderr) == [
        "error: --epochs 1000000000: 3,000,000,000 optimizer steps (3 steps per epoch), more than the 10,000,000 "
        "lr_factor's schedule is computed for at start (MAX_SCHEDULE_STEPS in engine/optimization.py); lower "
        "--epochs, or return a torch scheduler of your own from recipe.make_scheduler"]
    optimization.check_schedule_length(optimization.MAX_SCHEDULE_STEPS // 4, 4)
    with pytest.raises(UserError, match=r"^--epochs 2500001: 10,000,004 optimizer steps \(4 steps per epoch\)"):
        optimization.check_schedule_length(optimization.MAX_SCHEDULE_STEPS // 4 + 1, 4)


def test_num_workers_by_the_thousand_is_one_line(capsys):
    """--num-workers 1000 on 2 cores started about 1000 worker processes, PyTorch's multi-line
    warning the only word; now more than 4 a core is refused, and 4 a core is taken."""
    cores = len(os.sched_getaffinity(0))
    assert run_main("train.py", "--synthetic", "--loader", "torchvision", "--num-workers", 4 * cores + 1) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"train.py: error: --num-workers {4 * cores + 1}: more than 4 loader workers for each of the {cores} CPU "
        f"cores this process may use (at most {4 * cores}); leave it out for one per spare core (at most 8) (see "
        "--help)"]
    assert tu.parse_args("test", ["--synthetic", "--num-workers", str(4 * cores)]).num_workers == 4 * cores


def test_num_workers_beside_the_device_loader_is_said_to_have_no_effect(capsys):
    code = run_main("train.py", "--synthetic", *TINY_MODEL, "--epochs", "1", "--limit-batches", "1",
                    "--batch-size", "4", "--num-workers", "3")
    out = capsys.readouterr().out
    assert code == 0 and "\nLoader: device (data set and augmentation on cpu, no worker processes: --num-workers 3 " \
                         "has no effect); auto: " in out


def test_the_cpu_suite_hides_cuda(tmp_path):
    """On a GPU machine too (conftest.cpu_only): no CUDA here, none in the processes tests start."""
    assert not torch.cuda.is_available()
    result = run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], cwd=tmp_path)
    assert result.stdout.strip() == "0" and clean_env()["CUDA_VISIBLE_DEVICES"] == ""
