"""Checkpoints, resume, stop signals, non-finite losses and the replica sync check."""

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_utils as tu
from conftest import (FAST, REPO, error_lines, python_cmd, read_metrics, run, run_main, start, torchrun_cmd,
                      wait_for)
from device_utils import MULTINODE_SETTINGS, DistContext, RunAborted, UserError, check_replicas_in_sync, network_report
from model import WideResNet

# 3 epochs of 4 steps of 4 synthetic images: long enough to interrupt, short enough for CI.
RUN = ("--synthetic", "--epochs", "3", "--limit-batches", "4", "--batch-size", "4", *FAST)
COMPARED = ("epoch", "train_loss", "val_loss", "val_accuracy", "val_samples", "train_images", "lr")


def weights(path):
    return torch.load(path, weights_only=True)


def assert_same_run(metrics_a, weights_a, metrics_b, weights_b):
    """Bitwise the same model, and every epoch's metrics once and equal."""
    a, b = weights(weights_a), weights(weights_b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_a = [{k: r[k] for k in COMPARED} for r in read_metrics(metrics_a)]
    rows_b = [{k: r[k] for k in COMPARED} for r in read_metrics(metrics_b)]
    assert [r["epoch"] for r in rows_b] == [1, 2, 3]
    assert rows_a == rows_b


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    result = run(python_cmd("train.py", *RUN, "--metrics-file", tmp / "m.jsonl", "--save-weights", tmp / "w.pt",
                            "--checkpoint-dir", tmp / "ckpt"), cwd=tmp)
    assert result.returncode == 0, result.stderr
    assert len(list((tmp / "ckpt").glob("checkpoint_*.pt"))) == tu.KEEP_CHECKPOINTS  # the newest two kept
    return tmp / "m.jsonl", tmp / "w.pt"


def test_kill_9_mid_epoch_then_resume_repeats_the_uninterrupted_run(tmp_path, reference):
    args = (*RUN, "--metrics-file", tmp_path / "m.jsonl", "--save-weights", tmp_path / "w.pt",
            "--checkpoint-dir", tmp_path / "ckpt")
    process = start(python_cmd("train.py", *args), tmp_path, tmp_path / "log")
    wait_for(tmp_path / "log", "Epoch 1/3:", process)
    time.sleep(0.5)  # into epoch 2
    process.kill()
    process.wait(timeout=30)
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Resuming from" in result.stdout
    assert_same_run(*reference, tmp_path / "m.jsonl", tmp_path / "w.pt")


def stop_with_sigusr1(args, tmp_path):
    """Start train.py, send it SIGUSR1 once epoch 1 has finished; returns its output."""
    process = start(python_cmd("train.py", *args), tmp_path, tmp_path / "log")
    wait_for(tmp_path / "log", "Epoch 1/3:", process)
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=60) == tu.EXIT_STOPPED
    return (tmp_path / "log").read_text()


def test_sigusr1_checkpoints_mid_epoch_and_resume_is_exact(tmp_path, reference):
    args = (*RUN, "--metrics-file", tmp_path / "m.jsonl", "--save-weights", tmp_path / "w.pt",
            "--checkpoint-dir", tmp_path / "ckpt")
    log = stop_with_sigusr1(args, tmp_path)
    assert "Stopped by SIGUSR1 after step" in log and "continue with --resume" in log
    assert len(read_metrics(tmp_path / "m.jsonl")) < 3
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_same_run(*reference, tmp_path / "m.jsonl", tmp_path / "w.pt")


def _child_pids(parent):
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


def _rank_pid(torchrun_pid, rank):
    for pid in _child_pids(torchrun_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def test_signal_to_one_rank_stops_every_rank_and_resumes_on_another_world_size(tmp_path):
    args = (*RUN, "--metrics-file", tmp_path / "m.jsonl", "--checkpoint-dir", tmp_path / "ckpt")
    process = start(torchrun_cmd(2, "train_ddp.py", *args), tmp_path, tmp_path / "log")
    wait_for(tmp_path / "log", "Epoch 1/3:", process)
    os.kill(_rank_pid(process.pid, 1), signal.SIGUSR1)  # rank 0 gets nothing: it must still stop
    assert process.wait(timeout=90) != 0  # torchrun reports its workers' exit as a failure
    log = (tmp_path / "log").read_text()
    assert "Stopped by a signal to another rank after step" in log
    assert re.search(rf"exitcode\s*:\s*{tu.EXIT_STOPPED}", log)  # the workers' own exit status
    newest = sorted((tmp_path / "ckpt").glob("checkpoint_*.pt"))[-1]
    assert torch.load(newest, weights_only=True)["world_size"] == 2
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)  # 1 process now
    assert result.returncode == 0, result.stderr
    assert "saved by 2 process(es), now 1" in result.stdout
    assert [r["epoch"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3]


def test_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path, reference, capsys):
    shutil.copytree(reference[0].parent / "ckpt", tmp_path / "ckpt")
    args = (*RUN, "--checkpoint-dir", tmp_path / "ckpt")
    older, newest = sorted((tmp_path / "ckpt").glob("checkpoint_*.pt"))  # after epochs 2 and 3
    newest.write_bytes(newest.read_bytes()[:100_000])
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"WARNING: checkpoint {newest} is unreadable" in result.stdout
    assert f"Resuming from {older}: epoch 3" in result.stdout and "Epoch 3/3:" in result.stdout
    for path in (tmp_path / "ckpt").glob("checkpoint_*.pt"):
        path.write_bytes(b"garbage")
    assert run_main("train.py", *args, "--resume") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --resume: no readable checkpoint in {tmp_path / 'ckpt'} (checkpoint_000000012.pt: "
        "UnpicklingError; checkpoint_000000008.pt: UnpicklingError)"]


def test_resume_without_a_checkpoint_is_an_error_not_a_fresh_start(tmp_path, capsys):
    assert run_main("train.py", *RUN, "--checkpoint-dir", tmp_path / "none", "--resume") == 2
    captured = capsys.readouterr()
    assert "Epoch 1/" not in captured.out
    assert error_lines(captured.err) == [f"error: --resume: no readable checkpoint in {tmp_path / 'none'}"]


def test_non_finite_loss_stops_with_epoch_and_step_and_saves_nothing(tmp_path, capsys):
    assert run_main("train.py", *RUN, "--base-lr", "1e30", "--warmup-epochs", "0",
                    "--checkpoint-dir", tmp_path / "ckpt") == 3
    [line] = error_lines(capsys.readouterr().err)
    assert "non-finite training loss in epoch 1 at step" in line and "without saving the model" in line
    assert not list((tmp_path / "ckpt").glob("checkpoint_*.pt"))


def _checkpoint_like(args, fingerprint, model):
    return {"model": model.state_dict(), "data": fingerprint, "args": vars(args)}


def test_resume_refuses_another_model_data_set_or_recipe():
    args = tu.parse_args("x", ["--batch-size", "256"])
    data = {"synthetic": False, "train_images": 50000, "test_images": 10000, "train_labels_sha256": "a"}
    model = WideResNet(num_classes=100)
    tu.check_resumable(_checkpoint_like(args, data, model), args, data, model)  # the same run: fine
    with pytest.raises(UserError, match="does not fit WideResNet"):
        tu.check_resumable(_checkpoint_like(args, data, WideResNet(num_classes=10)), args, data, model)
    with pytest.raises(UserError, match="trained on other data .50000 training images, synthetic=False; now "
                                        "50000, synthetic=False, different labels"):
        tu.check_resumable(_checkpoint_like(args, data, model), args, {**data, "train_labels_sha256": "b"}, model)
    other = tu.parse_args("x", ["--batch-size", "512", "--base-lr", "0.02"])
    with pytest.raises(UserError, match=r"--batch-size 256 \(now 512\), --base-lr 0.01 \(now 0.02\)"):
        tu.check_resumable(_checkpoint_like(args, data, model), other, data, model)


def test_metrics_reconcile_keeps_each_epoch_of_the_run_once(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"run_id": "old", "epoch": 1}, {"run_id": "r", "epoch": 1}, {"run_id": "r", "epoch": 2},
             {"run_id": "r", "epoch": 3}]  # epoch 3 was logged, but its checkpoint was lost
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    records = [{"run_id": "r", "epoch": 1}, {"run_id": "r", "epoch": 2}]
    tu.RunLogger(True, path).reconcile("r", records)
    assert path.read_text().splitlines() == [json.dumps(x) for x in lines[:3]] + ["not json"]
    path.write_text(json.dumps(lines[0]) + "\n")  # the file lost this run's lines
    tu.RunLogger(True, path).reconcile("r", records)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [lines[0], *records]
    new_file = tmp_path / "new.jsonl"  # resuming into a new metrics file
    tu.RunLogger(True, new_file).reconcile("r", records)
    assert [json.loads(line) for line in new_file.read_text().splitlines()] == records


def test_epoch_seeds_differ_by_seed_epoch_and_rank():
    seeds = {tu.epoch_seed(s, e, r) for s in range(3) for e in range(1, 4) for r in range(4)}
    assert len(seeds) == 36 and all(0 <= s < 2**63 for s in seeds)
    assert tu.epoch_seed(0, 1, 0) == tu.epoch_seed(0, 1, 0)


def _replica_worker(rank, store, results, perturb):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if perturb and rank == 1:
        with torch.no_grad():
            model[1].weight[0, 3] += 1e-7  # one value, barely changed
    try:
        check_replicas_in_sync(model, "after step 7 of epoch 2")
        outcome = "in sync"
    except RunAborted as err:
        outcome = str(err)
    Path(results, f"rank{rank}").write_text(outcome)
    dist.destroy_process_group()


@pytest.mark.parametrize("perturb", [False, True])
def test_replica_check_catches_a_perturbed_rank(tmp_path, perturb):
    mp.spawn(_replica_worker, args=(tmp_path / "store", tmp_path, perturb), nprocs=2, join=True)
    outcomes = [(tmp_path / f"rank{rank}").read_text() for rank in range(2)]
    if not perturb:
        assert outcomes == ["in sync", "in sync"]
    else:
        for outcome in outcomes:  # every rank stops, with the same message
            assert outcome.startswith("model parameters on rank(s) [1] differ from rank 0 after step 7 of epoch 2")
            assert "stopping without writing a checkpoint" in outcome


def test_network_report_warns_when_a_multinode_run_lacks_the_settings():
    two_nodes = DistContext(device=torch.device("cpu"), world_size=8, local_world_size=4)
    lines = network_report(two_nodes, {"NCCL_PROTO": "^LL128", "FI_PROVIDER": "cxi"})
    assert lines[0] == "Network settings: FI_PROVIDER=cxi NCCL_PROTO=^LL128"
    assert lines[1].startswith("WARNING: multi-node run without the recommended settings FI_CXI_RX_MATCH_MODE")
    assert "NCCL_PROTO," not in lines[1]
    assert len(network_report(two_nodes, dict(MULTINODE_SETTINGS))) == 1  # all set: no warning
    one_node = DistContext(device=torch.device("cpu"), world_size=4, local_world_size=4)
    assert len(network_report(one_node, {})) == 1


def test_job_script_passes_exactly_the_recommended_settings():
    text = (REPO / "multinode_job.sh").read_text()
    block = text[text.index("NETWORK_DEFAULTS=(") + len("NETWORK_DEFAULTS=("):text.index(")", text.index("NETWORK_DEFAULTS=("))]
    defaults = dict(line.strip().strip('"').split("=", 1) for line in block.strip().splitlines())
    assert defaults == MULTINODE_SETTINGS


def test_torchvision_loader_with_a_persistent_worker_resumes_exactly(tmp_path):
    """The same guarantee for --loader torchvision: CropFlipSampler hands the worker its
    augmentation, so neither the worker's life nor the restart changes a pixel."""
    tv_run = (*RUN, "--loader", "torchvision", "--num-workers", "1")
    reference = run(python_cmd("train.py", *tv_run, "--metrics-file", tmp_path / "m_ref.jsonl",
                               "--save-weights", tmp_path / "w_ref.pt"), cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr
    args = (*tv_run, "--metrics-file", tmp_path / "m.jsonl", "--save-weights", tmp_path / "w.pt",
            "--checkpoint-dir", tmp_path / "ckpt")
    assert "Stopped by SIGUSR1" in stop_with_sigusr1(args, tmp_path)
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Loader: torchvision DataLoader, 1 worker process per" in result.stdout
    assert_same_run(tmp_path / "m_ref.jsonl", tmp_path / "w_ref.pt", tmp_path / "m.jsonl", tmp_path / "w.pt")
