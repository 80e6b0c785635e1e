"""train_utils.py: flags, LR schedule, early stopping, metric reduction, precision, weights.
Pure functions are called directly."""

import argparse
import errno
import math
import re
import shlex
from datetime import timedelta
from functools import partial

import numpy as np
import pytest
import torch

import dataset_utils as du
import device_utils
import recipe
import train_utils as tu
from device_utils import single_process_context
from engine import checkpoints, flags, optimization, processes
from engine import weights as weights_file
from engine import compiling, nccl_log, private_torch
from engine.compiling import use_compile_cache
from engine.errors import UserError
from engine.task import DataInfo, Task
from model import WideResNet

GUIDE_LINES = {
    "train.py": "--batch-size 256 --epochs 100 --base-lr 0.01 --target-accuracy 0.95 --patience 2",
    "train_ddp.py 4 GPUs": "--batch-size 1024 --epochs 100 --base-lr 0.04 --target-accuracy 0.95 --patience 2",
    "train_ddp.py 2 nodes": "--epochs 100 --batch-size 2048 --base-lr 0.04 --target-accuracy 0.95 --patience 2",
}


@pytest.mark.parametrize("line", GUIDE_LINES.values(), ids=GUIDE_LINES.keys())
def test_guide_command_lines_keep_their_meaning(line):
    args = tu.parse_args("test", shlex.split(line))
    values = dict(zip(shlex.split(line)[::2], shlex.split(line)[1::2]))
    assert args.batch_size == int(values["--batch-size"])  # global batch
    assert args.base_lr == float(values["--base-lr"])      # used as given
    assert (args.epochs, args.target_accuracy, args.patience) == (100, 0.95, 2)


def test_the_guides_early_stop_is_the_default_on_its_data_only():
    """--target-accuracy: the guide's 0.95 on its data sets; off (None: run to --epochs) on your
    own data, as the references and timm; 'off' or a fraction as given on any."""
    assert tu.parse_args("test", []).target_accuracy == 0.95
    assert tu.parse_args("test", ["--dataset", "mnist"]).target_accuracy == 0.95
    folder = ["--dataset", "folder", "--data-dir", "photos"]
    assert tu.parse_args("test", folder).target_accuracy is None
    assert tu.parse_args("test", ["--dataset", "my_data.py:make"]).target_accuracy is None
    assert tu.parse_args("test", [*folder, "--target-accuracy", "0.9"]).target_accuracy == 0.9
    assert tu.parse_args("test", ["--target-accuracy", "off"]).target_accuracy is None
    assert not tu.target_reached([1.0, 1.0, 1.0], None, 2)


def test_one_recipe_by_default():
    args = tu.parse_args("test", [])
    assert (args.momentum, args.nesterov, args.weight_decay) == (0.9, True, 5e-4)
    assert (args.lr_schedule, args.warmup_epochs, args.label_smoothing, args.precision) == ("cosine", 2.0, 0.1, "auto")
    optimizer = recipe.make_optimizer(torch.nn.Linear(2, 2), args, torch.device("cpu"))
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (0.01, 0.9, True, 5e-4)


def test_guide_recipes_are_reachable_by_flags():
    part1 = tu.parse_args("test", shlex.split("--momentum 0 --no-nesterov --weight-decay 0 --lr-schedule constant "
                                              "--warmup-epochs 0 --label-smoothing 0 --precision fp32"))
    group = recipe.make_optimizer(torch.nn.Linear(2, 2), part1, torch.device("cpu")).param_groups[0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0, False, 0)
    assert recipe.lr_factor(0, 100, 0, "constant") == recipe.lr_factor(99, 100, 0, "constant") == 1.0


BAD_FLAGS = {
    "--batch-size 0": "--batch-size: '0' is not a positive integer",
    "--batch-size x": "--batch-size: 'x' is not a positive integer",
    "--epochs -1": "--epochs: '-1' is not a positive integer",
    "--base-lr 0": "--base-lr: '0' is not a positive number",
    "--base-lr nan": "--base-lr: 'nan' is not a positive number",
    "--target-accuracy 95": "--target-accuracy: '95' is not a number between 0 and 1",
    "--patience 0": "--patience: '0' is not a positive integer",
    "--momentum 1": "--momentum: '1' is not a number in [0, 1)",
    "--label-smoothing -0.1": "--label-smoothing: '-0.1' is not a number in [0, 1)",
    "--warmup-epochs -2": "--warmup-epochs: '-2' is not a number >= 0",
    "--precision fp8": "--precision: invalid choice: 'fp8'",
    "--limit-batches 0": "--limit-batches: '0' is not a positive integer",
    "--momentum 0 --nesterov": "--nesterov needs --momentum > 0; for plain SGD add --no-nesterov",
    "--optimizer adamw --momentum 0.9": "--momentum applies to --optimizer sgd, not adamw",
    "--optimizer adamw --no-nesterov": "--nesterov applies to --optimizer sgd, not adamw",
    "--optimizer lion": "--optimizer: invalid choice: 'lion'",
    "--bogus": "unrecognized arguments: --bogus",
    "--epoch 3": "unrecognized arguments: --epoch 3; did you mean --epochs?",
    "--bach-size=8 --lr 0.1": "unrecognized arguments: --bach-size=8 --lr 0.1; did you mean --batch-size (for "
                              "--bach-size) and --base-lr (for --lr)?",
    "--learning-rate 0.1": "unrecognized arguments: --learning-rate 0.1; did you mean --base-lr?",
    "--epoch 3 --epoch 4": "unrecognized arguments: --epoch 3 --epoch 4; did you mean --epochs?",
    "--epochs 3 --warmup-epochs 3.5": "--warmup-epochs 3.5 is longer than the run (--epochs 3)",
    "--log-interval -1": "--log-interval: '-1' is not a number >= 0",
    "--dataset imagenet": "--dataset: 'imagenet' is not a data set: cifar100, cifar10, fashion-mnist, mnist, folder "
                          "or FILE.py:NAME",
    "--dataset folder": "--dataset folder needs --data-dir DIR, the folder of class folders (DIR/CLASS/IMAGE) or of "
                        "train/ and test/ holding them",
    "--image-size 64": "--image-size applies to --dataset folder",
    "--cache-dir c": "--cache-dir applies to --dataset folder",
    "--dataset folder --data-dir d --image-size 0": "--image-size: '0' is not a size in pixels",
    "--dataset folder --data-dir d --image-size 3x": "--image-size: '3x' is not a size in pixels",
    "--dataset folder --data-dir d --image-size 4": "--image-size: '4' is too small to learn from (under 8 pixels a "
                                                    "side); use --image-size 32 or more for photos",
    "--dataset folder --data-dir d --image-size 64x7": "--image-size: '64x7' is too small to learn from (under 8 "
                                                       "pixels a side); use --image-size 32 or more for photos",
    "--model my_net.py": "--model: 'my_net.py' is not FILE.py:NAME or module:NAME; add the class or function in it "
                         "after a colon: my_net.py:NAME",
    "--model resnet18": "--model: 'resnet18' is not FILE.py:NAME or module:NAME; did you mean "
                        "torchvision.models:resnet18?",
    "--model ResNet50": "did you mean torchvision.models:resnet50?",
    "--model my_net.py:2x": "--model: 'my_net.py:2x' is not FILE.py:NAME or module:NAME",
    "--augment rotate": "--augment: invalid choice: 'rotate'",
    "--dataset my_data.py:make --synthetic": "--synthetic makes random data of a built-in data set's shape",
    "--model-ema-decay 0.9": "--model-ema-decay applies to --model-ema, which is not given",
    "--model-ema --model-ema-decay 0": "--model-ema-decay 0 keeps nothing of the average",
    "--model-ema --model-ema-steps 0": "--model-ema-steps: '0' is not a positive integer",
    "--mixup-alpha -1": "--mixup-alpha: '-1' is not a number >= 0",
    "--clip-grad-norm 0": "--clip-grad-norm: '0' is not a positive number",
    "--compile-mode default": "--compile-mode applies with --compile",
    "--compile-mode auto": "--compile-mode applies with --compile",
    "--compile --eval-only --weights w.pt": "--compile applies to training; --eval-only evaluates the model "
                                            "uncompiled",
    "--compile --compile-mode fast": "--compile-mode: invalid choice: 'fast' (choose from 'auto', 'default', "
                                     "'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')",
}


@pytest.mark.parametrize("line", BAD_FLAGS)
def test_bad_flags_are_one_line_and_exit_2(line, capsys):
    with pytest.raises(SystemExit) as info:
        tu.parse_args("test", shlex.split(line))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and BAD_FLAGS[line] in err


def test_flags_that_parse_near_a_refusal():
    """8 to 15 pixels a side are small but taken; a name that is no torchvision model gets no guess."""
    assert flags.image_size("8") == (8, 8) and flags.image_size("15x8") == (15, 8)
    with pytest.raises(argparse.ArgumentTypeError) as info:
        flags.plugin_ref("my_net")
    assert str(info.value) == "'my_net' is not FILE.py:NAME or module:NAME"


def test_help_shows_every_real_default():
    text = " ".join(tu.build_parser("x").format_help().split())
    assert "--seed N seed for weights" in text and "(default: 0)" in text  # 0 is a default, not "none"
    assert "(default: None)" not in text and "(default: False)" not in text


def test_bad_flags_are_printed_by_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        tu.parse_args("test", ["--batch-size", "0"])
    assert capsys.readouterr().err == ""


def test_global_batch_must_split_evenly():
    assert flags.per_process_batch(1024, 4) == 256 and flags.per_process_batch(256, 1) == 256
    with pytest.raises(UserError, match=r"--batch-size 1000 does not split evenly over 3 processes.*999 or 1002"):
        flags.per_process_batch(1000, 3)
    with pytest.raises(UserError, match=r"e\.g\. 8\)"):
        flags.per_process_batch(3, 8)


def test_warmup_then_cosine():
    total, warmup = 100, 10
    factors = [recipe.lr_factor(s, total, warmup, "cosine") for s in range(total)]
    assert factors[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert factors[warmup] == 1.0
    assert recipe.lr_factor(warmup + (total - warmup) // 2, total, warmup, "cosine") == pytest.approx(0.5)
    assert 0 < factors[-1] < 0.001
    assert all(a >= b for a, b in zip(factors[warmup:], factors[warmup + 1:]))  # decays monotonically
    assert recipe.lr_factor(5, 100, 0, "cosine") < 1.0  # no warm-up: decay starts at once


def test_scheduler_steps_per_optimizer_step():
    args = tu.parse_args("test", ["--base-lr", "0.4", "--epochs", "3", "--warmup-epochs", "1"])
    optimizer = recipe.make_optimizer(torch.nn.Linear(2, 2), args, torch.device("cpu"))
    cycles = [optimization.first_cycle(args.epochs, args.warmup_epochs, 4)]  # 4 steps per epoch
    scheduler = optimization.make_scheduler(optimizer, cycles, partial(recipe.lr_factor, schedule=args.lr_schedule))
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:4] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert lrs[4:] == pytest.approx([0.4 * recipe.lr_factor(s, 12, 4, "cosine") for s in range(4, 12)])


@pytest.mark.parametrize("history, expected", [
    ([], False), ([0.96], False), ([0.96, 0.97], True), ([0.96, 0.5, 0.97], False),
    ([0.1, 0.95, 0.95], True), ([0.1, 0.9499, 0.99], False),
])
def test_target_reached_needs_patience_consecutive_epochs(history, expected):
    assert tu.target_reached(history, 0.95, 2) is expected


def test_eval_summary_weighs_every_image_equally():
    # Two shards of 5 and 4 images: the mean of per-shard accuracies would be wrong.
    shards = [(5, 10.0, 5), (0, 8.0, 4)]
    totals = [sum(values) for values in zip(*shards)]
    result = tu.eval_summary(*totals)
    assert result == tu.EvalResult(accuracy=5 / 9, loss=2.0, samples=9)
    assert math.isnan(tu.eval_summary(0, 0, 0).accuracy)


def test_precision_on_cpu():
    cpu = torch.device("cpu")
    assert device_utils.configure_precision("auto", cpu).name == "fp32"
    assert device_utils.configure_precision("fp32", cpu).autocast_dtype is None
    assert device_utils.configure_precision("bf16", cpu).autocast_dtype == torch.bfloat16
    for mode in ("fp16", "tf32"):
        with pytest.raises(UserError, match=f"--precision {mode} needs a CUDA GPU"):
            device_utils.configure_precision(mode, cpu)
    with device_utils.configure_precision("bf16", cpu).autocast(cpu):
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16


def test_weights_round_trip_and_wrapped_prefixes(tmp_path):
    torch.manual_seed(1)
    source = WideResNet(num_classes=100)
    path = tmp_path / "w.pt"
    weights_file.save_weights(source, path)
    loaded = WideResNet(num_classes=100)
    weights_file.load_weights(loaded, path)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), loaded.state_dict().values()))
    # A state_dict saved from a DDP-wrapped model ('module.' prefixes) loads too.
    torch.save({"model": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)
    weights_file.load_weights(WideResNet(num_classes=100), path)
    # The checkpoint of a --model-ema run: its weights are the average's.
    average = {k: v + 1 if v.is_floating_point() else v for k, v in source.state_dict().items()}
    torch.save({"model": source.state_dict(), "model_ema": average}, path)
    assert all(torch.equal(v, average[k]) for k, v in weights_file.read_weights(path).state.items())


def test_weights_that_do_not_fit_are_refused(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(WideResNet(num_classes=10).state_dict(), path)
    with pytest.raises(UserError, match=r"does not fit WideResNet: its last layers have other shapes \(fc.weight is "
                                        r"\(10, 640\) there, \(100, 640\) here: weights for other classes\); to start "
                                        rf"from them with a new head for your classes, use --finetune {path} instead"):
        weights_file.load_weights(WideResNet(num_classes=100), path)
    torch.save(WideResNet(num_classes=100, in_channels=1).state_dict(), path)  # its first layer differs: no hint
    with pytest.raises(UserError, match=r"does not fit WideResNet: 0 missing, 0 unexpected and \d+ differently shaped "
                                        r"tensors \(e.g. [\w.]+\): weights of another --model or --dataset\?$"):
        weights_file.load_weights(WideResNet(num_classes=100), path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(UserError, match="is not a readable state_dict: not a file torch.save wrote, or a damaged one$"):
        weights_file.load_weights(WideResNet(num_classes=100), path)  # not torch.load's "(KeyError)": it says nothing
    path.write_bytes(b"")
    with pytest.raises(UserError, match=r"not a file torch.save wrote, or a damaged one \(it is empty\)$"):
        weights_file.load_weights(WideResNet(num_classes=100), path)
    with pytest.raises(UserError, match=r"^--weights \S+/inner.pt cannot be read \(Not a directory\)$"):
        weights_file.load_weights(WideResNet(num_classes=100), path / "inner.pt")  # the OS's reason, not "damaged"
    with pytest.raises(UserError, match="no such file"):
        weights_file.load_weights(WideResNet(num_classes=100), tmp_path / "missing.pt")
    torch.save(WideResNet(num_classes=100), path)  # the whole model, pickled: a common mistake
    with pytest.raises(UserError, match=r"holds pickled Python objects .a whole model saved with torch.save.model.\?.,"
                                        r" not a state_dict; save one with torch.save.model.state_dict"):
        weights_file.load_weights(WideResNet(num_classes=100), path)


def test_fast_settings_by_default():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    args = tu.parse_args("test", [])
    assert args.loader == "auto" and not args.compile
    assert du.choose_loader("auto", 10e6, 80e9) == (
        "device", "auto: the data set (10.0 MB) fits in 25% of the device's 80 GB")
    assert du.choose_loader("auto", 11, 40)[0] == "torchvision"  # more than a quarter of the memory
    assert du.choose_loader("auto", 10, 40)[0] == "device"
    assert du.choose_loader("device", 11, 40) == ("device", "--loader device")
    assert device_utils.memory_format(args.channels_last, cuda) == torch.channels_last  # tensor cores want NHWC
    assert device_utils.memory_format(args.channels_last, cpu) == torch.contiguous_format
    assert device_utils.memory_format(False, cuda) == torch.contiguous_format  # --no-channels-last
    assert device_utils.memory_format(True, cpu) == torch.channels_last        # --channels-last
    assert tu.parse_args("test", ["--no-channels-last"]).channels_last is False
    kernels = [recipe.make_optimizer(torch.nn.Linear(2, 2), args, device).param_groups[0]["fused"]
               for device in (cuda, cpu)]
    assert kernels == [True, None]  # one fused kernel on CUDA (the CPU has one too, so this builds here)
    assert tu.parse_args("test", ["--loader", "torchvision"]).loader == "torchvision"


def _small_run(extra):
    """(run, state, training loader) of a small convolutional model on 16 images, batches of 8."""
    rng = np.random.default_rng(0)
    data = du.InMemoryImages(rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8), rng.integers(0, 100, 16),
                             du.spec_preprocessing(du.CIFAR100))
    args = tu.parse_args("test", ["--batch-size", "8", "--synthetic", *extra])
    train_loader, test_loader = du.build_loaders(data, data, 8, loader="device")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 100))
    model.register_parameter("spare", torch.nn.Parameter(torch.zeros(2)))  # unused: no gradient (only DDP minds)
    info = DataInfo("cifar100", "test images", "test images", tuple(map(str, range(100))), data.prep, {})
    task = Task(model, "a small CNN", "test:cnn", train_loader, test_loader, info, "device", "--loader")
    run, state, _ = tu.prepare_run(task, args, single_process_context())
    return run, state, train_loader


def _train_two_steps(extra):
    """Two steps of a small convolutional model through the real loop; returns (run, loss sum)."""
    run, state, train_loader = _small_run(extra)
    done = tu.train_steps(run, iter(train_loader), state)
    assert done.images == 16
    return run, done.loss_sum


def test_model_ema_is_the_average_of_the_weights_every_n_steps():
    """--model-ema: AveragedModel updated after every --model-ema-steps-th optimizer step, its
    first update a copy; validation and --save-weights take the average."""
    run, state, loader = _small_run(["--model-ema", "--model-ema-steps", "2", "--model-ema-decay", "0.5",
                                     "--warmup-epochs", "0"])
    batches = list(loader)  # 2 batches

    def floats(model):
        return {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    tu.train_steps(run, batches[:1], state)  # step 1: no update
    assert int(run.ema.n_averaged) == 0
    tu.train_steps(run, batches[1:], state)  # step 2: the first update copies the model
    assert int(run.ema.n_averaged) == 1 and floats(run.ema.module).keys() == floats(run.module).keys()
    assert all(torch.equal(v, floats(run.module)[k]) for k, v in floats(run.ema.module).items())
    after_two = floats(run.module)
    tu.train_steps(run, batches, state)  # steps 3 and 4: one update, half the old average, half the model
    now, average = floats(run.module), floats(run.ema.module)
    assert all(torch.allclose(average[k], 0.5 * after_two[k] + 0.5 * now[k]) for k in now)
    assert not all(torch.equal(average[k], now[k]) for k in now)
    counts = {k: v for k, v in run.ema.module.state_dict().items() if not v.is_floating_point()}  # BN's batches seen
    assert counts and all(torch.equal(v, run.module.state_dict()[k]) for k, v in counts.items())  # copied, not averaged
    # --save-weights and model_best.pt keep the better of the two on validation, and say which.
    better, worse = {"epoch": 1, "val_accuracy": 0.5, "ema_val_accuracy": 0.6}, {"epoch": 1, "val_accuracy": 0.6,
                                                                                 "ema_val_accuracy": 0.5}
    assert run.trained(better) is run.ema.module and run.weights_metadata(better)["model_ema"] == {
        "model_ema_decay": 0.5, "model_ema_steps": 2}
    assert run.weights_metadata(better)["val_accuracy"] == 0.6
    assert run.trained(worse) is run.module and "model_ema" not in run.weights_metadata(worse)
    assert run.trained({**better, "ema_val_accuracy": 0.5}) is run.module  # a tie: the model
    # During the LR warm-up (2 epochs of 2 steps) each update copies: the average follows the model.
    run, state, loader = _small_run(["--model-ema", "--model-ema-steps", "2", "--model-ema-decay", "0.5"])
    tu.train_steps(run, list(loader) * 2, state)  # steps 1-4: updates at 2 and 4, both copies
    assert int(run.ema.n_averaged) == 0
    assert all(torch.equal(v, floats(run.module)[k]) for k, v in floats(run.ema.module).items())
    _small_run(["--model-ema", "--model-ema-steps", "200", "--epochs", "100"])  # 100 epochs of 2 steps: one update
    with pytest.raises(UserError, match="^--model-ema-steps 201 is more than this run's 200 optimizer steps"):
        _small_run(["--model-ema", "--model-ema-steps", "201", "--epochs", "100"])


def test_model_ema_follows_the_runs_length_by_default():
    """--model-ema without its decay and steps: an update every 32 steps (more often in a short
    run, 100 updates at least), and a half-life of 5% of the run; a given decay whose half-life
    is longer than the run is one warning line naming the flags."""
    args = tu.parse_args("test", ["--model-ema"])
    for total, every in ((360, 3), (100_000, 32), (50, 1)):
        ema = recipe.ema_schedule(args, total)
        assert ema.every == every and ema.half_life == pytest.approx(max(0.05 * total, every))
        assert recipe.ema_warning(args, ema, total) == []
    long = recipe.ema_schedule(tu.parse_args("test", ["--model-ema", "--model-ema-decay", "0.99"]), 360)
    assert (long.every, long.decay) == (3, 0.99) and long.half_life == pytest.approx(206.9, abs=0.1)
    assert recipe.ema_warning(args, long, 36) == [
        "WARNING: the model EMA's half-life (207 steps) is longer than this run's 36 steps: the average would be "
        "mostly the early weights; lower --model-ema-decay (now 0.99) or --model-ema-steps (now 3), or leave both "
        "out for a half-life of 5% of the run"]
    assert recipe.ema_schedule(tu.parse_args("test", []), 360) is None
    # A run no longer than its LR warm-up: each update restarts the average from the model.
    assert recipe.ema_warning(args, recipe.ema_schedule(args, 32), 32, warmup_steps=32) == [
        "WARNING: the model EMA restarts from the model at each update of the LR warm-up (32 steps), which lasts "
        "this whole run of 32 steps: the average is the model itself; lower --warmup-epochs or train longer"]
    assert recipe.ema_warning(args, recipe.ema_schedule(args, 32), 32, warmup_steps=31) == []


def test_a_run_from_before_the_derived_ema_defaults_resumes_without_its_flags():
    """Checkpoints from before ema_schedule recorded --model-ema's old defaults filled in (0.99
    every 32 steps): resuming without those flags goes on; any other recorded value must be given."""
    args = tu.parse_args("x", ["--model-ema"])
    defaults, recipe_flags = tu.resume_rules()
    saved = {**defaults, **vars(args), "model_ema_decay": 0.99, "model_ema_steps": 32}
    checkpoints.check_resume_flags(saved, vars(args), recipe_flags)  # no error
    with pytest.raises(UserError, match=r"continues the checkpoint's run, which had --model-ema-decay 0.9 \(now not "
                                        r"given\); rerun with its values"):
        checkpoints.check_resume_flags({**saved, "model_ema_decay": 0.9}, vars(args), recipe_flags)


def test_evaluation_counts_top5_from_the_models_own_outputs():
    """Top-1 and top-5 accuracy of an evaluation, against the model's logits read directly."""
    run, _, loader = _small_run([])
    result = tu.evaluate(run, run.module, loader)
    run.module.eval()
    with torch.no_grad():
        logits, labels = map(torch.cat, zip(*[(run.module(x), y) for x, y in loader]))
    assert result.samples == len(labels) == 16
    assert result.accuracy == (logits.argmax(1) == labels).double().mean().item()
    assert result.top5 == (logits.topk(5, 1).indices == labels[:, None]).any(1).double().mean().item()
    assert result.top5 >= result.accuracy


def test_clip_grad_norm_bounds_the_gradients_each_step_applies():
    """--clip-grad-norm: the gradients the last optimizer step used (kept until the next
    step's zero_grad) have at most that total norm; without it, far more here."""
    def norm(run):
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in run.module.parameters()
                                                     if p.grad is not None]))
    clipped, _ = _train_two_steps(["--clip-grad-norm", "0.001"])
    free, _ = _train_two_steps([])
    assert norm(clipped) <= 0.001 * (1 + 1e-5) < 0.01 < norm(free)


def test_compiled_training_matches_eager_with_a_parameter_that_gets_no_gradient():
    """One process, --compile: the DDP-only check of unused parameters looks at the module
    under the compiled wrapper, not at the wrapper (which it once took for DDP)."""
    eager, eager_loss = _train_two_steps([])
    compiled, compiled_loss = _train_two_steps(["--compile"])
    assert type(compiled.model).__name__ == "OptimizedModule" and compiled.module is compiled.model._orig_mod
    assert list(compiled.module.state_dict()) == list(eager.module.state_dict())  # checkpoints keep plain keys
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    for name, value in eager.module.state_dict().items():
        assert torch.allclose(compiled.module.state_dict()[name].float(), value.float(), atol=1e-5), name


# ---------------------------------------------------------------------------------------------
# Defects that only CUDA shows in training, checked here where the CPU can show them too.

def _conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10))


def _one_step(model, optimizer, scaler=None, factor=1.0):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean() * factor
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def _fused_sgd(model):
    """recipe.py's SGD as it is built on CUDA (the CPU has the same fused kernel)."""
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True)


def test_momentum_buffers_exist_from_the_start_in_each_parameters_layout():
    model = _conv_model().to(memory_format=torch.channels_last)
    optimizer = _fused_sgd(model)
    optimization.prefill_momentum(optimizer)
    for param in model.parameters():
        buffer = optimizer.state[param]["momentum_buffer"]
        assert torch.equal(buffer, torch.zeros_like(param)) and buffer.stride() == param.stride()
    reference = _conv_model().to(memory_format=torch.channels_last)  # SGD creating its own buffers
    plain = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    for _ in range(3):
        _one_step(model, optimizer)
        _one_step(reference, plain)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours, theirs)  # the same training, bit for bit


def test_a_skipped_fp16_first_step_leaves_zero_momentum_not_uninitialised_memory():
    """GradScaler skips a step with an overflow; the fused kernel then returns before filling
    the momentum buffers it created (the CPU has the same fused kernel)."""
    model = _conv_model()
    optimizer = _fused_sgd(model)
    optimization.prefill_momentum(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = [param.detach().clone() for param in model.parameters()]
    _one_step(model, optimizer, scaler, factor=math.inf)  # overflow: the step is skipped
    assert scaler.get_scale() == 2.0**15
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(not optimizer.state[p]["momentum_buffer"].any() for p in model.parameters())
    _one_step(model, optimizer, scaler)
    reference = _conv_model()
    _one_step(reference, torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9, nesterov=True,
                                         weight_decay=5e-4))
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.isfinite(ours).all() and torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def test_resumed_optimizer_state_takes_the_parameters_layout():
    """A checkpoint written in NCHW (the CPU, or --no-channels-last) resumed by a channels_last
    model: load_state_dict keeps NCHW buffers, which CUDA's fused kernel refuses."""
    args, cpu = tu.parse_args("x", []), torch.device("cpu")
    saved = _conv_model()
    saved_optimizer = recipe.make_optimizer(saved, args, cpu)
    _one_step(saved, saved_optimizer)
    model = _conv_model().to(memory_format=torch.channels_last)
    optimizer = _fused_sgd(model)  # this device's: fused, where the checkpoint's was not
    kernels = optimization.kernel_choices(optimizer)
    optimizer.load_state_dict(saved_optimizer.state_dict())
    conv = model[0].weight
    assert optimizer.state[conv]["momentum_buffer"].stride() != conv.stride()  # what load_state_dict leaves
    assert optimizer.param_groups[0]["fused"] is None  # and the saved run's kernel choice
    optimization.fit_optimizer_to_params(optimizer, kernels)
    for param, saved_param in zip(model.parameters(), saved.parameters()):
        buffer = optimizer.state[param]["momentum_buffer"]
        assert buffer.stride() == param.stride()
        assert torch.equal(buffer, saved_optimizer.state[saved_param]["momentum_buffer"])  # same values
    assert all(group["fused"] is True for group in optimizer.param_groups)  # this device's kernels


def test_nccl_version_is_the_loaded_librarys():
    assert nccl_log.nccl_version_name(22703) == "2.27.3" and nccl_log.nccl_version_name(2804) == "2.8.4"
    maps = ("7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
            "7f20-7f30 r-xp 00000000 08:01 34 /cluster/work/support/nccl/lib/libnccl.so.2.27.3\n"
            "7f40-7f50 rw-p 00000000 00:00 0 \n")
    assert nccl_log.loaded_library("libnccl", maps) == "/cluster/work/support/nccl/lib/libnccl.so.2.27.3"
    assert nccl_log.loaded_library("libnccl", maps.splitlines()[0]) is None
    line = nccl_log.nccl_report()  # this process: PyTorch's own NCCL when its wheel has one
    assert re.fullmatch(r"NCCL version: (\d+\.\d+\.\d+, loaded from /\S+ \(PyTorch was built with [\d.]+\)"
                        r"|[\d.]+ \(linked into PyTorch\))", line), line


def test_every_entry_point_makes_its_gpu_current_and_autotunes(monkeypatch):
    """train.py as much as train_ddp.py (through use_device): the current CUDA device is
    cuda:LOCAL_RANK, and cuDNN autotuning is on. CUDA is faked here; tests/test_gpu.py has the real one."""
    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = device_utils.single_process_context()
    assert ctx.device == torch.device("cuda", 2) and made_current == [torch.device("cuda", 2)]
    assert torch.backends.cudnn.benchmark is True
    with pytest.raises(UserError, match="LOCAL_RANK=5 but this node shows only 4 GPU"):
        device_utils.use_device(5)


def test_an_extension_is_a_warm_restart_from_where_the_schedule_stood():
    ls = optimization
    cosine, constant = (partial(recipe.lr_factor, schedule=name) for name in ("cosine", "constant"))
    first = [ls.first_cycle(10, 2, 10)]  # 10 epochs of 10 steps: 100 steps, 20 of warm-up
    assert [ls.schedule_factor(s, first, cosine) for s in range(100)] == [recipe.lr_factor(s, 100, 20, "cosine")
                                                                          for s in range(100)]
    for at in (100, 60):  # a finished run (factor ~0), and one extended half-way (factor ~0.6)
        cycles = ls.extend(first, 15, 2, 10, at, cosine)  # to 15 epochs, 2 warm-up epochs
        before = ls.schedule_factor(at, first, cosine)
        warmup = min(20, (150 - at) // 4)  # --warmup-epochs, at most a quarter of the extension
        assert cycles[-1] == ls.Cycle(at, warmup, 150, before) and warmup == (12 if at == 100 else 20)
        factors = [ls.schedule_factor(s, cycles, cosine) for s in range(at, 150)]
        assert abs(factors[0] - before) <= (1 - before) / warmup + 1e-12  # no jump: one warm-up increment
        assert factors[warmup] == 1.0 and max(factors) == 1.0  # back at --base-lr after the warm-up
        assert all(a >= b for a, b in zip(factors[warmup:], factors[warmup + 1:])) and 0 < factors[-1] < 0.01
        assert [ls.schedule_factor(s, cycles, cosine) for s in range(at)] == [recipe.lr_factor(s, 100, 20, "cosine")
                                                                              for s in range(at)]  # the past stays
    extended = ls.extend(first, 15, 2, 10, 100, constant)
    assert {ls.schedule_factor(s, extended, constant) for s in range(20, 150)} == {1.0}  # only back to the top


@pytest.fixture
def tf32_restored():
    """PyTorch's defaults again after the test (TF32 convolutions, IEEE matmuls)."""
    yield
    device_utils.set_tf32(matmuls=False, convolutions=True)


def tf32_reads():
    """Every read of the TF32 switches, older API and newer (2.9+): each raises on a mix."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    reads = {"matmul.allow_tf32": matmul.allow_tf32, "get_float32_matmul_precision":
             torch.get_float32_matmul_precision(), "cudnn.allow_tf32": cudnn.allow_tf32}
    if hasattr(matmul, "fp32_precision"):
        reads.update({"matmul.fp32_precision": matmul.fp32_precision,
                      "cudnn.conv.fp32_precision": cudnn.conv.fp32_precision})
    return reads


def newer_api_write(mode):
    """What torch.compile's code or a user's may have set before (PyTorch 2.9+ only)."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = mode


@pytest.mark.oldest_torch
@pytest.mark.parametrize("before", ["ieee", "tf32"])
@pytest.mark.parametrize("requested, tf32", [("fp32", False), ("tf32", True), ("bf16", True)])
def test_tf32_switches_read_alike_through_both_apis(monkeypatch, tf32_restored, before, requested, tf32):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # as on a GH200
    newer_api_write(before)
    assert device_utils.configure_precision(requested, torch.device("cuda", 0)).name == requested
    reads = tf32_reads()
    assert reads["matmul.allow_tf32"] is tf32 and reads["cudnn.allow_tf32"] is tf32
    assert reads["get_float32_matmul_precision"] == ("high" if tf32 else "highest")
    if "matmul.fp32_precision" in reads:  # what inductor reads
        assert reads["matmul.fp32_precision"] == ("tf32" if tf32 else "ieee")
        assert (reads["cudnn.conv.fp32_precision"] == "tf32") is tf32


@pytest.mark.oldest_torch
def test_auto_precision_takes_only_native_bf16(monkeypatch, tf32_restored):
    """A GPU that only emulates bf16 (before Ampere) trains in fp32 under --precision auto and
    refuses --precision bf16; PyTorch counts emulation as support unless asked not to."""
    gpu = torch.device("cuda", 0)  # configure_precision only looks at its type
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert device_utils.configure_precision("auto", gpu).name == "fp32"
    with pytest.raises(UserError, match="no bf16 support"):
        device_utils.configure_precision("bf16", gpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # H100, GH200
    assert device_utils.configure_precision("auto", gpu) == device_utils.Precision("bf16", torch.bfloat16)


def test_nccl_gets_its_gpu_at_init_and_more_time_than_gloo():
    timeout = timedelta(minutes=10)
    gpu = torch.device("cuda", 3)
    assert device_utils.group_options(gpu, timeout) == {
        "backend": "nccl", "timeout": timeout + timedelta(minutes=processes.NCCL_TIMEOUT_MARGIN_MIN), "device_id": gpu}
    assert device_utils.group_options(torch.device("cpu"), timeout) == {"backend": "gloo", "timeout": timeout}


def test_an_extension_says_what_the_learning_rate_does():
    def said(schedule, cycle):
        args = tu.parse_args("test", ["--epochs", "5", "--lr-schedule", schedule, "--base-lr", "0.01"])
        return optimization.describe_extension(3, args.epochs, args.base_lr, args.lr_schedule, cycle, steps_per_epoch=4)
    assert said("cosine", optimization.Cycle(12, 1, 20, 0.0)) == (
        "Extending the run from 3 to 5 epochs: warm restart of the learning rate from 0 back up to 0.01 over 1 step "
        "(0.25 epochs), then cosine to 0 at epoch 5")
    assert said("constant", optimization.Cycle(12, 2, 20, 1.0)) == (
        "Extending the run from 3 to 5 epochs at the constant learning rate 0.01")  # not "from 0.01 back up to 0.01"
    assert said("cosine", optimization.Cycle(12, 0, 20, 0.75)) == (  # not "back up ... over 0 steps (0 epochs)"
        "Extending the run from 3 to 5 epochs: the learning rate goes from 0.0075 (the next step's on the 3-epoch "
        "schedule) to 0.01 at once (no warm-up steps), then cosine to 0 at epoch 5")  # not "back": it may never have been
    assert said("cosine", optimization.Cycle(12, 8, 20, 1.0)) == (  # a run that ended in its warm-up's last step
        "Extending the run from 3 to 5 epochs: the learning rate is at its peak 0.01 already, then cosine to 0 at "
        "epoch 5")  # not "warm restart ... from 0.01 back up to 0.01 over 8 steps"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_device_cuda_without_a_gpu_is_one_line_and_cpu_is_the_cpu():
    from device_utils import get_device
    assert get_device(0, "cpu") == get_device(0, "auto") == torch.device("cpu")
    with pytest.raises(UserError, match=r"^--device cuda, and PyTorch sees no GPU here"):
        get_device(0, "cuda")


def test_compile_caches_go_to_the_checkpoint_folder_unless_the_user_chose_a_folder(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    environ = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torchinductor_ana")}  # PyTorch's default, written on import
    line = use_compile_cache(ckpt, environ, temp_dir=tmp_path)
    assert environ["TORCHINDUCTOR_CACHE_DIR"] == str(ckpt / "compile_cache") and (ckpt / "compile_cache").is_dir()
    assert line.endswith("compile_cache: a resumed or requeued job reuses what this start compiles")
    (ckpt / "compile_cache" / "fxgraph").mkdir()  # what inductor keeps there
    assert use_compile_cache(ckpt, {}).endswith(
        "compile_cache, with what an earlier start compiled: reused where it fits")
    own = {"TORCHINDUCTOR_CACHE_DIR": "/project/inductor"}  # the user's: kept
    assert use_compile_cache(ckpt, own, temp_dir=tmp_path) == (
        "compile cache /project/inductor (from TORCHINDUCTOR_CACHE_DIR)")
    assert own == {"TORCHINDUCTOR_CACHE_DIR": "/project/inductor"}
    bare = {}
    assert "without --checkpoint-dir a requeued job compiles again" in use_compile_cache(None, bare) and bare == {}

    def no_flock(*args):  # a Lustre or NFS mount without flock: inductor's cache locks would fail there
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(compiling.fcntl, "flock", no_flock)
    assert "takes no flock(2) locks" in use_compile_cache(ckpt, bare) and bare == {}


def test_compile_mode_auto_is_cuda_graphs_where_they_are_safe_and_graph_modes_are_refused_where_not():
    assert compiling.compile_mode("auto", "cuda") == ("reduce-overhead",
                                                      "auto on CUDA: forward and backward replayed as CUDA graphs")
    assert compiling.compile_mode("auto", "cpu") == ("default", "auto on the CPU, where there are no CUDA graphs")
    mode, why = compiling.compile_mode("auto", "cuda", accumulate=2)
    assert mode == "default" and why.startswith("auto with --accumulate")
    mode, why = compiling.compile_mode("auto", "cuda", distributed=True)
    assert mode == "default" and "under DDP" in why and "--compile-mode reduce-overhead tries them" in why
    assert compiling.compile_mode("max-autotune-no-cudagraphs", "cpu", True, 4) == ("max-autotune-no-cudagraphs",
                                                                                  "--compile-mode")
    for mode, instead in zip(compiling.GRAPH_MODES, ("default", "max-autotune-no-cudagraphs"), strict=True):
        assert compiling.compile_mode(mode, "cuda", distributed=True) == (mode, "--compile-mode")  # asked: tried
        with pytest.raises(UserError, match=f"--compile-mode {mode} replays CUDA graphs, which need a CUDA GPU; on "
                                            f"the CPU use --compile-mode {instead}$"):
            compiling.compile_mode(mode, "cpu")
        with pytest.raises(UserError, match=f"--compile-mode {mode} replays CUDA graphs, whose next replay would "
                                            "overwrite the gradients of --accumulate's first micro-batches; use "
                                            "--compile-mode default with --accumulate"):
            compiling.compile_mode(mode, "cuda", accumulate=2)
    assert set(compiling.GRAPH_MODES) < set(flags.COMPILE_MODES)


@pytest.mark.oldest_torch
def test_cuda_graphs_skipped_under_ddp_with_batchnorm_name_the_known_cause(tmp_path):
    """A one-process gloo group: DDP around a model with BatchNorm, and without."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with_norm = DistributedDataParallel(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)))
        without = DistributedDataParallel(_conv_model())
        assert compiling.known_cause(with_norm) == (", a known PyTorch limit with DDP and BatchNorm "
                                                    "(pytorch/pytorch#139207)")
        assert compiling.known_cause(without) == ""
    finally:
        dist.destroy_process_group()
    assert compiling.known_cause(torch.nn.BatchNorm2d(3)) == ""  # not DDP-wrapped


@pytest.mark.oldest_torch
def test_the_private_pytorch_read_exists():
    """engine/private_torch.py's two reads fall back to 'unknown' where PyTorch removed them:
    this says they are still there, on the oldest PyTorch and the newest (that the counter
    counts: the test below)."""
    import torch._dynamo.utils as dynamo_utils  # gone: cudagraph_skips is always 0 (its key: the test below)
    assert isinstance(dynamo_utils.counters, dict)
    if torch.distributed.is_nccl_available():  # a CUDA build of PyTorch, as pip installs on Linux
        assert callable(private_torch.nccl_trace_dumper())


@pytest.mark.oldest_torch
def test_a_graph_run_without_cuda_graphs_is_counted_and_said(tmp_path):
    """PyTorch's count of compiled graphs run without CUDA graphs (a private counter: this test
    is what says it still exists and counts): on the CPU, reduce-overhead skips every graph,
    and the line after the first step says how many, from the count before the compile."""
    compilation = compiling.prepare_compile("reduce-overhead", "cuda", False, 1, None, {})  # as on CUDA
    assert compilation.graphs and compilation.skips_before == private_torch.cudagraph_skips()
    model = _conv_model()
    torch.compile(model, mode=compilation.mode)(torch.randn(2, 3, 8, 8)).sum().backward()  # on the CPU: no graphs
    skipped = private_torch.cudagraph_skips() - compilation.skips_before
    assert skipped >= 1
    timing, skip = compilation.after_first_step(12.34, model)
    assert timing.startswith("torch.compile: the first step took 12.3s, compiling included; compile cache in ")
    assert skip == (f"torch.compile: PyTorch ran {skipped} compiled graph(s) without CUDA graphs, so those steps "
                    "launch every kernel from the host; TORCH_LOGS=perf_hints,cudagraphs says why")
    # The default mode replays no graphs: nothing to say, whatever was skipped.
    assert len(compiling.Compilation("default", "", "cache").after_first_step(1.0, model)) == 1


@pytest.mark.parametrize("losses, first_step, first_bad", [
    ([1.0, 2.0, 0.5], 1, 0),
    ([1.0, float("nan"), 2.0, float("inf")], 1, 2),
    ([1.0, 2.0, float("inf"), float("nan")], 6, 8),  # resumed at step 6: the third step is step 8
    ([-float("inf"), 1.0], 3, 3),
])
def test_loss_books_find_the_first_non_finite_step_from_the_loss_alone(losses, first_step, first_bad):
    books = tu.LossBooks(torch.device("cpu"), first_step=first_step)
    for loss in losses:
        books.add(torch.tensor(loss), 4)  # the same two arguments every step: a CUDA graph can replay it
    totals = books.totals(lr=0.1, stop=0)
    assert (totals.images, totals.first_bad, totals.lr, totals.stop) == (4 * len(losses), first_bad, 0.1, 0)
    if not first_bad:
        assert totals.loss_sum == 4 * sum(losses)
    else:
        assert not math.isfinite(totals.loss_sum)


def test_a_warm_up_that_fills_the_run_is_said():
    """--epochs 2 with the default 2 warm-up epochs ended at the peak LR, no cosine phase at all,
    while the Recipe line said "2 warm-up epochs, then cosine" and nothing else."""
    assert tu.warmup_notes(2, 2, "cosine") == [
        "Note: the 2 warm-up epochs are the whole of this 2-epoch run: it ends at the base LR, before any cosine decay "
        "(a lower --warmup-epochs or a higher --epochs has one)"]
    assert tu.warmup_notes(2, 1, "cosine") == [
        "Note: the 2 warm-up epochs are longer than this 1-epoch run: the learning rate peaks at 50% of the base LR"]
    assert tu.warmup_notes(2, 2, "constant") == []  # it stays at the base LR after a warm-up anyway
    assert tu.warmup_notes(2, 3, "cosine") == tu.warmup_notes(0, 1, "cosine") == []
