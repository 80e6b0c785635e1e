"""train_ddp.py under torchrun with 2 CPU processes (gloo, the same code path as NCCL)."""

import numpy as np
import pytest
import torch

import dataset_utils as du
from conftest import (FAST, REPO, SMALL_MODEL, error_lines, python_cmd, read_metrics, run, run_main, torchrun_cmd,
                      write_cifar100)
from oom_net import Net as SmallNet

pytestmark = pytest.mark.oldest_torch  # every test here runs again on PyTorch 2.7.1 (.ci/run)


def _labels_half_predicted(weights_path, data_dir, n_test):
    """Test labels that the model gets right exactly where index % 3 != 0, so the expected
    accuracy is known and any image dropped, repeated or mis-weighted changes it."""
    model = SmallNet(num_classes=100, in_channels=3)
    model.load_state_dict(torch.load(weights_path, weights_only=True))
    model.eval()
    _, test_set = du.build_datasets(data_dir)
    with torch.no_grad():
        predictions = model(torch.stack([test_set[i][0] for i in range(n_test)])).argmax(dim=1)
    return [int(p) if i % 3 else (int(p) + 1) % 100 for i, p in enumerate(predictions)]


def test_one_and_two_processes_report_identical_evaluation(tmp_path):
    """The sharded evaluation's sums: what is evaluated is not the point, so a small network."""
    n_test = 41  # odd: the two shards differ in size
    torch.manual_seed(0)
    weights = tmp_path / "w.pt"
    torch.save(SmallNet(num_classes=100, in_channels=3).state_dict(), weights)
    data = write_cifar100(tmp_path / "data", n_train=16, n_test=n_test)
    labels = _labels_half_predicted(weights, data, n_test)
    data = write_cifar100(tmp_path / "data", n_train=16, n_test=n_test, test_labels=labels)
    expected_accuracy = sum(1 for i in range(n_test) if i % 3) / n_test

    common = ("--eval-only", *SMALL_MODEL, "--weights", weights, "--data-dir", data, "--batch-size", "8", *FAST)
    runs = {
        "train.py": python_cmd("train.py", *common, "--metrics-file", tmp_path / "one.jsonl"),
        "train_ddp.py x1": torchrun_cmd(1, "train_ddp.py", *common, "--metrics-file", tmp_path / "ddp1.jsonl"),
        "train_ddp.py x2": torchrun_cmd(2, "train_ddp.py", *common, "--metrics-file", tmp_path / "ddp2.jsonl"),
    }
    records = {}
    for name, cmd in runs.items():
        result = run(cmd, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("Evaluation: ") == 1  # printed by rank 0 only
        assert (f"Evaluating Net(num_classes=100, in_channels=3) from {REPO / 'tests' / 'oom_net.py'} weights {weights} "
                "on the CIFAR-100 test "
                "set") in result.stdout
        assert "Training Net" not in result.stdout and "Recipe:" not in result.stdout  # no training header
        assert f"on all {n_test} test images" in result.stdout
        [records[name]] = read_metrics(cmd[cmd.index("--metrics-file") + 1])
    for name, record in records.items():
        assert record["val_samples"] == n_test, name
        assert record["val_accuracy"] == expected_accuracy, name
    assert records["train_ddp.py x2"]["world_size"] == 2
    losses = [record["val_loss"] for record in records.values()]
    np.testing.assert_allclose(losses, losses[0], rtol=1e-6)  # summed in another order: float rounding only


def test_two_process_training_shards_the_data_and_rank_0_writes(tmp_path):
    data = write_cifar100(tmp_path / "data", n_train=32, n_test=20)
    metrics = tmp_path / "m.jsonl"
    result = run(torchrun_cmd(2, "train_ddp.py", *SMALL_MODEL, "--data-dir", data, "--epochs", "2", "--batch-size", "8",
                              *FAST, "--metrics-file", metrics, "--save-weights", tmp_path / "w.pt"),
                 cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Batch Size: 8 (4 per process x 2 CPU processes, 1 node)" in result.stdout
    assert "4 steps per epoch" in result.stdout  # 32 images / 2 ranks / 4 per rank
    assert result.stdout.count("Training complete.") == 1
    assert "Warning" not in result.stderr  # e.g. DDP's broadcast_buffers FutureWarning on PyTorch >= 2.13
    records = read_metrics(metrics)
    assert [r["epoch"] for r in records] == [1, 2]  # one line per epoch, not one per rank
    assert all(r["train_images"] == 32 and r["val_samples"] == 20 and r["world_size"] == 2 for r in records)
    SmallNet(num_classes=100, in_channels=3).load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True),
                                                              strict=True)


def test_indivisible_global_batch_is_an_error(tmp_path, cifar_dir):
    result = run(torchrun_cmd(2, "train_ddp.py", "--data-dir", cifar_dir, "--batch-size", "7", *FAST), cwd=tmp_path)
    assert result.returncode != 0
    lines = error_lines(result.stdout + result.stderr)
    assert lines == ["error: --batch-size 7 does not split evenly over 2 processes; use a multiple of 2 (e.g. 6 or 8)"]
    result = run(torchrun_cmd(2, "train_ddp.py", "--data-dir", cifar_dir, "--batch-size", "128", *FAST), cwd=tmp_path)
    assert error_lines(result.stdout + result.stderr) == [
        "error: the 64 training images give no full batch of 64 per process (32 for each of 2 processes); lower "
        "--batch-size"] and result.returncode != 0


def test_missing_data_is_reported_once_and_nothing_is_downloaded(tmp_path):
    result = run(torchrun_cmd(2, "train_ddp.py", "--data-dir", tmp_path / "empty", "--no-download"), cwd=tmp_path)
    assert result.returncode != 0
    assert len(error_lines(result.stderr)) == 1 and "CIFAR-100 not found" in result.stderr


SLOW_RANK_0 = """
import os, sys, time
sys.path.insert(0, {repo!r})
from engine.cli import run_cli
from engine.errors import UserError


def main():
    if os.environ["RANK"] == "0":
        time.sleep({delay})  # rank 0 reaches the error last (a loaded node)
    raise UserError("the same mistake on every rank")


run_cli(main)
"""


@pytest.mark.parametrize("delay", [0, 2])
def test_rank_0s_error_line_is_not_lost_when_another_rank_gets_there_first(tmp_path, delay):
    """torchrun stops every rank when one fails: the silent ranks wait for rank 0's line."""
    script = tmp_path / "mistake.py"
    script.write_text(SLOW_RANK_0.format(repo=str(REPO), delay=delay))
    result = run(torchrun_cmd(2, script), cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert error_lines(result.stderr) == ["error: the same mistake on every rank"], result.stderr


def test_train_ddp_without_torchrun_says_how_to_start_it(capsys):
    assert run_main("train_ddp.py", "--synthetic") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: train_ddp.py must be started by torchrun, e.g. python tools/torchrun.py --standalone "
        "--nproc_per_node=2 train_ddp.py (for one process: python train.py)"]
