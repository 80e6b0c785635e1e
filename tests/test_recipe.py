"""recipe.py is the user's: each optimizer it offers (and one a user adds by editing it, as
docs/recipe.md shows) trains, stops on a signal and resumes to exactly the weights of an
uninterrupted run, in 1 process and in 2-process DDP; the start-up block and the metrics name
what runs; an augmentation a user adds is served alike by both loaders; a DDP model with a
parameter that gets no gradient is one line."""

import os
import re
import shutil
import signal
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import dataset_utils as du
import recipe
from engine.cli import user_code_error
from engine.errors import UserError
from engine.plugins import load_plugin
from conftest import REPO, TINY_MODEL, clean_env, error_lines, read_metrics, run, start, torchrun_cmd, wait_held
from test_resilience import _rank_pid
from tools.demo_data import write_photo_folder
import train_utils as tu
from train_utils import parse_args

BASE = (*TINY_MODEL, "--epochs", "3", "--limit-batches", "4", "--batch-size", "8", "--checkpoint-interval", "0",
        "--num-workers", "0", "--log-interval", "0")
RUN = (*BASE, "--synthetic")
# A folder of photos (the project's photos/: JPEG and PNG, colour and gray, 60x80 to 500x333), held
# out by a quarter: 45 training images, resized-crop at 32x32 from the cache's 37x37.
PHOTOS = ("--dataset", "folder", "--data-dir", "photos", "--val-fraction", "0.25", "--image-size", "32")
# The torchvision references' batch-level flags, all together.
REFERENCES = ("--auto-augment", "ta_wide", "--random-erase", "0.25", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
              "--clip-grad-norm", "1.0", "--model-ema", "--model-ema-steps", "3")
REFERENCES_RECORDED = {"auto_augment": "ta_wide", "random_erase": 0.25, "mixup_alpha": 0.2, "cutmix_alpha": 1.0,
                       "clip_grad_norm": 1.0, "model_ema_decay": 0.5, "model_ema_steps": 3}


def recipe_docs_snippet(name):
    """The python block of docs/recipe.md that defines ``name``."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "recipe.md").read_text(), re.S)
    return next(block for block in blocks if f"def {name}(" in block)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A copy of the scripts, as a user has them, with docs/recipe.md's RMSprop and cutout
    added at the end of recipe.py, and a folder of photos."""
    folder = tmp_path_factory.mktemp("project")
    write_photo_folder(folder / "photos", per_class=20)
    for path in REPO.iterdir():
        if path.suffix == ".py":
            shutil.copy(path, folder)
    shutil.copytree(REPO / "engine", folder / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    with open(folder / "recipe.py", "a") as f:
        f.write("\n\n" + recipe_docs_snippet("rmsprop") + "\n\n" + recipe_docs_snippet("cutout"))
    return folder


def single(*args):
    """train.py of the folder the command runs in (a project's copy)."""
    return [sys.executable, "train.py", *args]


def ddp(*args):
    """train_ddp.py of the folder the command runs in, 2 processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_ddp.py", *args]


# SGD, the default, is test_resilience.py's (its stops and resumes, on 1 and 2 processes, compare
# the weights bit for bit). Under DDP AdamW only: the signal to one rank, the agreement and the
# bitwise resume are the same machinery for every optimizer. AdamW runs with all the references'
# flags (TrivialAugment per image, so the DataLoader; erasing, MixUp, CutMix, clipping, model EMA)
# on a folder of photos: each image's and step's draws and the average (the weights compared) are
# resumed too.
@pytest.mark.parametrize("optimizer, launcher, extra", [("adamw", single, REFERENCES), ("rmsprop", single, ()),
                                                        ("adamw", ddp, REFERENCES)],
                         ids=["adamw-1-references", "rmsprop-1", "adamw-2-references"])
def test_each_optimizer_stops_and_resumes_to_the_uninterrupted_weights(project, tmp_path, optimizer, launcher,
                                                                       extra):
    names = {"adamw": "AdamW", "rmsprop": "RMSprop"}
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    data = PHOTOS if extra else ("--synthetic",)
    outputs = []
    for folder in (reference, stopped):
        shutil.copytree(project, folder)
        outputs.append((*data, "--optimizer", optimizer, *extra, "--checkpoint-dir", folder / "ckpt", "--metrics-file",
                        folder / "m.jsonl", "--save-weights", folder / "w.pt"))
    whole = run(launcher(*BASE, *outputs[0]), cwd=reference)
    assert whole.returncode == 0, whole.stderr
    assert re.search(rf"^Recipe: {names[optimizer]} \(lr ", whole.stdout, re.M)
    said = ("Regularization: --auto-augment ta_wide, --random-erase 0.25, --mixup-alpha 0.2, --cutmix-alpha 1, "
            "--clip-grad-norm 1, model EMA (decay 0.5 every 3 steps: half-life 3 steps, 25% of the run (the default 5%, "
            "raised to one update in a run this short), 0.8 epochs; each epoch validates the model and the average, --save-weights keeps the better)")
    assert (said in whole.stdout.splitlines()) == bool(extra), whole.stdout
    augmentation = re.search(r"^Augmentation: .*$", whole.stdout, re.M).group()
    assert ("per image TrivialAugmentWide" in augmentation) == bool(extra), augmentation

    go = stopped / "go"  # held at step 2 of epoch 2 until the signal is sent
    process = start(launcher(*BASE, *outputs[1]), stopped, stopped / "log", env=clean_env(HOLD_AT=f"6:{go}"))
    rank = 0 if launcher is single else 1
    wait_held(go, process, rank)
    os.kill(process.pid if launcher is single else _rank_pid(process.pid, 1), signal.SIGUSR1)  # DDP: rank 1 only
    go.touch()
    process.wait(timeout=120)
    log = (stopped / "log").read_text()
    resumed = run(launcher(*BASE, *outputs[1], "--resume"), cwd=stopped)
    step = 2 if launcher is single else 3  # DDP: the ranks agree during the next step
    assert re.search(rf"Stopped after step {step} of epoch 2 \((SIGUSR1|a stop request on another rank)\)", log), log
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming from" in resumed.stdout and f"Recipe: {names[optimizer]} (" in resumed.stdout
    a, b = (torch.load(folder / "w.pt", weights_only=True) for folder in (reference, stopped))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    records = read_metrics(stopped / "m.jsonl")
    assert [r["epoch"] for r in records] == [1, 2, 3] and {r["optimizer"] for r in records} == {names[optimizer]}
    assert records[-1]["augment"] == (["resized_crop", "flip"] if extra else ["flip", "pad_crop"])  # photos: auto
    assert records[-1]["per_image"] == (["TrivialAugmentWide"] if extra else [])
    assert records[-1]["loss"] == "CrossEntropyLoss"
    assert records[-1]["regularization"] == (REFERENCES_RECORDED if extra else {})
    assert records[-1]["loader"] == ("torchvision" if extra else "device")  # auto: per-image transforms
    compared = ("train_loss", "val_loss", "val_accuracy", "lr")
    assert [[r[k] for k in compared] for r in records] == [[r[k] for k in compared]
                                                           for r in read_metrics(reference / "m.jsonl")]


def test_a_torch_scheduler_from_make_scheduler_trains_stops_and_resumes_exactly(project, tmp_path):
    """docs/recipe.md's MultiStepLR, returned by recipe.make_scheduler: the learning rate each
    epoch is MultiStepLR's, a stop in epoch 2 and --resume end in the uninterrupted run's
    weights, a larger --epochs on --resume is refused in one line (it cannot be extended), and
    so is a recipe.py without that scheduler."""
    outputs = []
    for name in ("reference", "stopped"):
        shutil.copytree(project, tmp_path / name)
        with open(tmp_path / name / "recipe.py", "a") as f:
            f.write("\n\n" + recipe_docs_snippet("make_scheduler"))
        outputs.append(("--checkpoint-dir", tmp_path / name / "ckpt", "--metrics-file", tmp_path / name / "m.jsonl",
                        "--save-weights", tmp_path / name / "w.pt"))
    whole = run(single(*RUN, *outputs[0]), cwd=tmp_path / "reference")
    assert whole.returncode == 0, whole.stderr
    assert re.search(r"^Recipe: SGD .*; LR schedule: MultiStepLR \(recipe\.make_scheduler\)$", whole.stdout, re.M)
    assert "have no effect" not in whole.stdout  # no lr_factor flag given: nothing to say
    base = parse_args("t", []).base_lr
    # 3 epochs of 4 steps: milestones after steps 4 and 8; an epoch's record has its last step's LR.
    lrs = [r["lr"] for r in read_metrics(tmp_path / "reference" / "m.jsonl")]
    assert lrs == pytest.approx([base, base / 10, base / 100])

    stopped = tmp_path / "stopped"
    go = stopped / "go"  # held at step 2 of epoch 2 until the signal is sent
    process = start(single(*RUN, *outputs[1]), stopped, stopped / "log", env=clean_env(HOLD_AT=f"6:{go}"))
    wait_held(go, process)
    os.kill(process.pid, signal.SIGUSR1)
    go.touch()
    process.wait(timeout=120)
    assert "Stopped after step 2 of epoch 2 (SIGUSR1)" in (stopped / "log").read_text()
    longer = run(single(*RUN, *outputs[1], "--resume", "--epochs", "4"), cwd=stopped)
    assert "Training " not in longer.stdout  # refused before the start-up block
    assert error_lines(longer.stderr) == [
        f"error: --epochs 4: the run in {stopped / 'ckpt'} planned 3, and recipe.make_scheduler's MultiStepLR cannot "
        "be extended (lr_factor's schedule can); resume with --epochs 3, or start a new run"], longer.stderr
    plain = run(single(*RUN, *outputs[1], "--resume"), cwd=project)  # recipe.py without make_scheduler's
    assert error_lines(plain.stderr) == [
        "error: --resume needs the checkpoint's recipe, but recipe.py made another since: its LR scheduler "
        "recipe.make_scheduler's MultiStepLR (now lr_factor's LambdaLR); restore recipe.py as it was, or start a new "
        "run in another --checkpoint-dir (--weights takes the checkpoint's model)"], plain.stderr
    resumed = run(single(*RUN, *outputs[1], "--resume"), cwd=stopped)
    assert resumed.returncode == 0, resumed.stderr
    a, b = (torch.load(tmp_path / name / "w.pt", weights_only=True) for name in ("reference", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    assert [r["lr"] for r in read_metrics(stopped / "m.jsonl")] == lrs


@pytest.mark.parametrize("code, expected", [
    ("def make_scheduler(optimizer, args, total_steps):\n"
     "    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)\n",
     "recipe.make_scheduler returned ReduceLROnPlateau, which steps once per epoch on a validation metric; the loop "
     "steps the scheduler after each optimizer step, with no argument: return a scheduler of steps (OneCycleLR, "
     "MultiStepLR, LambdaLR, ...)"),
    ("def make_loss(args):\n    return nn.CrossEntropyLoss(reduction='none')\n",
     "recipe.make_loss's CrossEntropyLoss returns a tensor of shape (2,) for logits (2, 100) and labels (2,): the "
     "loop needs a scalar that backpropagates to the logits (reduction='mean' or 'sum')"),
    ("def make_optimizer(model, args, device):\n    return list(model.parameters())\n",
     "recipe.make_optimizer returned a list, not a torch.optim.Optimizer (SGD, AdamW, ...) of the model's parameters"),
    ("def image_transforms(args):\n    return 'ColorJitter'\n",
     "recipe.image_transforms returned a str: return a v2.Compose of the per-image transforms, a list of them, or None "
     "for none"),
], ids=["plateau", "loss-per-image", "not-an-optimizer", "not-transforms"])
def test_a_scheduler_or_loss_the_step_cannot_use_is_one_line_at_start(project, tmp_path, code, expected):
    """Each was a traceback at the first step: ReduceLROnPlateau.step() wants a metric, a loss per
    image cannot start backward() (docs/recipe.md's own scheduler and loss, gone wrong)."""
    shutil.copytree(project, tmp_path / "edited")
    with open(tmp_path / "edited" / "recipe.py", "a") as f:
        f.write("\n\n" + code)
    result = run(single(*RUN), cwd=tmp_path / "edited")
    assert result.returncode == 2 and error_lines(result.stderr) == [f"error: {expected}"], result.stderr


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_lambda_among_the_image_transforms_is_one_line_where_workers_are_not_forked(project, tmp_path,
                                                                                       start_method):
    """v2.Lambda(lambda image: ...) in recipe.image_transforms: under forkserver (Python 3.14's
    default start method; set here by a sitecustomize) the DataLoader pickles it for each worker,
    which failed as the first epoch began, in a traceback. Forked workers need no pickle."""
    shutil.copytree(project, tmp_path / "edited")
    edited = tmp_path / "edited" / "recipe.py"
    source = edited.read_text()
    assert "        # v2.ColorJitter(0.4, 0.4, 0.4),  # yours here\n" in source
    edited.write_text(source.replace("        # v2.ColorJitter(0.4, 0.4, 0.4),  # yours here\n",
                                     "        v2.Lambda(lambda image: image),\n"))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        f"import multiprocessing\nmultiprocessing.set_start_method({start_method!r})\n")
    result = run(single(*BASE, *PHOTOS, "--epochs", "1", "--loader", "torchvision", "--num-workers", "2",
                        "--cache-dir", tmp_path / "cache"),
                 cwd=tmp_path / "edited", env=clean_env(PYTHONPATH=tmp_path / "site"))
    if start_method == "fork":
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2, result.stderr
    [line] = error_lines(result.stderr)  # pickle's own words (AttributeError: Can't pickle local object ...) vary
    assert line.startswith("error: the DataLoader's 2 worker processes (--num-workers) receive recipe.py's per-image "
                           "transforms pickled (Python's start method 'forkserver'), and they cannot be: "), line
    assert "image_transforms.<locals>.<lambda>" in line and line.endswith(
        "; define each function at the top of recipe.py, not as a lambda or inside another function, or give "
        "--num-workers 0"), line
    assert "Training" not in result.stdout  # before the start-up block


def test_the_schedulers_and_losses_a_step_cannot_use_are_named():
    from engine.optimization import check_loss
    from engine.own_scheduler import check_scheduler
    sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    check_scheduler(None, 8)  # lr_factor's
    check_scheduler(torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=8), 8)
    with pytest.raises(UserError, match=r"^recipe.make_scheduler's OneCycleLR has total_steps 7, and the run takes 8 "
                                        r"optimizer steps: it would stop the run at step 8; give it total_steps="):
        check_scheduler(torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=7), 8)
    with pytest.raises(UserError, match=r"^recipe.make_scheduler returned float, not a torch.optim.lr_scheduler "):
        check_scheduler(0.5, 8)
    chained = torch.optim.lr_scheduler.ChainedScheduler([torch.optim.lr_scheduler.ConstantLR(sgd)])
    if not hasattr(chained, "last_epoch"):  # the loop counts steps by it: every checkpoint would fail
        with pytest.raises(UserError, match=r"^recipe.make_scheduler returned ChainedScheduler, which keeps no step "):
            check_scheduler(chained, 8)
    check_scheduler(torch.optim.lr_scheduler.SequentialLR(sgd, [torch.optim.lr_scheduler.ConstantLR(sgd),
                                                                 torch.optim.lr_scheduler.LinearLR(sgd)], [4]), 8)
    cpu = torch.device("cpu")
    for soft in (False, True):  # CrossEntropyLoss takes class indices and MixUp's soft labels
        check_loss(torch.nn.CrossEntropyLoss(label_smoothing=0.1), 10, soft, cpu)
    with pytest.raises(UserError, match=r"^recipe.make_loss's MSELoss fails on logits \(2, 10\) and labels \(2,\): "):
        check_loss(torch.nn.MSELoss(), 10, False, cpu)
    with pytest.raises(UserError, match=r"^recipe.make_loss's NLLLoss fails on logits \(2, 10\) and soft labels "
                                        r"\(2, 10\): RuntimeError"):  # a loss of class indices under MixUp
        check_loss(torch.nn.NLLLoss(), 10, True, cpu)
    check_loss(lambda logits, labels: torch.nn.functional.cross_entropy(logits, labels)[None], 10, False, cpu)  # (1,)
    with pytest.raises(UserError, match=r"^recipe.make_loss's function returns a constant of shape \(\) for "):
        check_loss(lambda logits, labels: torch.tensor(0.0), 10, False, cpu)


def test_a_schedule_whose_length_is_not_the_runs_is_said_at_start():
    """make_scheduler's schedulers are stepped once per optimizer step: a length in epochs
    (T_max=epochs), or one longer than the run, is a note in the start-up block, where the LR
    would otherwise cycle or never anneal without a word; the run's own length, none."""
    from engine.own_scheduler import schedule_length_notes
    sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    schedulers = torch.optim.lr_scheduler
    for matching in (None, schedulers.OneCycleLR(sgd, max_lr=0.1, total_steps=400),
                     schedulers.CosineAnnealingLR(sgd, T_max=400), schedulers.LinearLR(sgd, total_iters=40),
                     schedulers.StepLR(sgd, step_size=100), schedulers.MultiStepLR(sgd, [200, 300]),
                     schedulers.ExponentialLR(sgd, 0.99)):  # a warm-up shorter than the run; decays an epoch apart
        assert schedule_length_notes(matching, 400, 100) == []
    assert schedule_length_notes(schedulers.OneCycleLR(sgd, max_lr=0.1, epochs=4, steps_per_epoch=400), 400, 100) == [
        "Note: recipe.make_scheduler's OneCycleLR has total_steps=1600 optimizer steps and this run takes 400: the run "
        "ends 25% of the way through the schedule, whose LR never reaches its end (make_scheduler's total_steps is "
        "the run's length in optimizer steps)"]
    assert schedule_length_notes(schedulers.CosineAnnealingLR(sgd, T_max=4), 400, 100) == [
        "Note: recipe.make_scheduler's CosineAnnealingLR has T_max=4 optimizer steps and this run takes 400: the LR "
        "falls and rises again every 8 steps (T_max=total_steps anneals it once over the run)"]
    assert schedule_length_notes(schedulers.PolynomialLR(sgd, total_iters=300), 400, 100) == [
        "Note: recipe.make_scheduler's PolynomialLR has total_iters=300 optimizer steps and this run takes 400: the LR "
        "stays at its final value for the last 100 steps"]
    # torchvision's references count these in epochs: stepped per optimizer step, they decay within the first.
    assert schedule_length_notes(schedulers.StepLR(sgd, step_size=1, gamma=0.5), 12, 4) == [
        "Note: recipe.make_scheduler's StepLR (step_size=1) counts optimizer steps, 4 an epoch here: the LR decays 12 "
        "times over the run's 12 steps, to 0.00024 times its start (for epochs, multiply it by steps_per_epoch = "
        "total_steps // args.epochs)"]
    assert schedule_length_notes(schedulers.MultiStepLR(sgd, [30, 60, 90]), 39000, 390) == [
        "Note: recipe.make_scheduler's MultiStepLR (milestones=[30, 60, 90]) counts optimizer steps, 390 an epoch "
        "here: the LR decays 3 times over the run's 39000 steps, to 0.001 times its start (for epochs, multiply "
        "them by steps_per_epoch = total_steps // args.epochs)"]
    [note] = schedule_length_notes(schedulers.ExponentialLR(sgd, 0.9), 400, 100)
    assert note.startswith("Note: recipe.make_scheduler's ExponentialLR (gamma=0.9) counts optimizer steps, 100 an "
                           "epoch here: the LR decays 400 times over the run's 400 steps, to 5e-19 times its "
                           "start (for a gamma per epoch, give gamma ** (1 / steps_per_epoch)")


def test_recipe_flags_that_an_edited_recipe_does_not_pass_on_are_named():
    """recipe.py's adamw() edited to AdamW(lr=3e-4, weight_decay=0.02) and make_loss to its own
    label_smoothing: the flags given for them changed nothing, and a Note says which; the same
    flags passed on, or left at their defaults, say nothing."""
    params = [torch.zeros(2, requires_grad=True)]
    args = parse_args("t", ["--optimizer", "adamw", "--base-lr", "0.05", "--weight-decay", "0.3",
                            "--label-smoothing", "0.3"])
    edited = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.02), torch.nn.CrossEntropyLoss(label_smoothing=0.0)
    assert tu.flags_not_passed_on(args, *edited) == (
        "Note: recipe.py did not pass on --base-lr 0.05, --weight-decay 0.3, --label-smoothing 0.3 as given: the "
        "Recipe line has what runs")
    passed = torch.optim.AdamW(params, lr=0.05, weight_decay=0.3), torch.nn.CrossEntropyLoss(label_smoothing=0.3)
    assert tu.flags_not_passed_on(args, *passed) is None
    assert tu.flags_not_passed_on(parse_args("t", ["--optimizer", "adamw"]), *edited) is None  # none given
    sgd = parse_args("t", ["--momentum", "0.5", "--no-nesterov"])
    assert tu.flags_not_passed_on(sgd, torch.optim.SGD(params, lr=sgd.base_lr, momentum=0.9, nesterov=True,
                                                        weight_decay=sgd.weight_decay),
                                  torch.nn.CrossEntropyLoss(label_smoothing=sgd.label_smoothing)) == (
        "Note: recipe.py did not pass on --momentum 0.5, --no-nesterov as given: the Recipe line has what runs")


def test_model_ema_validates_both_and_keeps_the_better(project, tmp_path):
    """A short run with an average too slow for it: one warning line naming the flags; every
    epoch records and prints the model's and the average's accuracy; --save-weights holds the
    one that validated better and says which; model_best.pt holds the best epoch's."""
    folder = tmp_path / "p"
    shutil.copytree(project, folder)
    result = run(single(*BASE, *PHOTOS, "--model-ema", "--model-ema-decay", "0.999", "--warmup-epochs", "0",
                        "--checkpoint-dir", "ck", "--metrics-file", "m.jsonl", "--save-weights", "w.pt"), cwd=folder)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    assert warnings == ["WARNING: the model EMA's half-life (693 steps) is longer than this run's 12 steps: the "
                        "average would be mostly the early weights; lower --model-ema-decay (now 0.999) or "
                        "--model-ema-steps (now 1), or leave both out for a half-life of 5% of the run"]
    assert "Length: 3 epochs (no early stop: --target-accuracy off)" in result.stdout  # photos run to --epochs
    records = read_metrics(folder / "m.jsonl")
    lines = re.findall(r"Val Accuracy=([\d.]+), EMA Accuracy=([\d.]+)", result.stdout)
    assert [(f"{r['val_accuracy']:.4f}", f"{r['ema_val_accuracy']:.4f}") for r in records] == lines
    assert len(lines) == 3
    last = records[-1]
    ema_better = last["ema_val_accuracy"] > last["val_accuracy"]
    final = torch.load(sorted((folder / "ck").glob("checkpoint_*.pt"))[-1], weights_only=True)
    kept = final["model_ema"] if ema_better else final["model"]
    saved = torch.load(folder / "w.pt", weights_only=True)
    assert saved.keys() == kept.keys() and all(torch.equal(saved[k], kept[k]) for k in kept)
    said = "the model's EMA average, which validated better" if ema_better else "the model, which validated at least"
    assert re.search(rf"^Model weights written to w.pt \({said}", result.stdout, re.M), result.stdout
    assert saved._metadata[""]["task"]["val_accuracy"] == max(last["val_accuracy"], last["ema_val_accuracy"])
    best_epoch = max(records, key=lambda r: max(r["val_accuracy"], r["ema_val_accuracy"]))["epoch"]
    best = torch.load(folder / "ck" / "model_best.pt", weights_only=True)
    assert best._metadata[""]["task"]["epoch"] == best_epoch
    if best_epoch == 3:
        assert all(torch.equal(best[k], saved[k]) for k in saved)
    # The run's checkpoints gone, its best weights kept: a new run there would replace them, and is refused.
    for path in (folder / "ck").glob("checkpoint_*.pt"):
        path.unlink()
    again = run(single(*BASE, *PHOTOS, "--checkpoint-dir", "ck"), cwd=folder)
    assert again.returncode == 2 and error_lines(again.stderr) == [
        "error: --checkpoint-dir ck holds model_best.pt (an earlier run's best weights, or a file of your own), which "
        "this run would replace: move it elsewhere, or give this run another --checkpoint-dir (a run of these flags "
        "that was killed before its first checkpoint: --resume=auto starts it again and keeps the better weights)"]


def test_a_v2_transform_added_to_recipe_py_applies_or_is_refused_by_name(project, tmp_path):
    """A v2 transform added to image_transforms' list, as its docstring says: the DataLoader
    applies it to each training image (--loader auto takes it, and says why); the device
    loader and DALI, which cannot, refuse it in one line naming it."""
    folder = tmp_path / "p"
    shutil.copytree(project, folder)
    source = (folder / "recipe.py").read_text()
    mine = "        v2.ColorJitter(0.4, 0.4, 0.4),\n"
    (folder / "recipe.py").write_text(source.replace("        # v2.ColorJitter(0.4, 0.4, 0.4),  # yours here\n", mine))
    assert mine in (folder / "recipe.py").read_text()
    args = (*BASE, *PHOTOS, "--epochs", "1")
    result = run(single(*args), cwd=folder)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^Loader: torchvision DataLoader, 0 worker processes per training process; auto: recipe.py's "
                     r"per-image ColorJitter transforms each image, in the DataLoader's workers$", result.stdout, re.M)
    assert re.search(r"^Augmentation: resized-crop \(resized_crop, flip, per image ColorJitter;", result.stdout, re.M)
    for loader, refusal in (("device", "error: recipe.py's per-image ColorJitter transforms each image on its own, in "
                                       "the DataLoader's workers: --loader device transforms whole batches"),
                            ("dali", "error: recipe.py's per-image ColorJitter transforms each image in the "
                                     "DataLoader's workers, which DALI has no operator for")):
        refused = run(single(*args, "--loader", loader), cwd=folder)
        assert refused.returncode == 2 and [line[:len(refusal)] for line in error_lines(refused.stderr)] == [refusal]


def test_mixup_and_cutmix_are_torchvisions_and_each_draw_is_its_seeds():
    """MixUp blends each image with the one before it (v2.MixUp), CutMix pastes a box of it
    (v2.CutMix), both into soft labels that sum to 1; one of the two per batch when both are
    on; the global generator's state decides the draw."""
    def seeded(seed, mix):
        torch.manual_seed(seed)
        return mix(x, y)

    x, y = torch.rand(6, 3, 8, 8), torch.arange(6)
    mixup = recipe.make_batch_transform(parse_args("x", ["--mixup-alpha", "0.2"]), 10)
    mixed, soft = seeded(5, mixup)
    lam = soft[0, 0]  # image 0's own label's weight; the rest is image 5's (rolled by one)
    assert torch.allclose(mixed, lam * x + (1 - lam) * x.roll(1, 0)) and 0 < lam < 1
    assert torch.allclose(soft.sum(1), torch.ones(6)) and torch.allclose(soft[0, 5], 1 - lam)
    assert torch.equal(mixed, seeded(5, mixup)[0]) and not torch.equal(mixed, seeded(6, mixup)[0])

    cutmix = recipe.make_batch_transform(parse_args("x", ["--cutmix-alpha", "1.0"]), 10)
    pasted, soft = seeded(3, cutmix)
    from_next = (pasted != x).any(1)  # (B, H, W): pixels that came from the image before
    assert torch.equal(pasted, torch.where(from_next[:, None], x.roll(1, 0), x))
    assert torch.allclose(from_next.float().mean((1, 2)), 1 - soft[torch.arange(6), y])  # by area

    both = recipe.make_batch_transform(parse_args("x", ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"]), 10)
    kinds = {bool((seeded(s, both)[0] == x).any()) for s in range(12)}
    assert kinds == {True, False}  # some batches pasted (pixels of their own left), some blended
    assert recipe.make_batch_transform(parse_args("x", []), 10) is None
    assert recipe.batch_settings(parse_args("x", ["--clip-grad-norm", "2"])) == {"clip_grad_norm": 2.0}


def test_random_erasing_boxes_as_torchvisions_random_erasing():
    """--random-erase P on a batch: each image loses one box or none, a box of 2%-33% of its
    area, about as often and as large as torchvision's RandomErasing(P) erases image by image."""
    torch.manual_seed(0)
    ones = torch.ones(2000, 1, 32, 32)
    ours = recipe.random_erase(ones, 0.5)
    from torchvision.transforms import v2
    theirs = torch.stack([v2.RandomErasing(0.5)(image) for image in ones])
    for erased in (ours, theirs):
        holes = erased[:, 0] == 0  # (B, H, W)
        rows, cols = holes.any(2).sum(1), holes.any(1).sum(1)  # (B,): the box's height and width
        assert torch.equal(holes.sum((1, 2)), rows * cols)  # one rectangle per image, or nothing
    share = [(erased == 0).float().mean((1, 2, 3)) for erased in (ours, theirs)]  # (B,) each
    hit = [(s > 0).float().mean() for s in share]
    assert abs(hit[0] - 0.5) < 0.05 and abs(hit[0] - hit[1]) < 0.05
    sizes = [s[s > 0] for s in share]
    assert sizes[0].min() >= 0.01 and sizes[0].max() <= 0.4  # 2%-33%, each side rounded to pixels
    assert abs(sizes[0].mean() - sizes[1].mean()) < 0.02
    assert torch.equal(recipe.random_erase(ones[:4], 0.0), ones[:4])


def test_a_v2_transform_added_as_docs_recipe_shows_is_applied_to_each_image():
    """docs/recipe.md's image_transforms (ColorJitter) in the DataLoader: every image changed,
    each image's draw the same with 0 or 2 worker processes (seeded by seed, epoch, index)."""
    namespace = {"AUTO_AUGMENT": recipe.AUTO_AUGMENT}
    exec(recipe_docs_snippet("image_transforms"), namespace)
    transforms = namespace["image_transforms"](parse_args("x", []))
    images = np.random.default_rng(0).integers(30, 220, (16, 32, 32, 3), dtype=np.uint8)
    plain = du.InMemoryImages(images, np.arange(16), du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "none"))
    jittered, named = du.with_image_transforms(plain, transforms)
    assert named == "recipe.py's per-image ColorJitter"

    def served(data, workers):
        loader = du.build_loaders(data, data, 8, loader="torchvision", num_workers=workers, seed=5)[0]
        return torch.cat([x for x, _ in loader]), torch.cat([y for _, y in loader])

    (x, y), (x2, y2), (x0, y0) = served(jittered, 0), served(jittered, 2), served(plain, 0)
    assert torch.equal(y, y0) and torch.equal(y, y2)  # the same images in the same order
    assert torch.equal(x, x2)
    assert ((x - x0).abs().flatten(1).amax(1) > 0.1).all()  # each image jittered
    # torchvision's image transforms take 8-bit images of 1 or 3 channels: float data is refused.
    floats = du.InMemoryImages(images.astype(np.float32), np.arange(16), plain.prep)
    with pytest.raises(UserError, match="^recipe.py's per-image ColorJitter works on 8-bit images of 1 or 3 "
                                        "channels; these are float32 with 3: drop --auto-augment"):
        du.with_image_transforms(floats, transforms)


@pytest.mark.parametrize("transform, returned", [
    ("ToDtype", r"torch.float32 \(3, 32, 32\)"),  # scaled to 0..1: normalized as 8-bit, all but blank
    ("RandomCrop", r"torch.uint8 \(3, 28, 28\)"),  # smaller than the input: a 2x2 corner was trained on
    ("Grayscale", r"torch.uint8 \(1, 32, 32\)"),  # not the model's channels
    ("Normalize", None),  # fails on 8-bit images: in a DataLoader worker, with its traceback
])
def test_a_v2_transform_that_returns_what_the_loader_cannot_take_is_one_line_at_start(transform, returned):
    """recipe.py's per-image transforms must hand the DataLoader's next step an 8-bit image
    with the model's channels, at least its input size: anything else trained silently on
    other images, or failed in a worker; now one line naming the transform, before training."""
    from torchvision.transforms import v2
    made = {"ToDtype": lambda: v2.ToDtype(torch.float32, scale=True), "RandomCrop": lambda: v2.RandomCrop(28),
            "Grayscale": lambda: v2.Grayscale(), "Normalize": lambda: v2.Normalize((0.5,) * 3, (0.25,) * 3)}
    images = np.random.default_rng(0).integers(30, 220, (16, 32, 32, 3), dtype=np.uint8)
    plain = du.InMemoryImages(images, np.arange(16), du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3))
    data, _ = du.with_image_transforms(plain, v2.Compose([made[transform]()]))
    expected = (f"^recipe.py's per-image {transform} returned {returned} for a torch.uint8 \\(3, 32, 32\\) image; the "
                r"loader takes 8-bit \(C, H, W\) images of at least the model's input \(3, 32, 32\)" if returned
                else f"^recipe.py's per-image {transform} failed on a training image \\(torch.uint8 \\(3, 32, 32\\)\\): ")
    with pytest.raises(UserError, match=expected):
        du.build_loaders(data, plain, 8, loader="torchvision")
    du.build_loaders(plain, plain, 8, loader="torchvision")  # the same images without it: taken
    du.build_loaders(du.with_image_transforms(plain, v2.Compose([v2.RandomCrop(40, pad_if_needed=True)]))[0],
                     plain, 8, loader="torchvision")  # larger than the input: centre-cropped, as stored larger ones
    # Photos stored at 37x37 for --augment resized-crop: the transforms are given its 32x32 crop, and say so.
    stored = np.random.default_rng(0).integers(30, 220, (16, 37, 37, 3), dtype=np.uint8)
    prep = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, augment="resized-crop", stored_size=(37, 37))
    photos, _ = du.with_image_transforms(du.InMemoryImages(stored, np.arange(16), prep),
                                         v2.Compose([made[transform]()]))
    with pytest.raises(UserError, match=expected):
        du.build_loaders(photos, plain, 8, loader="torchvision")


@pytest.mark.oldest_torch  # reads the text of torch's re-raised worker exception
def test_a_transform_that_shrinks_some_draws_or_images_is_one_line_at_start_or_in_a_worker(tmp_path):
    """A RandomResize that makes one image in five smaller than the input is caught by the
    start-up check's draws; one that the check cannot see (image 5 only) by the loader's own
    check in a DataLoader worker, which torch re-raises with the worker's traceback as its
    text: one line all the same, as is an exception of recipe.py's code in a worker."""
    from torchvision.transforms import v2
    images = np.random.default_rng(0).integers(30, 220, (16, 40, 48, 3), dtype=np.uint8)
    plain = du.InMemoryImages(images, np.arange(16), du.preprocessing((40, 48, 3), (0.5,) * 3, (0.25,) * 3))
    data, _ = du.with_image_transforms(plain, v2.Compose([v2.RandomResize(30, 80)]))
    with pytest.raises(UserError, match=r"^recipe.py's per-image RandomResize returned torch.uint8 \(3, 3\d, \d+\) "
                                        r"for a torch.uint8 \(3, 40, 48\) image in one draw; the loader takes"):
        du.build_loaders(data, plain, 8, loader="torchvision")

    images[5] = 1  # the one image the transforms below shrink or fail on (after --augment's zero padding)
    marked = du.InMemoryImages(images, np.arange(16), plain.prep)
    (tmp_path / "mine.py").write_text("def shrink(image):\n    return image[:, :2, :2] if image.max() == 1 else image\n"
                                      "def fail(image):\n    if image.max() == 1:\n"
                                      "        raise ValueError('no zero here')\n    return image\n"
                                      "def refuse(image):\n    from engine.errors import OutOfMemory\n"
                                      "    if image.max() == 1:\n        raise OutOfMemory('no room for it')\n"
                                      "    return image\n")
    shrink, fail, refuse = (load_plugin(f"{tmp_path / 'mine.py'}:{name}", "--model")
                            for name in ("shrink", "fail", "refuse"))
    for function, expected in ((shrink, r"^recipe.py's per-image Lambda returned torch.uint8 \(3, 2, 2\) "
                                                r"for training image 5 \(stored \(3, 40, 48\)\); the loader takes"),
                               (fail, f"^{re.escape(str(tmp_path / 'mine.py'))}, line 5, in fail: "
                                              "ValueError: no zero here$"),
                               (refuse, "^no room for it$")):  # a UserError subclass: its line and exit status
        data, _ = du.with_image_transforms(marked, v2.Compose([v2.Lambda(function)]))
        train, _ = du.build_loaders(data, plain, 8, loader="torchvision", num_workers=1)
        with pytest.raises(Exception) as raised:
            list(train)
        assert "DataLoader worker" in str(raised.value)  # torch's own text: a traceback
        mistake = user_code_error(raised.value, [tmp_path / "mine.py"])
        assert re.match(expected, str(mistake)) and "\n" not in str(mistake), str(mistake)
        assert mistake.exit_code == (1 if function is refuse else 2)  # OutOfMemory's status, not a mistake's


def test_the_guides_sgd_and_adamw_are_what_their_flags_say():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    sgd = recipe.make_optimizer(model, parse_args("x", []), torch.device("cpu"))
    assert type(sgd) is torch.optim.SGD and len(sgd.param_groups) == 1
    assert sgd.param_groups[0]["weight_decay"] == 5e-4 and sgd.param_groups[0]["nesterov"] is True
    adamw = recipe.make_optimizer(model, parse_args("x", ["--optimizer", "adamw"]), torch.device("cpu"))
    assert type(adamw) is torch.optim.AdamW and adamw.param_groups[0]["lr"] == 1e-3
    decayed, plain = adamw.param_groups
    assert [p.ndim for p in decayed["params"]] == [4] and decayed["weight_decay"] == 0.05  # the conv's weight
    assert [p.ndim for p in plain["params"]] == [1, 1, 1] and plain["weight_decay"] == 0.0  # biases, BatchNorm


def test_an_augmentation_added_to_recipe_py_is_applied_by_both_loaders(project, monkeypatch):
    """The documented cutout: batched in the device loader, on a batch of one in the DataLoader's
    workers (torchvision has no cutout), every image with its hole, repeated by a fresh loader."""
    namespace = {"torch": torch}
    exec(recipe_docs_snippet("cutout").split("\n\nAUGMENTATIONS")[0], namespace)  # the function, as documented
    monkeypatch.setitem(recipe.AUGMENTATIONS, "flip-cutout", (recipe.flip, namespace["cutout"]))  # no padding's zeros
    prep = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "flip-cutout")
    images = np.random.default_rng(0).integers(1, 256, (16, 32, 32, 3), dtype=np.uint8)  # no zeros of their own
    data = du.InMemoryImages(images, np.arange(16), prep)
    for kind in ("device", "torchvision"):
        batches, again = (list(du.build_loaders(data, data, 8, loader=kind, seed=5)[0]) for _ in range(2))
        assert len(batches) == 2  # 16 images, batches of 8
        assert all(torch.equal(x, x_ref) for (x, _), (x_ref, _) in zip(batches, again, strict=True))
        pixels = torch.cat([x for x, _ in batches]) * 0.25 + 0.5  # back to 0..1
        holes = (pixels == 0).all(dim=1).flatten(1).sum(dim=1)  # (16,) zeroed pixels
        assert (holes >= 8 * 8).all(), kind  # each image has its hole, cut at the border or whole (17 x 17)


def test_an_augmentation_that_changes_the_dtype_or_the_size_is_one_line_at_start():
    """An operation that returned float images was normalized as 8-bit ones (255 times too
    bright), one that halved them trained on 16x16 and tested on 32x32: both trained silently."""
    def asfloat(images, rand, prep):
        return images.float()

    def halve(images, rand, prep):
        return images[:, ::2, ::2]

    def brighter(images, rand, prep):  # as docs/recipe.md says: computed in float, returned as given
        return (images.float() * 1.1).clamp(0, 255).to(images.dtype)

    plain = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "flip")
    images = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    for op, got in ((asfloat, "float32 (2, 32, 32, 3)"), (halve, "uint8 (2, 16, 16, 3)")):
        data = du.InMemoryImages(images, np.arange(16), replace(plain, augment="mine", ops=(recipe.flip, op)))
        for kind in ("device", "torchvision"):
            with pytest.raises(UserError, match=re.escape(
                    f"--augment mine (flip, {op.__name__}) returned {got} for stored uint8 (2, 32, 32, 3) images "
                    "(B, H, W, C): each operation of recipe.py must return images of the dtype it is given (they are "
                    "normalized as stored) and of at least the model's input size 32x32")):
                du.build_loaders(data, data, 8, loader=kind)
    kept = du.InMemoryImages(images, np.arange(16), replace(plain, augment="mine", ops=(recipe.flip, brighter)))
    assert len(list(du.build_loaders(kept, kept, 8, loader="device")[0])) == 2


def test_an_augmentation_that_returns_nothing_is_one_line_naming_it():
    """An operation whose return was forgotten: a traceback from the check of its output."""
    def forgets(images, rand, prep):
        images = images.clone()
        images[:, :4] = 0

    plain = du.preprocessing((32, 32, 3), (0.5,) * 3, (0.25,) * 3, "flip")
    images = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    data = du.InMemoryImages(images, np.arange(16), replace(plain, augment="mine", ops=(forgets, recipe.flip)))
    for kind in ("device", "torchvision"):
        with pytest.raises(UserError, match=re.escape(
                "--augment mine: recipe.py's forgets returned a NoneType, not images: each operation returns the "
                "images (B, H, W, C) it is given, changed (is its return missing?)")):
            du.build_loaders(data, data, 8, loader=kind)


def test_per_image_transforms_as_a_list_or_one_are_a_compose():
    """recipe.image_transforms "lists" the transforms (docs/recipe.md): a list returned, or a
    single transform, was a traceback; now it is the Compose of them, and an empty list none."""
    jitter = v2.ColorJitter(0.4)
    for given in ([jitter], (jitter,), jitter, v2.Compose([jitter])):
        assert [type(t) for t in du.as_compose(given).transforms] == [v2.ColorJitter]
    assert du.as_compose(None) is None and du.as_compose([]) is None
    with pytest.raises(UserError, match=r"^recipe.image_transforms returned an int: return a v2.Compose "):
        du.as_compose(3)


def test_a_batch_transform_the_step_cannot_use_is_one_line_at_start():
    """recipe.make_batch_transform's transform tried on two images at start: one that returns
    the images alone, or one value, was a traceback at the first step ("too many values to
    unpack"). The try leaves torch's random numbers as they were (a resume repeats the run)."""
    from engine.optimization import check_batch_transform
    cpu, shape = torch.device("cpu"), (32, 32, 3)
    args = parse_args("x", ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--random-erase", "0.25"])
    mix = recipe.make_batch_transform(args, 10)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    check_batch_transform(mix, shape, 10, cpu)
    assert torch.equal(torch.rand(4), expected)
    check_batch_transform(None, shape, 10, cpu)
    check_batch_transform(lambda x, labels: (x * 2, labels), shape, 10, cpu)  # hard labels stay (2,)
    for transform, got in ((lambda x, labels: mix(x, labels)[0], "float32 (2, 3, 32, 32)"),
                           (lambda x, labels: [x], "(float32 (2, 3, 32, 32))"),
                           (lambda x, labels: (x[:, :1], labels), "(float32 (2, 1, 32, 32), int64 (2,))")):
        with pytest.raises(UserError, match=re.escape(
                f"recipe.make_batch_transform's transform returns {got} for images (2, 3, 32, 32) and labels (2,): "
                "the loop needs (images (2, 3, 32, 32), labels (2,) or soft labels (2, 10))")):
            check_batch_transform(transform, shape, 10, cpu)
    with pytest.raises(UserError, match=r"^recipe.make_batch_transform's transform fails on images \(2, 3, 32, 32\) "
                                        r"and labels \(2,\): ZeroDivisionError: division by zero"):
        check_batch_transform(lambda x, labels: 1 / 0, shape, 10, cpu)


def test_an_augmentations_entry_that_is_not_a_tuple_is_one_line(project, tmp_path):
    shutil.copytree(project, tmp_path / "entry")
    with open(tmp_path / "entry" / "recipe.py", "a") as f:
        f.write('\n\nAUGMENTATIONS["co"] = cutout\n')
    result = run(single(*RUN, "--augment", "co"), cwd=tmp_path / "entry")
    assert result.returncode == 2 and error_lines(result.stderr) == [
        "error: recipe.AUGMENTATIONS['co'] is function: it takes a tuple of operations, applied in order, e.g. "
        "(flip, cutout) or (cutout,)"], result.stderr


def test_an_edited_recipe_trains_with_the_new_augmentation(project):
    result = run(single(*RUN, "--augment", "flip-crop-cutout", "--epochs", "1", "--metrics-file", "aug.jsonl"),
                 cwd=project)
    assert result.returncode == 0, result.stderr
    assert "Augmentation: flip-crop-cutout (flip, pad_crop with 4-pixel padding, cutout)" in result.stdout
    assert read_metrics(project / "aug.jsonl")[-1]["augment"] == ["flip", "pad_crop", "cutout"]


def test_an_added_augmentation_dali_lacks_is_one_line_before_the_data_is_read(project):
    result = run(single(*BASE, *PHOTOS, "--augment", "flip-crop-cutout", "--loader", "dali"), cwd=project)
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "error: --loader dali has no DALI operator for recipe.py's cutout: add one to recipe.dali_images and "
        "DALI_OPS, or use --loader torchvision"]
    assert "Augmentation:" not in result.stdout and "Data:" not in result.stdout  # no start-up block, nothing read
    assert not (project / "photos" / ".cache").exists()
    assert recipe.dali_lacks(recipe.AUGMENTATIONS["resized-crop"]) == []  # what --augment auto picks runs on DALI


UNUSED = '''import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))
        self.spare = nn.Linear(4, 4)  # defined, never used

    def forward(self, x):
        return self.body(x)
'''


def test_a_ddp_parameter_without_a_gradient_is_one_line(tmp_path):
    (tmp_path / "unused.py").write_text(UNUSED)
    result = run(torchrun_cmd(2, "train_ddp.py", "--model", "unused.py:Net", "--synthetic", "--epochs", "1",
                              "--limit-batches", "2", "--batch-size", "8", "--num-workers", "0"), cwd=tmp_path)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [
        "error: parameter spare.weight (and 1 more) of --model unused.py:Net got no gradient in the first step: DDP "
        "needs every trainable parameter in each step's loss; freeze it with requires_grad_(False) in the model, or "
        "pass find_unused_parameters=True to DDP in train_ddp.py (slower)"]
    # No rank's traceback (torchrun's own report of a failed worker follows the line, as always).
    assert "Expected to have finished reduction" not in result.stderr and "train_utils.py\", line" not in result.stderr
    frozen = UNUSED.replace("self.spare = nn.Linear(4, 4)  # defined, never used",
                            "self.spare = nn.Linear(4, 4).requires_grad_(False)")
    (tmp_path / "unused.py").write_text(frozen)  # the fix the line names
    fixed = run(torchrun_cmd(2, "train_ddp.py", "--model", "unused.py:Net", "--synthetic", "--epochs", "1",
                             "--limit-batches", "2", "--batch-size", "8", "--num-workers", "0"), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr



@pytest.mark.parametrize("old, new, line", [
    ("    return nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)\n", "    return FocalLos(gamma=2)\n",
     "in make_loss: NameError: name 'FocalLos' is not defined"),
    ("        # v2.ColorJitter(0.4, 0.4, 0.4),  # yours here\n", "        v2.ColorJitter(-0.4, 0.4, 0.4),\n",
     "in image_transforms: ValueError: If brightness is a single number, it must be non negative."),
], ids=["misspelt", "raised-in-torchvision"])
def test_a_bug_in_an_edit_of_recipe_py_is_one_line_naming_its_line(project, tmp_path, old, new, line):
    """recipe.py is the user's to edit: a mistake there (a misspelt name in make_loss, a v2
    transform given a bad value) ended in Python's traceback through train_utils; now one line
    with recipe.py's line, exit 2. An error raised in a library below it is named at the line
    of recipe.py that called it."""
    folder = tmp_path / "project"
    shutil.copytree(project, folder)
    source = (folder / "recipe.py").read_text()
    assert old in source
    source = source.replace(old, new, 1)
    (folder / "recipe.py").write_text(source)
    number = source[:source.index(new)].count("\n") + 1
    result = run(single("--synthetic", "--epochs", "1", "--limit-batches", "1", "--batch-size", "8", *TINY_MODEL),
                 cwd=folder)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert error_lines(result.stderr) == [f"error: recipe.py, line {number}, {line}"]



@pytest.mark.parametrize("mistake, line", [
    ("bad line(", ": SyntaxError: '(' was never closed"),
    ("import no_such_module", ", in <module>: ModuleNotFoundError: No module named 'no_such_module'"),
], ids=["syntax", "import"])
def test_a_mistake_at_recipe_py_s_top_level_is_one_line_in_each_entry_point(project, tmp_path, mistake, line):
    """The entry points import recipe.py before run_cli starts: a SyntaxError or a failed
    import there was Python's traceback through train_utils (a new user's walk). Now the same
    line as a mistake in its functions, exit 2, from train.py and from predict.py."""
    folder = tmp_path / "project"
    shutil.copytree(project, folder)
    source = (folder / "recipe.py").read_text() + f"\n{mistake}\n"
    (folder / "recipe.py").write_text(source)
    number = source.count("\n")  # the line added last
    for command in (single("--synthetic", "--epochs", "1"), [sys.executable, "predict.py", "--weights", "w.pt", "x"]):
        result = run(command, cwd=folder)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert error_lines(result.stderr) == [f"error: recipe.py, line {number}{line}"]


def test_an_error_whose_innermost_file_is_the_engines_keeps_its_traceback():
    """Only the lines of the files a user edits make a user's mistake (recipe.py, model.py,
    their own): an exception raised in the collection's own files (here this test's; the
    engine's would be a bug of ours) stays a traceback."""
    from engine import cli

    def ours():
        raise KeyError("a bug of the engine's")

    with pytest.raises(KeyError) as raised:
        ours()
    assert cli.user_code_error(raised.value, [cli.RECIPE]) is None
    with pytest.raises(AttributeError) as raised:
        recipe.make_loss(None)  # raised in recipe.py, called from here
    line = recipe.make_loss.__code__.co_firstlineno + 2
    assert str(cli.user_code_error(raised.value, [cli.RECIPE])) == (
        f"recipe.py, line {line}, in make_loss: AttributeError: 'NoneType' object has no attribute 'label_smoothing'")


def test_lr_factor_flags_given_beside_an_own_scheduler_are_named():
    """--warmup-epochs and --lr-schedule shape lr_factor's schedule; beside make_scheduler's
    own they do nothing, and the start-up block's note names the ones given."""
    assert tu.unused_schedule_flags(parse_args("t", [])) == []
    assert tu.unused_schedule_flags(parse_args("t", ["--warmup-epochs", "1", "--lr-schedule", "constant"])) == [
        "--warmup-epochs 1", "--lr-schedule constant"]
