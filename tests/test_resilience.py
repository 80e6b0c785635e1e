"""Checkpoints, resume, stop signals, non-finite losses and the replica sync check."""

import json
import os
import re
import shutil
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchvision.transforms import v2

import dataset_utils as du
import device_utils
import recipe
import train_utils as tu
from engine import all_reduce_timing, checkpoints, files, flags, lost_ranks, seeds, stopping, task
from engine import log as run_log
from engine import weights as weights_file
from conftest import (FAST, PLAIN_MODEL, REPO, TINY_MODEL, clean_env, descendants, error_lines, python_cmd,
                      read_metrics, run, run_main, spawn, start, torchrun_cmd, wait_for)
from device_utils import check_replicas_in_sync, cleanup_distributed
from engine.errors import EXIT_STOPPED, RunAborted, UserError
from engine.nccl_log import MULTINODE_SETTINGS, network_report
from engine.processes import DistContext
from model import WideResNet

# 3 epochs of 4 steps of 4 synthetic images of the tiny network (each forward 50 ms): long
# enough to interrupt, short enough for CI.
RUN = ("--synthetic", "--epochs", "3", "--limit-batches", "4", "--batch-size", "4", "--checkpoint-interval", "0", *FAST,
       *TINY_MODEL)
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
    assert len(list((tmp / "ckpt").glob("checkpoint_*.pt"))) == flags.KEEP_CHECKPOINTS  # the newest two kept
    return tmp / "m.jsonl", tmp / "w.pt"


@pytest.mark.oldest_torch
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


def stop_with_sigusr1(args, tmp_path, sig=signal.SIGUSR1):
    """Start train.py, send it ``sig`` once epoch 1 has finished; returns its output."""
    process = start(python_cmd("train.py", *args), tmp_path, tmp_path / "log")
    wait_for(tmp_path / "log", "Epoch 1/3:", process)
    process.send_signal(sig)
    assert process.wait(timeout=60) == EXIT_STOPPED
    return (tmp_path / "log").read_text()


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT])  # Slurm's warning; Ctrl-C
def test_a_stop_signal_checkpoints_mid_epoch_and_resume_is_exact(tmp_path, reference, sig):
    args = (*RUN, "--metrics-file", tmp_path / "m.jsonl", "--save-weights", tmp_path / "w.pt",
            "--checkpoint-dir", tmp_path / "ckpt")
    log = stop_with_sigusr1(args, tmp_path, sig)
    match = re.search(rf"^Stopped after step \d of epoch 2 \({sig.name}\); checkpoint (.*/checkpoint_\d+\.pt): "
                      "continue with --resume$", log, re.M)
    assert match and Path(match[1]).exists()  # the checkpoint the message names is there
    assert "Traceback" not in log
    assert len(read_metrics(tmp_path / "m.jsonl")) < 3
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_same_run(*reference, tmp_path / "m.jsonl", tmp_path / "w.pt")


def _rank_pid(torchrun_pid, rank):
    for pid in descendants(torchrun_pid):  # its ranks first, then theirs
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.oldest_torch
def test_signal_to_one_rank_stops_every_rank_and_resumes_on_another_world_size(tmp_path):
    args = (*RUN, "--metrics-file", tmp_path / "m.jsonl", "--checkpoint-dir", tmp_path / "ckpt")
    process = start(torchrun_cmd(2, "train_ddp.py", *args), tmp_path, tmp_path / "log")
    wait_for(tmp_path / "log", "Epoch 1/3:", process)
    os.kill(_rank_pid(process.pid, 1), signal.SIGUSR1)  # rank 0 gets nothing: it must still stop
    assert process.wait(timeout=90) != 0  # torchrun reports its workers' exit as a failure
    log = (tmp_path / "log").read_text()
    assert re.search(r"Stopped after step \d of epoch 2 \(a stop request on another rank\)", log)
    assert re.search(rf"exitcode\s*:\s*{EXIT_STOPPED}", log)  # the workers' own exit status
    newest = sorted((tmp_path / "ckpt").glob("checkpoint_*.pt"))[-1]
    assert torch.load(newest, weights_only=True)["world_size"] == 2
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)  # 1 process now
    assert result.returncode == 0, result.stderr
    assert re.search(r"Resuming from .*: epoch 2, after step \d \(saved by 2 processes, now 1\)", result.stdout)
    assert [r["epoch"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3]


@pytest.mark.oldest_torch
@pytest.mark.xdist_group("compile")  # uses no fixture of this file: the other worker may run it meanwhile
def test_a_compiled_run_recompiles_nothing_and_resumes_exactly_on_its_cached_kernels(tmp_path):
    """--compile: 3 epochs compile the model once (TORCH_LOGS=recompiles logs no recompilation:
    evaluation runs the eager module, and nothing the step passes changes a guard), into the
    checkpoint folder's compile_cache. The same run stopped (--stop-file) and resumed in a new
    process is bit for bit the uninterrupted one, and the resume compiles nothing: it adds no
    graph to that cache, none to PyTorch's default folder under TMPDIR."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = clean_env(TORCH_LOGS="recompiles", TMPDIR=scratch)  # PyTorch's default cache: TMPDIR/torchinductor_USER
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)

    def train(name, *more):
        out = tmp_path / name
        result = run(python_cmd("train.py", *RUN[:-2], *PLAIN_MODEL, "--compile", "--checkpoint-dir", out / "ckpt",
                                "--metrics-file", out / "m.jsonl", "--save-weights", out / "w.pt", *more),
                     cwd=tmp_path, env=env)
        assert result.returncode == 0 and "__recompiles" not in result.stderr, result.stderr
        return result, out

    whole, reference = train("whole")
    said = [line for line in whole.stdout.splitlines() if "torch.compile: the first step took" in line]
    assert len(said) == 1 and said[0].endswith(f"compile cache {reference / 'ckpt' / 'compile_cache'}: a resumed or "
                                               "requeued job reuses what this start compiles"), whole.stdout
    def graphs(folder):  # inductor's FX graphs in a checkpoint folder
        return sorted(path.relative_to(folder) for path in (folder / "compile_cache" / "fxgraph").rglob("*"))

    compiled = graphs(reference / "ckpt")
    assert compiled  # in the job's folder
    # The stopped run starts from a copy of them (compiling once is enough for the test), adds none.
    shutil.copytree(reference / "ckpt" / "compile_cache", tmp_path / "stopped" / "ckpt" / "compile_cache")
    stop_file = tmp_path / "STOP"
    stop_file.touch()  # seen within a second: during the first step, which compiles
    stopped, out = train("stopped", "--stop-file", stop_file)
    assert "Stopped after" in stopped.stdout and "Epoch 3/3" not in stopped.stdout, stopped.stdout
    assert graphs(out / "ckpt") == compiled
    assert not stop_file.exists()  # the stop removed the file it acted on: the resume is not stopped by it
    resumed, _ = train("stopped", "--resume")
    assert "compile_cache, with what an earlier start compiled: reused where it fits" in resumed.stdout
    assert graphs(out / "ckpt") == compiled  # read back, none compiled anew
    assert not list(scratch.glob("torchinductor_*/fxgraph/*"))
    assert_same_run(reference / "m.jsonl", reference / "w.pt", out / "m.jsonl", out / "w.pt")


def test_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path, reference, capsys):
    shutil.copytree(reference[0].parent / "ckpt", tmp_path / "ckpt")
    args = (*RUN, "--checkpoint-dir", tmp_path / "ckpt")
    older, newest = sorted((tmp_path / "ckpt").glob("checkpoint_*.pt"))  # after epochs 2 and 3
    newest.write_bytes(newest.read_bytes()[:1000])  # the zip without its end
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # A zip without its end: the first sentence of torch's message, whole, not its advice.
    assert (f"WARNING: checkpoint {newest} is unreadable (RuntimeError: PytorchStreamReader failed reading zip "
            f"archive: failed finding central directory), renamed to {newest.name}.unreadable; trying the "
            "previous one\n") in result.stdout
    assert f"Resuming from {older}: after epoch 2 (saved by 1 process, now 1)" in result.stdout
    assert "Epoch 3/3:" in result.stdout
    assert f"\nWeights: from the newest readable checkpoint in {tmp_path / 'ckpt'} (resuming)\n" in result.stdout
    for path in (tmp_path / "ckpt").glob("checkpoint_*.pt"):
        path.write_bytes(b"garbage")
    assert run_main("train.py", *args, "--resume") == 2
    assert error_lines(capsys.readouterr().err) == [  # the reasons too: a job's .err file holds this line alone
        f"error: --resume: no readable checkpoint in {tmp_path / 'ckpt'} (checkpoint_000000012.pt: "
        "UnpicklingError: Weights only load failed, renamed to checkpoint_000000012.pt.unreadable.2; "
        "checkpoint_000000008.pt: UnpicklingError: Weights only load failed, renamed to "
        "checkpoint_000000008.pt.unreadable)"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [  # nothing deleted
        "checkpoint_000000008.pt.unreadable", "checkpoint_000000012.pt.unreadable",
        "checkpoint_000000012.pt.unreadable.2", "model_best.pt"]


def test_resume_without_a_checkpoint_is_an_error_not_a_fresh_start(tmp_path, capsys):
    assert run_main("train.py", *RUN, "--checkpoint-dir", tmp_path / "none", "--resume") == 2
    captured = capsys.readouterr()
    assert "Epoch 1/" not in captured.out
    assert error_lines(captured.err) == [f"error: --resume: there is no folder {tmp_path / 'none'} (--checkpoint-dir): "
                                         "nothing to continue"]
    assert not (tmp_path / "none").exists()
    (tmp_path / "empty").mkdir()
    assert run_main("train.py", *RUN, "--checkpoint-dir", tmp_path / "empty", "--resume") == 2
    captured = capsys.readouterr()
    assert "Epoch 1/" not in captured.out and "Weights: " not in captured.out  # refused before the header
    assert error_lines(captured.err) == [f"error: --resume: no checkpoint in {tmp_path / 'empty'}, nothing to "
                                         "continue (--resume=auto starts a new run where there is none)"]


def test_non_finite_loss_stops_with_epoch_and_step_and_saves_nothing(tmp_path, capsys):
    assert run_main("train.py", *RUN, "--base-lr", "1e30", "--warmup-epochs", "0",
                    "--checkpoint-dir", tmp_path / "ckpt") == 3
    [line] = error_lines(capsys.readouterr().err)
    assert "non-finite training loss in epoch 1 at step" in line and "without saving the model" in line
    assert line.endswith("; try a lower --base-lr")  # a CPU run is fp32 already: no --precision fp32 advice
    assert not list((tmp_path / "ckpt").glob("checkpoint_*.pt"))


def _checkpoint_like(args, fingerprint, model):
    return {"model": model.state_dict(), "data": fingerprint, "args": vars(args)}


def _fits(model):
    return lambda state, source: weights_file.check_state_fits(model, state, source)


@pytest.mark.parametrize("error, failed", [
    (RuntimeError("Application timeout caused pair closure"), True),  # gloo, from DDP's backward()
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1"), True),
    (RuntimeError("Timed out waiting 6000ms for send operation to complete (gloo)"), True),
    (dist.DistError("all-reduce not finished after 3 s"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x10 and 12x3)"), False),  # the user's model
    (ValueError("NCCL"), False)])
def test_a_collective_failure_is_told_from_the_users_error(error, failed):
    assert lost_ranks.is_collective_failure(error) is failed


def test_an_nccl_timeout_reads_as_the_collective_and_the_seconds():
    """PyTorch's text names a watchdog (none runs in check_network's blocking wait) and the
    group's timeout (not the wait's own, which fired): the line says what timed out, when."""
    text = ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1024, "
            "NumelOut=1024, Timeout(ms)=360000) ran for 300012 milliseconds before timing out")
    assert lost_ranks.short_timeout(text) == "NCCL ALLREDUCE timed out after 300.0 s"
    other = "NCCL error in: ProcessGroupNCCL.cpp:2010, remote process exited or there was a network error"
    assert lost_ranks.short_timeout(other) == other


def test_resume_refuses_another_model_data_set_or_recipe():
    args = tu.parse_args("x", ["--batch-size", "256"])
    data = {"dataset": "cifar100", "synthetic": False, "train_images": 50000, "test_images": 10000,
            "train_labels_sha256": "a"}
    model = WideResNet(num_classes=100)

    def check(checkpoint, run_args=args, fingerprint=data, key="model:WideResNet", optimizer_class="SGD", **more):
        parser = tu.build_parser("x")
        optimizer = getattr(torch.optim, optimizer_class)(model.parameters())
        checkpoints.check_resumable(checkpoint, vars(run_args), fingerprint, key, optimizer, _fits(model),
                                    vars(parser.parse_args([])), flags.run_defining_flags(parser, recipe.RECIPE_GROUP),
                                    **more)

    check(_checkpoint_like(args, data, model))  # the same run: fine
    before = {k: v for k, v in data.items() if k != "dataset"}  # a checkpoint from before --dataset: CIFAR-100
    old_args = {k: v for k, v in vars(args).items() if k not in ("model", "augment")}  # ... and before --model
    check({**_checkpoint_like(args, before, model), "args": old_args})
    with pytest.raises(UserError, match="does not fit WideResNet"):
        check(_checkpoint_like(args, data, WideResNet(num_classes=10)))
    with pytest.raises(UserError, match="trained on other data .50000 training images, as then; different labels.: "
                                        "resume on the data it was trained on, or start a new run "
                                        "in another --checkpoint-dir"):
        check(_checkpoint_like(args, data, model), fingerprint={**data, "train_labels_sha256": "b"})
    folder = {**data, "dataset": "folder", "classes": ["a", "b"], "image_shape": [32, 32, 3]}
    with pytest.raises(UserError, match=r"\(50000 training images, as then; images of shape \[32, 32, 3\] "
                                        r"then, \[64, 64, 3\] now\)"):
        check(_checkpoint_like(args, folder, model), fingerprint={**folder, "image_shape": [64, 64, 3]})
    # A class folder added: the model built for it has a head of another size, which was reported as "weights
    # of another --model or --dataset?" though neither flag changed.
    with pytest.raises(UserError, match=r"\(50000 training images, as then; 2 classes then, 3 now \(c added\)\)"):
        check(_checkpoint_like(args, folder, WideResNet(num_classes=2)),
              fingerprint={**folder, "classes": ["a", "b", "c"]})
    with pytest.raises(UserError, match=r"; 2 classes then, 2 now \(c added; b removed\)\)"):
        check(_checkpoint_like(args, folder, model), fingerprint={**folder, "classes": ["a", "c"]})
    with pytest.raises(UserError, match=r"; the same classes in another order\)"):
        check(_checkpoint_like(args, folder, model), fingerprint={**folder, "classes": ["b", "a"]})
    # The same training images, fewer test images (a class folder removed from test/): it said "50000 training
    # images; now 50000 training images" and no more.
    with pytest.raises(UserError, match=r"\(50000 training images, as then; 10000 test images then, 9000 now\)"):
        check(_checkpoint_like(args, data, model), fingerprint={**data, "test_images": 9000})
    with pytest.raises(UserError, match=r"\(50000 training images then, 40000 training images now; different labels"):
        check(_checkpoint_like(args, data, model), fingerprint={**data, "train_images": 40000,
                                                                "train_labels_sha256": "b"})
    # The pixels: a sample of a built-in data set's images (here all black since), an image folder's mean.
    images = np.random.default_rng(0).integers(0, 256, (1000, 8, 8, 3), dtype=np.uint8)
    labels = np.arange(1000) % 10

    def stored(pixels=images, mean=None, mean_of="stored"):
        return task.data_fingerprint("cifar10", False, labels, 100, images=pixels, mean=mean, mean_of=mean_of)

    check(_checkpoint_like(args, stored(), model), fingerprint=stored(images.copy()))  # the same bytes
    with pytest.raises(UserError, match=r"trained on other data \(1000 training images, as then; other pixels in a "
                                        r"sample of the training images\)"):
        check(_checkpoint_like(args, stored(), model), fingerprint=stored(np.zeros_like(images)))
    check(_checkpoint_like(args, stored(mean=(0.5, 0.4, 0.3)), model), fingerprint=stored(mean=(0.505, 0.4, 0.3)))
    with pytest.raises(UserError, match=r"training images of mean \[0.5, 0.4, 0.3\] then, \[0.0, 0.0, 0.0\] now"):
        check(_checkpoint_like(args, stored(mean=(0.5, 0.4, 0.3)), model), fingerprint=stored(mean=(0, 0, 0)))
    # DALI's mean of the whole files and the cache's of its crops differ: a resume with another --loader.
    check(_checkpoint_like(args, stored(mean=(0.5, 0.4, 0.3), mean_of="files"), model),
          fingerprint=stored(mean=(0.3, 0.4, 0.3)))
    other = tu.parse_args("x", ["--batch-size", "512", "--base-lr", "0.02"])
    with pytest.raises(UserError, match=r"--batch-size 256 \(now 512\), --base-lr 0.01 \(now 0.02\); rerun with its "
                                        r"values or start a new --checkpoint-dir$"):  # larger steps: no hint
        check(_checkpoint_like(args, data, model), run_args=other)
    smaller = tu.parse_args("x", ["--batch-size", "64", "--accumulate", "2"])  # a step that did not fit
    with pytest.raises(UserError, match=r"--batch-size 256 \(now 64\); rerun with its values or start a new "
                                        r"--checkpoint-dir; for smaller steps of the same recipe, resume with "
                                        r"--batch-size 256 --accumulate 8$"):
        check(_checkpoint_like(args, data, model), run_args=smaller)
    with pytest.raises(UserError, match=r"trained with --model model:WideResNet, this run has --model my_net.py:Net"):
        mine = tu.parse_args("x", ["--batch-size", "256", "--model", "my_net.py:Net"])
        check(_checkpoint_like(args, data, model), run_args=mine, key="my_net:Net")
    adamw = tu.parse_args("x", ["--batch-size", "256", "--optimizer", "adamw"])
    with pytest.raises(UserError, match=r"^the checkpoint was trained with the optimizer SGD, this run builds AdamW "
                                        r"\(--optimizer adamw, recipe.py\): its state would not fit; resume with "
                                        r"--optimizer sgd"):
        check(_checkpoint_like(args, data, model), run_args=adamw, optimizer_class="AdamW")
    with pytest.raises(UserError, match=r"--optimizer sgd \(now adamw\), --base-lr 0.01 \(now 0.001\), "
                                        r"--momentum 0.9 \(now not given\)"):
        check(_checkpoint_like(args, data, model), run_args=adamw)  # the same class (an edited recipe.py): flags differ
    edited = {**_checkpoint_like(args, data, model), "optimizer_class": "RMSprop"}  # recipe.py's sgd edited
    with pytest.raises(UserError, match=r"^--resume needs the checkpoint's recipe, but recipe.py made another since: "
                                        r"its optimizer RMSprop \(now SGD\); restore recipe.py as it was"):
        check(edited)
    with pytest.raises(UserError, match=r"made another since: its LR scheduler recipe.make_scheduler's MultiStepLR "
                                        r"\(now lr_factor's LambdaLR\); restore"):  # make_scheduler -> None
        check({**_checkpoint_like(args, data, model), "scheduler_class": "MultiStepLR"})
    # recipe.py's code, beyond its flags: the loss class, a per-image transform added or removed.
    prep = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3)
    jitter = replace(prep, per_image=v2.Compose([v2.ColorJitter(0.4)]))
    code = tu.recipe_code(torch.nn.CrossEntropyLoss(label_smoothing=0.1), jitter)
    saved = {**_checkpoint_like(args, data, model), "recipe_code": code}
    check(saved, recipe_code=code)  # unedited
    check(_checkpoint_like(args, data, model), recipe_code=code)  # a checkpoint from before the record: nothing to compare
    with pytest.raises(UserError, match=r"^--resume needs the checkpoint's recipe, but recipe.py made another since: "
                                        r"its loss CrossEntropyLoss \(label_smoothing 0.1\) \(now MSELoss\); restore "
                                        r"recipe.py as it was, or start a new run"):
        check(saved, recipe_code=tu.recipe_code(torch.nn.MSELoss(), jitter))
    with pytest.raises(UserError, match=r"made another since: its per-image transforms Compose\( ColorJitter\("
                                        r"brightness=\(0.6, 1.4\)\)\) \(now none\); restore"):
        check(saved, recipe_code=tu.recipe_code(torch.nn.CrossEntropyLoss(label_smoothing=0.1), prep))
    with pytest.raises(UserError, match=r"its augmentation flip-crop \(flip, pad_crop\) \(now flip-crop \(flip\)\)"):
        check(saved, recipe_code=tu.recipe_code(torch.nn.CrossEntropyLoss(label_smoothing=0.1),
                                                replace(jitter, ops=jitter.ops[:1])))  # AUGMENTATIONS edited
    # Edits in several places of recipe.py: one refusal names them all, not one per try.
    with pytest.raises(UserError, match=r"made another since: its optimizer SGD \(now RMSprop\), LR scheduler "
                                        r"lr_factor's LambdaLR \(now recipe.make_scheduler's MultiStepLR\), loss "
                                        r"CrossEntropyLoss \(label_smoothing 0.1\) \(now MSELoss\), per-image "
                                        r"transforms Compose\( ColorJitter\(brightness=\(0.6, 1.4\)\)\) \(now none\); "):
        check(saved, optimizer_class="RMSprop", scheduler_class="MultiStepLR",
              recipe_code=tu.recipe_code(torch.nn.MSELoss(), prep))
    # A hyperparameter edited in recipe.py: the checkpoint's optimizer state would put the old one back.
    built = "SGD (lr 0.01, momentum 0.9, nesterov True, weight_decay 0.0005)"
    saved = {**_checkpoint_like(args, data, model), "recipe_code": tu.recipe_code(torch.nn.MSELoss(), prep, built)}
    check(saved, recipe_code=tu.recipe_code(torch.nn.MSELoss(), prep, built))
    with pytest.raises(UserError, match=re.escape(f"made another since: its optimizer settings {built} (now "
                                                  f"{built.replace('0.0005', '0.5')}); restore recipe.py")):
        check(saved, recipe_code=tu.recipe_code(torch.nn.MSELoss(), prep, built.replace("0.0005", "0.5")))


def test_metrics_reconcile_keeps_each_epoch_of_the_run_once(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"run_id": "old", "epoch": 1}, {"run_id": "r", "epoch": 1}, {"run_id": "r", "epoch": 2},
             {"run_id": "r", "epoch": 3}]  # epoch 3 was logged, but its checkpoint was lost
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    records = [{"run_id": "r", "epoch": 1}, {"run_id": "r", "epoch": 2}]
    run_log.reconcile_metrics(path, "r", records)
    assert path.read_text().splitlines() == [json.dumps(x) for x in lines[:3]] + ["not json"]
    path.write_text(json.dumps(lines[0]) + "\n")  # the file lost this run's lines
    run_log.reconcile_metrics(path, "r", records)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [lines[0], *records]
    new_file = tmp_path / "new.jsonl"  # resuming into a new metrics file
    run_log.reconcile_metrics(new_file, "r", records)
    assert [json.loads(line) for line in new_file.read_text().splitlines()] == records


def test_epoch_seeds_differ_by_seed_epoch_and_rank():
    found = {seeds.epoch_seed(s, e, r) for s in range(3) for e in range(1, 4) for r in range(4)}
    assert len(found) == 36 and all(0 <= s < 2**63 for s in found)
    assert seeds.epoch_seed(0, 1, 0) == seeds.epoch_seed(0, 1, 0)


def _replica_worker(rank, store, results, perturb):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if perturb == "nan everywhere" or (perturb and rank == 1):
        with torch.no_grad():
            if perturb in ("nan", "nan everywhere"):
                model[1].bias[1] = float("nan")  # everywhere: diverged; on rank 1 alone: corrupted
            else:
                model[1].weight[0, 3] += 1e-7  # one value, barely changed
    try:
        check_replicas_in_sync(model, "after step 7 of epoch 2")
        outcome = "in sync"
    except RunAborted as err:
        outcome = str(err)
    Path(results, f"rank{rank}").write_text(outcome)
    cleanup_distributed()  # as train_ddp.py ends (PyTorch 2.7's gloo could hang in a plain destroy)


@pytest.mark.oldest_torch
@pytest.mark.parametrize("perturb", [False, True, "nan", "nan everywhere"])
def test_replica_check_catches_a_perturbed_rank(tmp_path, perturb):
    spawn(_replica_worker, args=(tmp_path / "store", tmp_path, perturb))
    outcomes = [(tmp_path / f"rank{rank}").read_text() for rank in range(2)]
    if not perturb:
        assert outcomes == ["in sync", "in sync"]
    elif perturb == "nan everywhere":  # DDP gives every rank the same update: a diverged model, not the network
        for outcome in outcomes:
            assert outcome.startswith("NaN/Inf in the model parameters on every rank after step 7 of epoch 2 (first "
                                      "in 1.bias): the training diverged")
            assert "NCCL" not in outcome
    elif perturb == "nan":  # on one rank only: corrupted on the way
        for outcome in outcomes:
            assert outcome.startswith("model parameters on rank(s) [1] differ from rank 0 after step 7 of epoch 2 "
                                      "(NaN/Inf on rank(s) [1] only): the replicas are out of sync")
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
    start = text.index("NETWORK_DEFAULTS=(") + len("NETWORK_DEFAULTS=(")
    block = text[start:text.index(")", start)]
    defaults = dict(line.strip().strip('"').split("=", 1) for line in block.strip().splitlines())
    assert defaults == MULTINODE_SETTINGS


@pytest.mark.oldest_torch
def test_torchvision_loader_with_a_persistent_worker_resumes_exactly(tmp_path):
    """The same guarantee for --loader torchvision: AugmentSampler hands the worker each image's
    seed for its transforms, so neither the worker's life nor the restart changes a pixel."""
    tv_run = (*RUN, "--loader", "torchvision", "--num-workers", "1")
    reference = run(python_cmd("train.py", *tv_run, "--metrics-file", tmp_path / "m_ref.jsonl",
                               "--save-weights", tmp_path / "w_ref.pt"), cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr
    args = (*tv_run, "--metrics-file", tmp_path / "m.jsonl", "--save-weights", tmp_path / "w.pt",
            "--checkpoint-dir", tmp_path / "ckpt")
    assert "(SIGUSR1); checkpoint" in stop_with_sigusr1(args, tmp_path)
    result = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Loader: torchvision DataLoader, 1 worker process per" in result.stdout
    assert_same_run(tmp_path / "m_ref.jsonl", tmp_path / "w_ref.pt", tmp_path / "m.jsonl", tmp_path / "w.pt")


# ---------------------------------------------------------------------------------------------
# Nothing lost in everyday use.

def test_a_new_run_refuses_a_folder_holding_another_runs_checkpoints(tmp_path, reference, capsys):
    folder = tmp_path / "ck"
    shutil.copytree(reference[0].parent / "ckpt", folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    assert run_main("train.py", *RUN, "--seed", "1", "--checkpoint-dir", folder) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --checkpoint-dir {folder} already holds checkpoints of an earlier run (newest: "
        "checkpoint_000000012.pt); continue that run with --resume, or give this run another --checkpoint-dir"]
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before  # untouched


@pytest.mark.parametrize("resume, has_checkpoint, expected", [
    (None, False, False), ("auto", False, False), ("auto", True, True), ("required", True, True)])
def test_continues_run(tmp_path, resume, has_checkpoint, expected):
    if has_checkpoint:
        (tmp_path / "checkpoint_000000004.pt").touch()
    assert checkpoints.continues_run(tmp_path, resume) is expected


def test_resume_without_checkpoints_says_what_is_there(tmp_path):
    """--resume on a folder without checkpoints is refused; when they were all set aside as
    unreadable, the line names them and does not suggest a new run."""
    with pytest.raises(UserError, match=r"no checkpoint in .*, nothing to continue \(--resume=auto starts a new run"):
        checkpoints.continues_run(tmp_path, "required")
    (tmp_path / "checkpoint_000000004.pt.unreadable").touch()
    (tmp_path / "checkpoint_000000008.pt.unreadable").touch()
    with pytest.raises(UserError) as refused:
        checkpoints.continues_run(tmp_path, "required")
    assert str(refused.value) == (f"--resume: no readable checkpoint in {tmp_path}: 2 were set aside as unreadable "
                                  "(newest: checkpoint_000000008.pt.unreadable); see docs/checkpoints.md")


@pytest.mark.parametrize("cut", [1000, 10_000])
def test_a_checkpoint_cut_short_is_the_files_fault_not_the_nodes(tmp_path, cut):
    """torch's zip reader says OSError(EINVAL) of a file cut to about 5-70 kB, RuntimeError
    otherwise: either is a damaged file, set aside for the previous checkpoint, not an error of
    the node that would stop every resume."""
    good = {"format": checkpoints.CHECKPOINT_FORMAT, "weights": torch.arange(100_000.0)}
    torch.save(good, tmp_path / "checkpoint_000000004.pt")
    torch.save(good, tmp_path / "checkpoint_000000008.pt")
    newest = tmp_path / "checkpoint_000000008.pt"
    newest.write_bytes(newest.read_bytes()[:cut])
    said = []
    path, checkpoint = checkpoints.choose_checkpoint(tmp_path, _Said(said))
    assert path.name == "checkpoint_000000004.pt" and torch.equal(checkpoint["weights"], good["weights"])
    assert (tmp_path / "checkpoint_000000008.pt.unreadable").exists() and len(said) == 1


class _Said:
    """A log whose lines go to a list."""

    def __init__(self, lines):
        self.info = lines.append


def test_resume_auto_starts_no_new_run_over_checkpoints_set_aside(tmp_path):
    """Checkpoints all set aside as unreadable are a run's folder, not an empty one: a new run
    there would take the run's model_best.pt for its own and replace it."""
    (tmp_path / "checkpoint_000000008.pt.unreadable").touch()
    with pytest.raises(UserError) as refused:
        checkpoints.continues_run(tmp_path, "auto")
    assert str(refused.value) == (f"--resume=auto: no readable checkpoint in {tmp_path}: 1 was set aside as "
                                  "unreadable (newest: checkpoint_000000008.pt.unreadable), so no new run starts "
                                  "there: move it away first, or give this run another --checkpoint-dir; see "
                                  "docs/checkpoints.md")
    (tmp_path / "checkpoint_000000004.pt").touch()  # a readable one beside it: the run continues
    assert checkpoints.continues_run(tmp_path, "auto") is True


@pytest.mark.parametrize("flag", ["--save-weights", "--metrics-file"])
def test_an_output_under_a_name_the_checkpoint_folder_keeps_is_refused(tmp_path, flag):
    with pytest.raises(UserError) as refused:
        checkpoints.check_not_the_folders_own(tmp_path / "model_best.pt", tmp_path, flag)
    hint = f" (the job scripts write their weights to {tmp_path / 'weights.pt'})" if flag == "--save-weights" else ""
    assert str(refused.value) == (f"{flag} {tmp_path / 'model_best.pt'}: --checkpoint-dir {tmp_path} keeps the best "
                                  f"epoch's weights under that name; give {flag} another{hint}")
    checkpoints.check_not_the_folders_own(tmp_path / "weights.pt", tmp_path, flag)  # a name of its own: fine


def test_a_new_run_never_starts_over_checkpoints(tmp_path):
    (tmp_path / "checkpoint_000000004.pt").touch()
    with pytest.raises(UserError, match="already holds checkpoints of an earlier run"):
        checkpoints.continues_run(tmp_path, None)


class _TinyRun:
    """What Checkpointer.save reads of a train_utils.Run, for a small model."""

    def __init__(self, directory):
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)
        self.task = SimpleNamespace(data=SimpleNamespace(fingerprint={}), model_key="test:linear", loader="torchvision")
        self.ctx = DistContext(device=torch.device("cpu"))
        self.ema = None

    def trained(self, record=None):
        return self.module

    def weights_metadata(self, record=None):
        return {"model": "test:linear"}

    def recipe_code(self):
        return {"loss": "MSELoss"}


def test_model_best_is_replaced_only_by_better_weights_also_after_a_restart(tmp_path):
    """model_best.pt: an epoch's weights when they validate better than the file's; a new
    Checkpointer on the folder (a resume after kill -9, a requeued job) starts from the
    accuracy the file records, so a worse epoch never replaces it."""
    ctx = DistContext(device=torch.device("cpu"))
    first, second, third = (torch.nn.Linear(2, 2) for _ in range(3))
    checkpointer = checkpoints.Checkpointer(tmp_path, 0, ctx, {})
    assert checkpointer.best == -1.0  # no file yet
    checkpointer.keep_best(0.5, first, {"val_accuracy": 0.5, "epoch": 1})
    checkpointer.keep_best(0.4, second, {"val_accuracy": 0.4, "epoch": 2})  # worse: kept as it was
    saved = weights_file.read_weights(tmp_path / "model_best.pt")
    assert saved.metadata["epoch"] == 1 and torch.equal(saved.state["weight"], first.weight)
    again = checkpoints.Checkpointer(tmp_path, 0, ctx, {})  # the run restarted from an older checkpoint
    assert again.best == 0.5
    again.keep_best(0.45, third, {"val_accuracy": 0.45, "epoch": 2})
    assert weights_file.read_weights(tmp_path / "model_best.pt").metadata["epoch"] == 1
    again.keep_best(0.6, third, {"val_accuracy": 0.6, "epoch": 3})
    saved = weights_file.read_weights(tmp_path / "model_best.pt")
    assert saved.metadata["epoch"] == 3 and torch.equal(saved.state["weight"], third.weight)



def test_model_best_of_another_model_or_data_set_is_refused_and_kept(tmp_path):
    """--resume=auto in a folder whose run left model_best.pt and no checkpoint: a requeued
    job's new start takes its accuracy to beat (above); a run of another --model or --dataset
    would replace that run's best weights, or leave them as its own: refused, the file kept."""
    ctx = DistContext(device=torch.device("cpu"))
    theirs = torch.nn.Linear(2, 2)
    checkpoints.Checkpointer(tmp_path, 0, ctx, {}).keep_best(
        0.5, theirs, {"val_accuracy": 0.5, "epoch": 1, "model": "slow_net:Net", "dataset": "mnist"})
    before = (tmp_path / "model_best.pt").read_bytes()
    same = checkpoints.Checkpointer(tmp_path, 0, ctx, {}, new_run={"model": "slow_net:Net", "dataset": "mnist"})
    assert same.best == 0.5  # the same job, started again
    for model, dataset in (("my_net:Net", "mnist"), ("slow_net:Net", "cifar10")):
        with pytest.raises(UserError, match=f"^--checkpoint-dir {tmp_path} holds model_best.pt of another run "
                                            f"\\(--model slow_net:Net on --dataset mnist; this run: --model "
                                            f"{model} on --dataset {dataset}\\): move it elsewhere"):
            checkpoints.Checkpointer(tmp_path, 0, ctx, {}, new_run={"model": model, "dataset": dataset})
        assert checkpoints.Checkpointer(tmp_path, 0, ctx, {}).best == 0.5  # continuing: its checkpoint is checked
    assert (tmp_path / "model_best.pt").read_bytes() == before


def test_model_best_of_a_run_of_other_flags_is_refused_and_kept(tmp_path):
    """The same model and data set, other flags (a folder reused after its checkpoints were
    deleted, another run's model_best.pt copied in): --resume=auto would have replaced that
    run's best weights with a better epoch of its own, or called them its own. A run of the
    same defining flags (the requeued job) takes the file's accuracy to beat; a flag the file
    does not record (older than the flag) is not compared."""
    ctx, run = DistContext(device=torch.device("cpu")), {"model": "slow_net:Net", "dataset": "mnist"}
    flags = {"optimizer": "adamw", "seed": 5, "base_lr": 0.001, "batch_size": 32, "epochs": 1}
    defining = ("optimizer", "seed", "base_lr", "batch_size")
    checkpoints.Checkpointer(tmp_path, 0, ctx, flags, defining=defining).keep_best(
        0.5, torch.nn.Linear(2, 2), {"val_accuracy": 0.5, "epoch": 1, **run})
    before = (tmp_path / "model_best.pt").read_bytes()
    assert weights_file.read_weights(tmp_path / "model_best.pt").metadata["run_flags"] == {
        "optimizer": "adamw", "seed": 5, "base_lr": 0.001, "batch_size": 32}
    requeued = {**flags, "epochs": 3}  # --epochs does not define the run: a larger one extends it
    assert checkpoints.Checkpointer(tmp_path, 0, ctx, requeued, new_run=run, defining=defining).best == 0.5
    newer_flag = {**flags, "model_ema": True}
    assert checkpoints.Checkpointer(tmp_path, 0, ctx, newer_flag, new_run=run, defining=(*defining, "model_ema")).best \
        == 0.5
    other = {**flags, "optimizer": "sgd", "seed": 0, "base_lr": 0.1, "batch_size": 64}
    with pytest.raises(UserError, match=f"^--checkpoint-dir {tmp_path} holds model_best.pt of a run of other flags "
                                        r"\(--optimizer adamw \(now sgd\), --seed 5 \(now 0\), "
                                        r"--base-lr 0.001 \(now 0.1\), ...\), which this run would replace or "
                                        "take for its own: move it elsewhere"):
        checkpoints.Checkpointer(tmp_path, 0, ctx, other, new_run=run, defining=defining)
    assert (tmp_path / "model_best.pt").read_bytes() == before


@pytest.mark.parametrize("kind", ["text", "state_dict"])
def test_a_model_best_no_run_wrote_is_refused_and_kept(tmp_path, capsys, kind):
    """A model_best.pt in --checkpoint-dir that keep_best cannot have written (it writes
    atomically, with the accuracy): a user's own weights, or a text file. The job scripts'
    --resume=auto started a new run there and its first epoch replaced the file."""
    best = tmp_path / "ck" / "model_best.pt"
    best.parent.mkdir()
    if kind == "text":
        best.write_text("my notes\n")
    else:
        torch.save(torch.nn.Linear(2, 2).state_dict(), best)
    before = best.read_bytes()
    why = ("is not a readable state_dict: not a file torch.save wrote, or a damaged one" if kind == "text"
           else "records no validation accuracy, so no run of these scripts wrote it (your own weights?)")
    assert run_main("train.py", *RUN, "--checkpoint-dir", best.parent, "--resume=auto") == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --checkpoint-dir {best.parent}: its model_best.pt {why}; this run keeps its best epoch's weights "
        "under that name: move it elsewhere, or give this run another --checkpoint-dir"]
    assert best.read_bytes() == before and sorted(p.name for p in best.parent.iterdir()) == ["model_best.pt"]


def test_pruning_keeps_this_runs_newest_two_and_never_touches_other_files(tmp_path):
    foreign = [tmp_path / "checkpoint_000000001.pt", tmp_path / "checkpoint_000000099.pt"]
    for path in foreign:
        path.write_bytes(b"another run's")
    run, state = _TinyRun(tmp_path), tu.TrainState(run_id="r")
    checkpointer = checkpoints.Checkpointer(tmp_path, 0, run.ctx, {})
    paths = []
    for _ in range(3):
        run.optimizer.step()
        run.scheduler.step()
        paths.append(checkpointer.save(run, state))
    assert [p.name for p in paths] == ["checkpoint_000000001.pt", "checkpoint_000000002.pt",
                                       "checkpoint_000000003.pt"]
    assert not paths[0].exists() and paths[1].exists() and paths[2].exists()
    assert foreign[1].read_bytes() == b"another run's"  # a higher step of another run stays
    assert state.checkpoints == ["checkpoint_000000002.pt", "checkpoint_000000003.pt"]
    assert torch.load(paths[2], weights_only=True)["state"]["checkpoints"] == state.checkpoints
    assert checkpointer.save(run, state) == paths[2] and checkpointer.count == 3  # the same step: not again
    assert not list(tmp_path.glob(".*tmp*"))


def test_a_checkpoint_too_slow_for_a_signals_grace_is_a_warning_once(tmp_path, monkeypatch):
    """torchrun and Slurm give 30 s after a signal: a checkpoint that takes most of that is
    named once, with the way out (--stop-file)."""
    run, state, warnings = _TinyRun(tmp_path), tu.TrainState(run_id="r"), []
    checkpointer = checkpoints.Checkpointer(tmp_path, 0, run.ctx, {}, warnings.append)
    run.optimizer.step(), run.scheduler.step()
    checkpointer.save(run, state)
    assert warnings == []  # a tiny model writes in milliseconds
    monkeypatch.setattr(checkpoints, "SLOW_CHECKPOINT_S", -1.0)  # as if every write took longer than that
    for _ in range(2):
        run.optimizer.step(), run.scheduler.step()
        checkpointer.save(run, state)
    [warning] = warnings
    assert re.fullmatch(r"WARNING: checkpoint checkpoint_000000002\.pt took \d+ s to write; after a stop signal "
                        r"\(scancel, Ctrl-C through torchrun\) processes get 30 s before SIGKILL, .* stop with "
                        r"--stop-file, which the job scripts use, or give --checkpoint-dir a faster disk", warning)


def test_checkpoints_are_due_every_interval_at_most(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(checkpoints.time, "monotonic", lambda: now[0])
    checkpointer = checkpoints.Checkpointer(tmp_path, 2, DistContext(device=torch.device("cpu")), {})  # 2 minutes
    now[0] += 119
    assert not checkpointer.due()
    now[0] += 1
    assert checkpointer.due()
    assert checkpoints.Checkpointer(tmp_path, 0, DistContext(device=torch.device("cpu")), {}).due()  # 0: every epoch


def test_default_interval_checkpoints_at_the_end_and_on_stop_not_every_epoch(tmp_path):
    i = RUN.index("--checkpoint-interval")
    args = RUN[:i] + RUN[i + 2:]  # the default interval
    result = run(python_cmd("train.py", *args, "--checkpoint-dir", tmp_path / "ck"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["checkpoint_000000012.pt",  # the finished run
                                                                    "model_best.pt"]
    assert "Checkpoints: 1 written to" in result.stdout
    assert "at the end of an epoch at most every 5 min, on a stop request and at the end" in result.stdout
    again = run(python_cmd("train.py", *args, "--checkpoint-dir", tmp_path / "ck", "--resume=auto"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "is complete (epoch 3): nothing to train" in again.stdout and "Epoch 1/3" not in again.stdout


def test_stop_file_stops_with_exit_status_0(tmp_path, monkeypatch):
    monkeypatch.setattr(stopping, "STOP_FILE_POLL_S", 0.01)
    stop_file = tmp_path / "STOP"
    ctx = DistContext(device=torch.device("cpu"))
    with stopping.StopRequests(ctx, stop_file) as stop:
        assert stop.agreed() == stopping.NO_STOP
        stop_file.touch()  # seen by the thread that looks for it, not in a step
        deadline = time.time() + 10
        while not stop.file_seen and time.time() < deadline:
            time.sleep(0.01)
        assert stop.agreed() == stopping.STOP_FILE
        stopped = stop.stopped(stopping.STOP_FILE, "after step 3 of epoch 2", tmp_path / "checkpoint_000000007.pt")
    assert stopped.exit_code == 0 and not stop_file.exists()  # acted on: removed (what the job scripts look at)
    assert str(stopped) == (f"Stopped after step 3 of epoch 2 (--stop-file {stop_file}); checkpoint "
                            f"{tmp_path / 'checkpoint_000000007.pt'}: continue with --resume")
    with stopping.StopRequests(ctx, stop_file) as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # a signal outranks the file
        assert stop.agreed() == stopping.STOP_SIGNAL
        assert stop.stopped(stopping.STOP_SIGNAL, "after epoch 1", None).exit_code == EXIT_STOPPED


def _agreement_worker(rank, store, folder, signal_step, slow_step):
    """Up to ten steps of the per-step stop agreement: rank 1 gets SIGUSR1 in ``signal_step``
    and takes 1.5 s over ``slow_step``. Records per step what after_step agreed and how long
    it took on this rank."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = DistContext(device=torch.device("cpu"), rank=rank, world_size=2, process_group=True)
    seen = []
    try:
        with stopping.StopRequests(ctx) as stop:
            for step in range(1, 11):
                if rank == 1 and step == signal_step:
                    os.kill(os.getpid(), signal.SIGUSR1)
                if rank == 1 and step == slow_step:
                    time.sleep(1.5)
                start = time.perf_counter()
                agreed = stop.after_step()
                seen.append([step, agreed, time.perf_counter() - start])
                if agreed:
                    break
            stop.drain()
    finally:
        cleanup_distributed()  # PyTorch 2.7's gloo could hang in a plain destroy
    (folder / f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.mark.oldest_torch
def test_a_stop_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    spawn(_agreement_worker, args=(tmp_path / "store", tmp_path, 3, None))
    seen = [[(step, agreed) for step, agreed, _ in json.loads((tmp_path / f"rank{rank}.json").read_text())]
            for rank in range(2)]
    # Rank 1's signal in step 3 is agreed during step 4: both ranks stop after step 4, as for a signal.
    expected = [(1, stopping.NO_STOP), (2, stopping.NO_STOP), (3, stopping.NO_STOP), (4, stopping.STOP_SIGNAL)]
    assert seen == [expected, expected]


def test_a_slow_step_on_one_rank_does_not_hold_the_others_in_that_step(tmp_path):
    """The agreement read after step 3 was started after step 2: rank 0 does not wait there for
    rank 1's slow step 3 (a blocking agreement would wait 1.5 s); it waits one step later."""
    spawn(_agreement_worker, args=(tmp_path / "store", tmp_path, None, 3))
    waits = [wait for _, _, wait in json.loads((tmp_path / "rank0.json").read_text())]
    assert len(waits) == 10 and waits[2] < 0.5 and waits[3] > 1.0, waits


def test_an_evaluation_given_the_job_scripts_resume_auto_reads_no_checkpoint(tmp_path, capsys):
    """The job scripts add --checkpoint-dir DIR --resume=auto to every run: an evaluation in a
    folder of a training run with other flags was refused as a resume with other flags."""
    weights = tmp_path / "ck" / "weights.pt"
    assert run_main("train.py", *RUN, "--checkpoint-dir", tmp_path / "ck", "--save-weights", weights) == 0
    capsys.readouterr()
    assert run_main("train.py", *RUN, "--batch-size", "16", "--eval-only", "--weights", weights,
                    "--checkpoint-dir", tmp_path / "ck", "--resume=auto", "--profile-dir", tmp_path / "prof") == 0
    out = capsys.readouterr().out
    assert "Evaluation: Loss=" in out and not (tmp_path / "prof").exists()
    assert f"\nNote: --profile-dir {tmp_path / 'prof'} is not written: --eval-only trains nothing\n" in out
    # --batch-size applies to evaluation; RUN's length of training does not
    assert "\nNote: --epochs 3, --checkpoint-interval 0 have no effect: --eval-only trains nothing\n" in out
    assert f"\nNote: --checkpoint-dir {tmp_path / 'ck'} is not written: --eval-only trains nothing\n" in out


def test_an_evaluation_says_which_training_flags_it_does_not_use(tmp_path, capsys):
    """A training command line with --eval-only added: its recipe has no effect, and says so
    (given other than its defaults; --batch-size and --augment apply)."""
    weights = tmp_path / "weights.pt"
    assert run_main("train.py", *RUN, "--save-weights", weights) == 0
    capsys.readouterr()
    assert run_main("train.py", *RUN, "--eval-only", "--weights", weights, "--optimizer", "adamw", "--base-lr", "0.5",
                    "--model-ema", "--augment", "flip-crop") == 0
    out = capsys.readouterr().out
    assert ("\nNote: --optimizer adamw, --base-lr 0.5, --model-ema, --epochs 3, --checkpoint-interval 0 have no "
            "effect: --eval-only trains nothing\n") in out  # RUN's length flags too
    assert run_main("train.py", "--synthetic", "--limit-batches", "4", "--batch-size", "4", *FAST, *TINY_MODEL,
                    "--eval-only", "--weights", weights, "--no-nesterov", "--checkpoint-dir", tmp_path / "ck") == 0
    out = capsys.readouterr().out
    assert "\nNote: --no-nesterov has no effect: --eval-only trains nothing\n" in out
    assert f"\nNote: --checkpoint-dir {tmp_path / 'ck'} is not written: --eval-only trains nothing\n" in out
    assert not (tmp_path / "ck").exists()


def test_eval_only_needs_weights(capsys):
    assert run_main("train.py", "--synthetic", "--eval-only") == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "--eval-only needs --weights PATH" in line


def _resume_worker(rank, store, folder, results, unreadable_rank):
    """Rank ``unreadable_rank`` cannot read the newest checkpoint (a file system that lags, an
    I/O error); every rank reports which file it loaded or the error it stopped with."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    newest = sorted(Path(folder).glob("checkpoint_*.pt"))[-1]
    real_load = torch.load
    if rank == unreadable_rank:
        def flaky_load(path, *args, **kwargs):
            if Path(path) == newest:
                raise OSError(5, "Input/output error")
            return real_load(path, *args, **kwargs)
        checkpoints.torch.load = flaky_load
    ctx = DistContext(device=torch.device("cpu"), rank=rank, world_size=2, process_group=True)
    try:
        path, checkpoint = checkpoints.load_agreed_checkpoint(folder, ctx, run_log.RunLogger(rank == 0))
        outcome = f"loaded {path.name} step {checkpoint['scheduler']['last_epoch']}"
    except UserError as err:
        outcome = f"error: {err}"
    Path(results, f"rank{rank}").write_text(outcome)
    cleanup_distributed()  # as train_ddp.py ends (PyTorch 2.7's gloo could hang in a plain destroy)


@pytest.mark.oldest_torch
@pytest.mark.parametrize("unreadable_rank", [0, 1])
def test_every_rank_loads_the_checkpoint_rank_0_chose(tmp_path, reference, unreadable_rank):
    folder = tmp_path / "ck"
    shutil.copytree(reference[0].parent / "ckpt", folder)
    spawn(_resume_worker, args=(tmp_path / "store", folder, tmp_path, unreadable_rank))
    outcomes = [(tmp_path / f"rank{rank}").read_text() for rank in range(2)]
    assert outcomes[0] == outcomes[1]
    if unreadable_rank == 1:  # rank 0 reads the newest: rank 1 must not fall back on its own
        assert outcomes[0].startswith("error: --resume: rank(s) [1] cannot read ")
        assert "checkpoint_000000012.pt, the checkpoint rank 0 chose (rank 1: OSError" in outcomes[0]
    else:  # the node's error, not the file's: no rank falls back to the older one, nothing is renamed
        assert outcomes[0] == (f"error: --resume: cannot read {folder / 'checkpoint_000000012.pt'} (OSError: [Errno 5] "
                               "Input/output error); it is left in place and no older checkpoint is tried: run again "
                               "once it can be read (the same command continues)")
    assert sorted(path.name for path in folder.glob("checkpoint_*")) == ["checkpoint_000000008.pt",
                                                                        "checkpoint_000000012.pt"]


def test_unwritable_outputs_fail_at_start_and_nothing_is_created(tmp_path):
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(UserError, match="--metrics-file .*not a writable file path .it is a folder."):
        files.check_writable(tmp_path / "a_dir", "--metrics-file")
    (tmp_path / "a_file").write_text("keep me")
    with pytest.raises(UserError, match=f"--save-weights .*cannot create its folder .*{tmp_path / 'a_file'} is a file"):
        files.check_writable(tmp_path / "a_file" / "sub" / "w.pt", "--save-weights")
    with pytest.raises(UserError, match=f"^--save-weights {tmp_path / 'a_file' / 'w.pt'}: cannot create its folder "
                                        f"{tmp_path / 'a_file'} .a file of that name exists.$"):
        files.check_writable(tmp_path / "a_file" / "w.pt", "--save-weights")
    with pytest.raises(UserError, match=f"^--checkpoint-dir {tmp_path / 'a_file' / 'ck'}: cannot create it "):
        files.check_writable_dir(tmp_path / "a_file" / "ck", "--checkpoint-dir")
    with pytest.raises(UserError, match="cannot create it .a file of that name exists."):
        files.check_writable_dir(tmp_path / "a_file", "--checkpoint-dir")
    if os.path.isdir("/proc"):  # a file system whose folders take no files: blamed as such, not as missing
        with pytest.raises(UserError, match=r"^--checkpoint-dir /proc/ck: cannot create it \(/proc takes no new files"):
            files.check_writable_dir("/proc/ck", "--checkpoint-dir")
    files.check_writable_dir(tmp_path / "new" / "ck", "--checkpoint-dir")  # fine, and created by the first write
    with pytest.raises(UserError, match=f"^--metrics-file {tmp_path / 'ck'} is the folder of --checkpoint-dir: give "
                                        "--metrics-file a file's name"):  # not made yet: each epoch's line lost
        files.check_outputs({"--metrics-file": str(tmp_path / "ck")}, {"--checkpoint-dir": str(tmp_path / "ck")})
    files.check_writable(tmp_path / "new2" / "m.jsonl", "--metrics-file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"]
    assert (tmp_path / "a_file").read_text() == "keep me"
    files.atomic_save({"x": 1}, tmp_path / "new" / "ck" / "w.pt")
    assert torch.load(tmp_path / "new" / "ck" / "w.pt") == {"x": 1}


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_folder_without_permission_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(UserError, match=r"cannot create it \(.*/ro: Permission denied\)"):
        files.check_writable_dir(tmp_path / "ro" / "ck", "--checkpoint-dir")


def _gone(pid):
    """True when ``pid`` has exited (a zombie waiting for a parent that never reaps it counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.oldest_torch
def test_ranks_whose_torchrun_is_killed_stop_with_a_checkpoint(tmp_path):
    """torchrun starts each rank in a session of its own: a signal to torchrun's process group
    (a user's kill) ends torchrun alone. Its orphaned ranks must not train on unseen."""
    args = (*RUN[:1], "--epochs", "200", *RUN[3:], "--checkpoint-dir", tmp_path / "ckpt")
    process = start(torchrun_cmd(2, "train_ddp.py", *args), tmp_path, tmp_path / "log")
    wait_for(tmp_path / "log", "Epoch 1/200:", process)
    ranks = [_rank_pid(process.pid, rank) for rank in range(2)]
    try:
        os.killpg(process.pid, signal.SIGUSR1)  # kills torchrun (no handler for it); not its ranks
        assert process.wait(timeout=30) == -signal.SIGUSR1
        deadline = time.time() + 60
        while not all(_gone(pid) for pid in ranks):
            assert time.time() < deadline, "the orphaned ranks train on"
            time.sleep(0.2)
    finally:
        for pid in ranks:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    log = (tmp_path / "log").read_text()
    # The ranks see torchrun gone within a step; with 4 steps an epoch that may be at the epoch's end. Rank 0
    # prints the line: its own finding, or rank 1's (both lost the same torchrun) when rank 1 saw it first.
    match = re.search(r"^Stopped after (?:step (\d) of epoch (\d+)|epoch (\d+)) \((?:torchrun, its launcher, has "
                      r"exited|a stop request on another rank)\); checkpoint (.*/checkpoint_\d+\.pt): continue with "
                      r"--resume$", log, re.M)
    assert match, log
    step, epoch = (int(match[1]), int(match[2])) if match[1] else (0, int(match[3]) + 1)
    assert epoch < 200 and Path(match[4]).exists()
    state = torch.load(match[4], weights_only=True)["state"]
    assert (state["step"], state["epoch"]) == (step, epoch)


@pytest.mark.oldest_torch
@pytest.mark.parametrize("how", ["frozen", "killed"])
def test_a_frozen_or_killed_rank_ends_the_run_promptly_with_one_line(tmp_path, how):
    """SIGSTOP (a frozen node, a stuck file system) or SIGKILL (the out-of-memory killer) of
    rank 1 mid-run: rank 0 stops within --collective-timeout plus a margin with one line
    naming rank 1, its host and PID and how it ended, before torchrun's report; the
    checkpoints stay."""
    args = (*RUN[:1], "--epochs", "200", *RUN[3:], "--checkpoint-dir", tmp_path / "ckpt", "--collective-timeout",
            "0.1")
    process = start(torchrun_cmd(2, "train_ddp.py", *args), tmp_path, tmp_path / "log")
    wait_for(tmp_path / "log", "Epoch 2/200:", process)  # a checkpoint after epochs 1 and 2
    rank1 = _rank_pid(process.pid, 1)
    try:
        os.kill(rank1, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
        stopped = time.monotonic()
        wait_for(tmp_path / "log", "error: ", process, timeout=6 + 6 + 30)  # the timeout, the roll call, a margin
        elapsed = time.monotonic() - stopped
    finally:
        if not _gone(rank1):
            os.kill(rank1, signal.SIGKILL)  # instead of torchrun's 30 s of grace for a stopped process
    process.wait(timeout=60)
    assert process.returncode != 0
    log = (tmp_path / "log").read_text()
    [line] = error_lines(log)
    who = f"error: rank 1 (pid {rank1} on {socket.gethostname()}) "
    if how == "frozen":  # rank 0 timed out in the stop agreement and asked who is still there
        # timed out in the stop agreement, or (rarely, under load) in DDP's gradient all-reduce
        frozen = who + "is stopped (SIGSTOP or a debugger) ("
        assert line.startswith((frozen + "Timed out waiting 6000ms for ",
                                frozen + "Application timeout caused pair closure")), line
    else:  # rank 0 lost the connection at once; rank 1's exit status is in /proc until torchrun collects it
        assert (line.startswith(who + "was killed by SIGKILL (the kernel's out-of-memory killer sends it, and kill "
                                      "-9) (")
                or line.startswith(who + "died without a word: killed (SIGKILL: the kernel's out-of-memory killer, "
                                         "kill -9) or crashed in native code (")), line
        assert elapsed < 30
    kept = sorted((tmp_path / "ckpt").glob("checkpoint_*.pt"))
    assert line.endswith("; --collective-timeout 0.1 min): stopping every rank; the checkpoints written so far "
                         f"are kept (newest: {kept[-1]}), continue with --resume")
    assert log.index(line) < log.index("ChildFailedError")  # before torchrun's report
    assert f'File "{REPO}' not in log  # no traceback through this project's code (torchrun prints its own)
    assert kept and all(torch.load(path, weights_only=True)["format"] == checkpoints.CHECKPOINT_FORMAT for path in kept)


def test_a_lost_rank_line_says_what_is_kept_and_resume_only_where_there_is_something(tmp_path):
    assert lost_ranks.kept_checkpoints(None) == "nothing is saved (no --checkpoint-dir)"
    assert lost_ranks.kept_checkpoints(tmp_path / "ck") == (
        f"no checkpoint was written yet (--checkpoint-dir {tmp_path / 'ck'})")
    (tmp_path / "ck").mkdir()
    for step in (4, 8):
        (tmp_path / "ck" / f"checkpoint_{step:09d}.pt").touch()
    assert lost_ranks.kept_checkpoints(tmp_path / "ck") == (
        f"the checkpoints written so far are kept (newest: {tmp_path / 'ck' / 'checkpoint_000000008.pt'}), continue "
        "with --resume")


def test_a_lost_rank_that_said_why_is_not_named_again_and_one_that_did_not_is():
    here = lost_ranks.Whereabouts("node-1", 3564)
    quiet = lost_ranks.MissingRank(1, here, "has exited")
    assert quiet.gone and quiet.describe() == ("rank 1 (pid 3564 on node-1) died without a word: killed (SIGKILL: "
                                               "the kernel's out-of-memory killer, kill -9) or crashed in native code")
    assert not lost_ranks.MissingRank(1, here, None, said=True).gone  # alive still: waited for, not left to torchrun
    assert not lost_ranks.MissingRank(1, here, "is stopped (SIGSTOP or a debugger)").gone
    assert lost_ranks.MissingRank(2).describe() == "rank 2 stopped responding"


@pytest.mark.parametrize("stat, expected", [
    ("Z 1 1 1" + " 0" * 45 + " 9", "was killed by SIGKILL (the kernel's out-of-memory killer sends it, and kill -9)"),
    ("Z 1 1 1" + " 0" * 45 + " 256", "exited with status 1"),
    ("T 1 1 1" + " 0" * 46, "is stopped (SIGSTOP or a debugger)"),
    ("D 1 1 1" + " 0" * 46, "is stuck in the kernel (state D: a file system or driver call)"),
    ("S 1 1 1" + " 0" * 46, None),
    (None, "has exited"),
])
def test_the_fate_of_a_lost_rank_on_this_node_is_read_from_proc(tmp_path, stat, expected):
    """/proc/PID/stat as the kernel writes it (a command name with spaces and parentheses,
    the wait status in field 52); a rank on another host has no fate seen from here."""
    if stat is not None:
        (tmp_path / "77").mkdir()
        (tmp_path / "77" / "stat").write_text(f"77 (python (a b)) {stat}\n")
    here = lost_ranks.Whereabouts(socket.gethostname(), 77)
    assert lost_ranks.fate(here, proc=tmp_path) == expected
    assert lost_ranks.fate(here._replace(host="elsewhere"), proc=tmp_path) is None


def test_a_finished_run_is_extended_by_a_larger_epochs_and_never_shortened(tmp_path, capsys):
    args = (*RUN, "--checkpoint-dir", tmp_path / "ck", "--metrics-file", tmp_path / "m.jsonl")
    assert run(python_cmd("train.py", *args), cwd=tmp_path).returncode == 0
    longer = run(python_cmd("train.py", *args, "--resume", "--epochs", "5"), cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr
    assert ("Extending the run from 3 to 5 epochs: warm restart of the learning rate from 0 back up to 0.01 over 2 "
            "steps (0.5 epochs), then cosine to 0 at epoch 5") in longer.stdout
    assert "Epoch 4/5:" in longer.stdout and "Epoch 3/" not in longer.stdout
    records = read_metrics(tmp_path / "m.jsonl")
    assert [(r["epoch"], r["epochs"], r["lr_cycle"]) for r in records] == [(1, 3, 1), (2, 3, 1), (3, 3, 1),
                                                                           (4, 5, 2), (5, 5, 2)]
    # The LR of each epoch's last step: near 0 at the end of the first cosine, near the top
    # again after the restart's warm-up, then down its own cosine.
    assert records[3]["lr"] > 5 * records[2]["lr"] and records[4]["lr"] < records[3]["lr"] / 5
    newest = sorted((tmp_path / "ck").glob("checkpoint_*.pt"))[-1]
    assert torch.load(newest, weights_only=True)["state"]["lr_cycles"] == [[0, 8, 12, 0.0], [12, 2, 20, 0.0]]
    assert run_main("train.py", *args, "--resume", "--epochs", "4") == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "--epochs 5 (now 4: a run can be extended with a larger --epochs, not shortened)" in line
    again = run(python_cmd("train.py", *args, "--resume", "--epochs", "5"), cwd=tmp_path)
    assert "is complete (epoch 5): nothing to train" in again.stdout
    # No --epochs: the run's own 5, not the default's 100 (a new user's walk: 95 epochs more, and
    # the finished run's checkpoints pruned).
    given = [arg for i, arg in enumerate(args) if "--epochs" not in (arg, args[i - 1])]
    assert run_main("train.py", *given, "--resume") == 0
    out = capsys.readouterr().out
    assert "is complete (epoch 5): nothing to train" in out and "Extending" not in out
    assert "Length: 5 epochs" in out


@pytest.mark.oldest_torch
def test_nccl_flight_recorder_dumps_go_to_the_checkpoint_folder_under_the_names_this_torch_reads():
    old = device_utils.flight_recorder_settings("ck", "2.7.1")
    new = device_utils.flight_recorder_settings("ck", "2.15.0")
    assert old == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "ck/nccl_trace_rank_"}
    assert new == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": "ck/nccl_trace_rank_"}
    assert device_utils.flight_recorder_settings("ck", "2.8.0a0+5228986c39") == old  # NGC 25.06's prerelease


def _library_strings(folder, pattern="*.so*"):
    """Whether each name is a string in the shared libraries of ``folder``: what a C++ getenv
    or getCvar reads. mmap: the libraries are hundreds of megabytes."""
    import mmap

    def holds(name):
        for path in Path(folder).glob(pattern):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(name.encode() + b"\0") >= 0:
                    return True
        return False
    return holds


@pytest.mark.oldest_torch
def test_every_variable_the_project_sets_is_read_by_the_installed_libraries():
    """A renamed variable is silently ignored: each TORCH_* name the project sets (the flight
    recorder's for this torch, the job scripts' and the docs' error handling, check_network's
    blocking wait) must be in this
    torch's libraries, and each NCCL_* name in the NCCL it ships, where there is one."""
    torch_lib = Path(torch.__file__).parent / "lib"
    if not list(torch_lib.glob("libtorch_cuda*.so")):
        pytest.skip("a CPU-only torch build holds no NCCL code")
    torch_reads = _library_strings(torch_lib)
    names = {*device_utils.flight_recorder_settings("ck"), *all_reduce_timing.NCCL_ERRORS_RAISE,
             "TORCH_NCCL_ASYNC_ERROR_HANDLING", "GLOO_SOCKET_IFNAME"}
    names |= {name for script in REPO.glob("*_job.sh") for name in re.findall(r"\bexport (TORCH_\w+)=",
                                                                              script.read_text())}
    assert {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"} <= names and len(names) >= 4
    assert [name for name in sorted(names) if not torch_reads(name)] == []
    assert not torch_reads("TORCH_NO_SUCH_VARIABLE")  # the check itself can fail
    # What check_network relies on blocking wait for, and the timeout text lost_ranks shortens.
    behaviour = ["TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created.",
                 "Watchdog caught collective operation timeout: ", " milliseconds before timing out.", "OpType="]
    assert [text for text in behaviour if not torch_reads(text)] == []
    nccl = [path.parent for path in Path(torch.__file__).parent.parent.glob("nvidia/nccl*/lib/libnccl.so*")]
    if nccl:
        nccl_reads = _library_strings(nccl[0], "libnccl.so*")
        settings = [name for name in MULTINODE_SETTINGS if name.startswith("NCCL_")]
        assert len(settings) >= 4 and [name for name in settings if not nccl_reads(name)] == []
