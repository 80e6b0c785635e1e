"""The loop's own cost: train.py's loop (train_utils.train_steps over the device loader)
against a bare PyTorch loop doing the same work on a nearly free model (one Linear layer),
where nothing but the loops themselves is left to compare:

    python tools/loop_overhead.py                     # 1 CPU thread, batch 128, --augment flip
    python tools/loop_overhead.py --threads 2 --steps 500
    srun --gpus=1 python tools/loop_overhead.py       # on a GPU (train.py's device): launches and syncs
    python tools/loop_overhead.py --recipe="--mixup-alpha 0.2 --cutmix-alpha 1.0 --model-ema"   # what they cost

Both loops gather a batch of synthetic CIFAR-100 images (uint8, on the device), flip half of
them, normalize (one multiply-add per value), run the model, the loss (cross-entropy with
label smoothing 0.1), the backward pass, Nesterov SGD with weight decay and a schedule step,
and keep the loss on the device. ``--recipe`` adds flags to the project's loop alone: what
they cost per step. Each loop runs ``--repeats`` times, alternating; the best of each counts.
"""

import argparse
import shlex
import sys
import time
from itertools import islice
from pathlib import Path

import torch
import torch.nn as nn

if __package__ in (None, ""):  # run as python tools/NAME.py: the project's modules are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_utils as tu  # noqa: E402
from dataset_utils import normalization  # noqa: E402
from device_utils import single_process_context  # noqa: E402
from engine.cli import OneLineParser, run_cli  # noqa: E402
from engine.flags import positive_int  # noqa: E402
from engine.processes import synchronize  # noqa: E402

MODEL = f"{Path(__file__).resolve()}:OneLinear"


class OneLinear(nn.Module):
    """A nearly free model: one Linear layer on the flattened image."""

    def __init__(self, num_classes, in_channels, image_size=(32, 32)):
        super().__init__()
        self.fc = nn.Linear(in_channels * image_size[0] * image_size[1], num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))


def parse(argv=None):
    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", metavar="N", type=positive_int, default=1,
                        help="torch's CPU threads (default: %(default)s)")
    parser.add_argument("--batch-size", metavar="IMAGES", type=positive_int, default=128,
                        help="images per step (default: %(default)s)")
    parser.add_argument("--steps", metavar="STEPS", type=positive_int, default=300,
                        help="timed steps per repeat (default: %(default)s)")
    parser.add_argument("--repeats", metavar="N", type=positive_int, default=3,
                        help="timed runs of each loop (default: %(default)s)")
    parser.add_argument("--recipe", metavar="FLAGS", default="",
                        help="train.py flags for the project's loop alone, as one word: --recipe=\"--model-ema\"")
    return parser.parse_args(argv)


def project_run(opts):
    """(run, state, the training loader) of train.py's defaults on the Linear model."""
    args = tu.parse_args("loop_overhead", ["--synthetic", "--model", MODEL, "--batch-size", str(opts.batch_size),
                                           "--augment", "flip", "--loader", "device", "--log-interval", "0",
                                           "--precision", "fp32", "--no-channels-last", *shlex.split(opts.recipe)])
    ctx = single_process_context()
    task = tu.build_task(args, ctx)
    # The LR schedule is a table of --epochs' steps: the repeats may run past that many epochs.
    per_epoch = tu.limited(task.train_loader, args.limit_batches)  # prepare_run's steps per epoch
    args.epochs = max(args.epochs, -(-(5 + opts.repeats * opts.steps) // per_epoch))  # ceil
    run, state, _ = tu.prepare_run(task, args, ctx)
    return run, state, task.train_loader


def time_project(run, state, loader, steps):
    """Seconds of ``steps`` steps of the project's loop (the epoch's totals read once, as fit does)."""
    synchronize(run.ctx.device)
    start = time.perf_counter()
    tu.train_steps(run, islice(iter(loader), steps), state)  # ends in the epoch's one host sync
    return time.perf_counter() - start


def time_bare(images, labels, steps, batch, device):
    """Seconds of ``steps`` steps of a bare loop doing the project's work, written out."""
    torch.manual_seed(0)
    model = OneLinear(100, 3).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    scale, shift = normalization((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761), torch.uint8, device)
    order = torch.randperm(len(labels), device=device)
    total = torch.zeros((), device=device)
    synchronize(device)
    start = time.perf_counter()
    for step in range(steps):
        index = order[step * batch:(step + 1) * batch]
        x = images[index]  # (B, H, W, C) uint8
        flipped = torch.rand(batch, device=device) < 0.5
        x = torch.addcmul(shift, torch.where(flipped[:, None, None, None], x.flip(2), x), scale).permute(0, 3, 1, 2)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), labels[index])
        loss.backward()
        optimizer.step()
        scheduler.step()
        total += loss.detach()
    total.item()  # the one host sync, as the project's epoch
    return time.perf_counter() - start


def main(argv=None):
    opts = parse(argv)
    torch.set_num_threads(opts.threads)
    run, state, loader = project_run(opts)  # on train.py's device: CUDA when there is one
    images, labels = loader.images, loader.labels  # the device loader's data set, on the device
    steps = min(opts.steps, len(loader))
    time_project(run, state, loader, 5), time_bare(images, labels, 5, opts.batch_size, loader.device)  # warm-up
    project, bare = [], []
    for _ in range(opts.repeats):
        project.append(time_project(run, state, loader, steps))
        bare.append(time_bare(images, labels, steps, opts.batch_size, loader.device))
    rates = [steps * opts.batch_size / min(seconds) for seconds in (project, bare)]
    print(f"\n{steps} steps of {opts.batch_size} images, {loader.device.type}, {opts.threads} thread(s), best of "
          f"{opts.repeats}" + (f", project with {opts.recipe}" if opts.recipe else ""))
    print(f"project loop: {rates[0]:,.0f} img/s ({1e3 * min(project) / steps:.3f} ms/step)")
    print(f"bare loop:    {rates[1]:,.0f} img/s ({1e3 * min(bare) / steps:.3f} ms/step)")
    print(f"ratio: {rates[0] / rates[1]:.2f}x (project / bare)")


if __name__ == "__main__":
    run_cli(main)
