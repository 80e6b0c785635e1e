"""The one training loop behind train.py and train_ddp.py: flags, recipe, LR schedule,
training, evaluation, metrics and logging.

Both entry points build the data loaders and the model and call ``fit``. train_ddp.py also
joins a process group, shards the data by rank and wraps the model in DDP; nothing here
needs to know. Only global rank 0 prints and writes files.
"""

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from itertools import islice
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from dataset_utils import NUM_CLASSES, load_cifar100, set_loader_epoch
from device_utils import UserError, all_reduce_sum, broadcast_buffers, env_rank, synchronize
from model import WideResNet

PRECISIONS = ("auto", "bf16", "fp16", "tf32", "fp32")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MAX_AUTO_WORKERS = 8


# ---------------------------------------------------------------------------------------------
# Command line: one definition of the flags for both entry points.

class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the docstring's command examples as written and show every default that has a value."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line, printed by global rank 0 only
    (every rank parses the same flags, so the others would only repeat it)."""

    def error(self, message):
        if _rank_or_zero() == 0:
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def _checked(cast, is_valid, what):
    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not is_valid(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


positive_int = _checked(int, lambda v: v > 0, "a positive integer")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked(float, lambda v: 0 < v < math.inf, "a positive number")
non_negative_float = _checked(float, lambda v: 0 <= v < math.inf, "a number >= 0")
fraction = _checked(float, lambda v: 0 <= v <= 1, "a number between 0 and 1")
below_one = _checked(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def build_parser(description):
    parser = _OneLineParser(description=description, formatter_class=_Formatter)
    stop = parser.add_argument_group("run length and early stopping")
    stop.add_argument("--epochs", metavar="EPOCHS", type=positive_int, default=100,
                      help="maximum number of passes over the training set")
    stop.add_argument("--target-accuracy", metavar="FRACTION", type=fraction, default=0.95,
                      help="stop early once validation accuracy (fraction 0-1) has been at or above "
                           "this for --patience consecutive epochs")
    stop.add_argument("--patience", metavar="EPOCHS", type=positive_int, default=2,
                      help="consecutive epochs (count) at or above --target-accuracy before stopping")

    recipe = parser.add_argument_group("recipe (identical for train.py and train_ddp.py)")
    recipe.add_argument("--batch-size", metavar="IMAGES", type=positive_int, default=256,
                        help="global batch in images per optimizer step, split evenly over all processes")
    recipe.add_argument("--base-lr", metavar="LR", type=positive_float, default=0.01,
                        help="peak learning rate, used as given (not scaled with batch size or GPU count)")
    recipe.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                        help="after warm-up: cosine decay to 0 at the last step of --epochs, or constant")
    recipe.add_argument("--warmup-epochs", metavar="EPOCHS", type=non_negative_float, default=2.0,
                        help="epochs (may be fractional) of linear learning-rate warm-up up to --base-lr")
    recipe.add_argument("--momentum", metavar="COEFF", type=below_one, default=0.9,
                        help="SGD momentum coefficient (0 = plain SGD)")
    recipe.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True,
                        help="Nesterov momentum (needs --momentum > 0)")
    recipe.add_argument("--weight-decay", metavar="COEFF", type=non_negative_float, default=5e-4,
                        help="SGD L2 weight-decay coefficient, applied to all parameters")
    recipe.add_argument("--label-smoothing", metavar="FRACTION", type=below_one, default=0.1,
                        help="label smoothing of the training loss (fraction of probability mass); "
                             "the reported validation loss is plain cross-entropy")
    recipe.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto = bf16 autocast on GPUs that support it, else fp32; fp16 = autocast "
                             "with GradScaler (CUDA only); tf32 = fp32 with TF32 matmuls and convolutions "
                             "(CUDA only); fp32 = strict fp32")

    data = parser.add_argument_group("data")
    data.add_argument("--data-dir", metavar="DIR", default=None,
                      help="directory holding cifar-100-python/ (default: datasets/ beside the scripts)")
    data.add_argument("--download", action=argparse.BooleanOptionalAction, default=True,
                      help="download CIFAR-100 (~160 MB, global rank 0 only) if it is missing")
    data.add_argument("--synthetic", action="store_true",
                      help="random images and labels of CIFAR-100's shape and size instead of the data "
                           "set: for smoke tests and throughput; accuracy is meaningless")
    data.add_argument("--num-workers", metavar="N", type=non_negative_int, default=None,
                      help="data-loader worker processes per training process (default: CPU cores per "
                           f"process - 1, at most {MAX_AUTO_WORKERS})")
    data.add_argument("--seed", metavar="N", type=non_negative_int, default=0,
                      help="seed for weights, shuffling, augmentation and dropout (CPU runs repeat exactly)")

    run = parser.add_argument_group("run control and output")
    run.add_argument("--limit-batches", metavar="BATCHES", type=positive_int, default=None,
                     help="at most this many training and this many evaluation batches per epoch "
                          "and process (smoke runs, tests)")
    run.add_argument("--metrics-file", metavar="PATH", default=None,
                     help="append one JSON line per epoch to this file (global rank 0)")
    run.add_argument("--weights", metavar="PATH", default=None,
                     help="start from these model weights (a state_dict file, e.g. from the guide's model)")
    run.add_argument("--save-weights", metavar="PATH", default=None,
                     help="write the final model's state_dict here (global rank 0, atomically)")
    run.add_argument("--eval-only", action="store_true",
                     help="evaluate the model (see --weights) on the test set once and exit")
    return parser


def parse_args(description, argv=None):
    parser = build_parser(description)
    args = parser.parse_args(argv)
    if args.nesterov and args.momentum == 0:
        parser.error("--nesterov needs --momentum > 0; for plain SGD add --no-nesterov")
    return args


def per_process_batch(global_batch, world_size):
    """Images per process per step; refuses to silently drop part of the global batch."""
    if global_batch % world_size:
        lower, upper = global_batch // world_size * world_size, -(-global_batch // world_size) * world_size
        examples = f"{lower} or {upper}" if lower else str(upper)
        raise UserError(f"--batch-size {global_batch} does not split evenly over {world_size} processes; "
                        f"use a multiple of {world_size} (e.g. {examples})")
    return global_batch // world_size


def default_num_workers(local_world_size):
    """One loader worker per spare CPU core of this process's share, capped."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MAX_AUTO_WORKERS, cores // local_world_size - 1))


# ---------------------------------------------------------------------------------------------
# Small pure pieces of the recipe.

def lr_factor(step, total_steps, warmup_steps, schedule):
    """Multiplier of --base-lr for optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps`` (reaching 1 at the last warm-up step), then constant or cosine to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def target_reached(history, target, patience):
    """True when the last ``patience`` validation accuracies are all >= ``target``."""
    return len(history) >= patience and all(acc >= target for acc in history[-patience:])


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # fraction of test images classified correctly
    loss: float      # mean cross-entropy per image
    samples: int     # test images seen, summed over all ranks


def eval_summary(correct, loss_sum, count):
    """Metrics from sums over all ranks: each image weighs the same, however uneven the shards."""
    if count <= 0:
        return EvalResult(math.nan, math.nan, 0)
    return EvalResult(correct / count, loss_sum / count, int(count))


@dataclass(frozen=True)
class Precision:
    name: str                     # bf16, fp16, tf32 or fp32
    autocast_dtype: object = None  # torch dtype for autocast, None for fp32 math

    def autocast(self, device):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)


def configure_precision(requested, device):
    """Resolve --precision for ``device`` and set the TF32 switches; refuse combinations that
    cannot work."""
    cuda = device.type == "cuda"
    if requested == "auto":
        requested = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if requested in ("fp16", "tf32") and not cuda:
        raise UserError(f"--precision {requested} needs a CUDA GPU; on the CPU use fp32 (or bf16)")
    if requested == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise UserError("--precision bf16: this GPU has no bf16 support; use fp16 or fp32")
    if cuda:
        # PyTorch lets cuDNN use TF32 for convolutions by default, so the guide's "fp32" was
        # partly TF32. Here fp32 means fp32; every other mode allows TF32 for fp32 leftovers.
        torch.backends.cuda.matmul.allow_tf32 = requested != "fp32"
        torch.backends.cudnn.allow_tf32 = requested != "fp32"
    return Precision(requested, AUTOCAST_DTYPES.get(requested))


def make_optimizer(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum,
                           nesterov=args.nesterov, weight_decay=args.weight_decay)


def make_scheduler(optimizer, args, steps_per_epoch):
    """Per-step LR schedule (LambdaLR multiplies --base-lr by ``lr_factor``)."""
    factor = partial(lr_factor, total_steps=args.epochs * steps_per_epoch,
                     warmup_steps=round(args.warmup_epochs * steps_per_epoch), schedule=args.lr_schedule)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------
# Building: data, model, weights.

def make_loaders(args, ctx):
    """This rank's (train_loader, test_loader) for the flags."""
    workers = args.num_workers if args.num_workers is not None else default_num_workers(ctx.local_world_size)
    return load_cifar100(per_process_batch(args.batch_size, ctx.world_size), num_workers=workers,
                         data_dir=args.data_dir, rank=ctx.rank, world_size=ctx.world_size, seed=args.seed,
                         download=args.download, synthetic=args.synthetic,
                         pin_memory=ctx.device.type == "cuda")


def build_model(args, ctx):
    """The guide's model on this rank's device, the same initial weights on every rank."""
    torch.manual_seed(args.seed)
    model = WideResNet(num_classes=NUM_CLASSES)
    if args.weights:
        load_weights(model, args.weights)
    model.to(ctx.device)
    # From here on each rank draws its own dropout masks and augmentations.
    torch.manual_seed(args.seed + ctx.rank)
    return model


def _strip_prefixes(state):
    """Accept state_dicts saved from a DDP-wrapped or torch.compile'd model too."""
    def clean(key):
        for prefix in ("module.", "_orig_mod."):
            key = key.removeprefix(prefix)
        return key
    return {clean(key): value for key, value in state.items()}


def load_weights(model, path):
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"--weights {path}: no such file", same_on_every_rank=False) from None
    except Exception as err:  # not a torch file, truncated, or pickled objects we refuse to run
        raise UserError(f"--weights {path} is not a readable state_dict ({type(err).__name__})",
                        same_on_every_rank=False) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise UserError(f"--weights {path} holds a {type(state).__name__}, not a state_dict")
    state, own = _strip_prefixes(state), model.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    reshaped = [k for k in own.keys() & state.keys() if tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or reshaped:
        example = sorted(missing or unexpected or reshaped)[0]
        raise UserError(f"--weights {path} does not fit WideResNet(num_classes={NUM_CLASSES}): "
                        f"{len(missing)} missing, {len(unexpected)} unexpected and {len(reshaped)} "
                        f"differently shaped tensors (e.g. {example})")
    model.load_state_dict(state)


def save_weights(model, path):
    """Write the state_dict atomically: a crash mid-write never leaves a truncated file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(model.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_writable(path, flag):
    """Fail at start, not after hours of training, when an output file cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot create {path.parent} ({err.strerror})") from None
    if path.is_dir() or not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path}: not a writable file path")


def unwrap(model):
    """The plain module inside a DDP (or similar) wrapper."""
    return getattr(model, "module", model)


# ---------------------------------------------------------------------------------------------
# Output: only global rank 0 prints and writes.

class RunLogger:
    def __init__(self, enabled, metrics_file=None):
        self.enabled = enabled
        self.metrics_path = Path(metrics_file) if (enabled and metrics_file) else None
        if self.metrics_path:
            check_writable(self.metrics_path, "--metrics-file")

    def info(self, message=""):
        if self.enabled:
            print(message, flush=True)

    def record(self, record):
        """Append one JSON line; earlier lines (and earlier runs) are never rewritten."""
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")


class Progress:
    """One updating line during an epoch when stdout is a terminal; nothing in batch logs.
    Reading the running loss is a GPU sync, so it happens at most every ``interval_s``."""

    def __init__(self, enabled, label, steps, world_size, stream=None, interval_s=0.5):
        self.stream = stream or sys.stdout
        self.enabled = enabled and self.stream.isatty()
        self.label, self.steps, self.world_size, self.interval_s = label, steps, world_size, interval_s
        self.start = self.last = time.perf_counter()
        self.shown = False

    def update(self, step, images, loss_sum):
        now = time.perf_counter()
        if not self.enabled or (now - self.last < self.interval_s and step < self.steps):
            return
        self.last, self.shown = now, True
        rate = images * self.world_size / max(now - self.start, 1e-9)
        self.stream.write(f"\r{self.label} [{step}/{self.steps}] loss {loss_sum.item() / images:.4f} "
                          f"{rate:.0f} img/s\033[K")
        self.stream.flush()

    def close(self):
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def describe_run(args, ctx, precision, train_loader, test_loader, steps):
    """The derived values, printed once at the start."""
    accel = "GPUs" if ctx.device.type == "cuda" else "CPU processes"
    data = "SYNTHETIC random images and labels: accuracy is meaningless" if args.synthetic else "CIFAR-100"
    momentum = f"momentum {args.momentum}{' (Nesterov)' if args.nesterov else ''}" if args.momentum else "no momentum"
    return [
        f"Training WideResNet on CIFAR-100 with Batch Size: {args.batch_size} "
        f"({train_loader.batch_size} per process x {ctx.world_size} {accel}, {ctx.num_nodes} node(s))",
        f"Device: {ctx.device}, precision {precision.name}, {train_loader.num_workers} loader workers per process",
        f"Data: {data}, {len(train_loader.dataset)} training / {len(test_loader.dataset)} test images, "
        f"{steps} steps per epoch",
        f"Recipe: SGD base LR {args.base_lr}, {args.warmup_epochs:g} warm-up epochs then {args.lr_schedule}, "
        f"{momentum}, weight decay {args.weight_decay:g}, label smoothing {args.label_smoothing:g}",
    ]


# ---------------------------------------------------------------------------------------------
# The loop.

def train_one_epoch(model, loader, optimizer, scheduler, scaler, loss_fn, precision, device, steps, progress):
    """One pass over (at most ``steps`` batches of) this rank's shard.

    Returns (mean training loss, images processed, LR of the last step), all over every rank.
    The per-step loss stays on the device: the host waits for the GPU only in the all-reduce
    at the end (and at progress refreshes on a terminal).
    """
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    images, lr = 0, optimizer.param_groups[0]["lr"]
    for step, (x, y) in enumerate(islice(loader, steps), start=1):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # (B, 3, 32, 32), (B,)
        lr = optimizer.param_groups[0]["lr"]  # a Python float: no sync
        with precision.autocast(device):
            loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces gradients during backward
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        loss_sum += loss.detach() * y.size(0)
        images += y.size(0)
        progress.update(step, images, loss_sum)
    progress.close()
    totals = all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(images), dtype=torch.float64, device=device)]))
    loss_total, images_total = totals.tolist()  # host sync, once per epoch
    return loss_total / max(images_total, 1.0), int(images_total), lr


@torch.no_grad()
def evaluate(model, loader, precision, device, limit_batches=None):
    """Accuracy and loss over this rank's shard of the test set, summed over all ranks.

    Pass the unwrapped model: a DDP forward may broadcast buffers, a collective that would
    hang when the shards have different numbers of batches.
    """
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [correct, loss sum]
    count = 0
    for x, y in islice(loader, limit_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with precision.autocast(device):
            logits = model(x)  # (B, 100)
        loss = F.cross_entropy(logits.float(), y, reduction="sum")
        sums += torch.stack([(logits.argmax(dim=1) == y).sum().double(), loss.double()])
        count += y.size(0)
    totals = all_reduce_sum(torch.cat([sums, torch.tensor([float(count)], dtype=torch.float64, device=device)]))
    return eval_summary(*totals.tolist())


def fit(model, train_loader, test_loader, args, ctx):
    """Train ``model`` (plain or DDP-wrapped) for up to --epochs, evaluating after each
    epoch, stopping early at --target-accuracy. Returns the per-epoch metric records."""
    module = unwrap(model)
    precision = configure_precision(args.precision, ctx.device)
    log = RunLogger(ctx.is_main, args.metrics_file)
    if args.save_weights and ctx.is_main:
        check_writable(args.save_weights, "--save-weights")
    steps = min(len(train_loader), args.limit_batches or len(train_loader))
    if steps == 0 and not args.eval_only:
        raise UserError(f"the {len(train_loader.dataset)} training images give no full batch of "
                        f"{train_loader.batch_size} per process; lower --batch-size")
    for line in describe_run(args, ctx, precision, train_loader, test_loader, steps):
        log.info(line)
    if args.synthetic:
        log.info("WARNING: --synthetic: the data are random, so loss and accuracy are meaningless.")
    if args.eval_only:
        return [evaluate_once(module, test_loader, args, ctx, precision, log)]

    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args, steps)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=precision.name == "fp16")
    loss_fn = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    records, history = [], []
    for epoch in range(1, args.epochs + 1):
        set_loader_epoch(train_loader, epoch - 1)
        progress = Progress(ctx.is_main, f"Epoch {epoch}/{args.epochs}", steps, ctx.world_size)
        synchronize(ctx.device)
        start = time.perf_counter()
        train_loss, images, lr = train_one_epoch(model, train_loader, optimizer, scheduler, scaler, loss_fn,
                                                 precision, ctx.device, steps, progress)
        synchronize(ctx.device)
        train_time = time.perf_counter() - start
        broadcast_buffers(module)  # evaluate exactly the model rank 0 holds (and saves)
        result = evaluate(module, test_loader, precision, ctx.device, args.limit_batches)
        record = epoch_record(epoch, args, ctx, precision, train_loss, result, images, train_time,
                              time.perf_counter() - start - train_time, lr)
        records.append(record)
        log.record(record)
        log.info(f"Epoch {epoch}/{args.epochs}: Time={train_time:.3f}s, Train Loss={train_loss:.4f}, "
                 f"Val Loss={result.loss:.4f}, Val Accuracy={result.accuracy:.4f}, "
                 f"Throughput={record['images_per_sec']:.1f} img/s, LR={lr:.5g}")
        history.append(result.accuracy)
        if target_reached(history, args.target_accuracy, args.patience):
            log.info(f"Target accuracy reached. Early stopping after epoch {epoch}.")
            break
    for line in summarize(records, ctx):
        log.info(line)
    if args.save_weights and ctx.is_main:
        save_weights(module, args.save_weights)
        log.info(f"Model weights written to {args.save_weights}")
    return records


def evaluate_once(module, test_loader, args, ctx, precision, log):
    result = evaluate(module, test_loader, precision, ctx.device, args.limit_batches)
    record = {"epoch": 0, "val_loss": result.loss, "val_accuracy": result.accuracy,
              "val_samples": result.samples, "world_size": ctx.world_size, "precision": precision.name}
    log.record(record)
    log.info(f"Evaluation: Loss={result.loss:.4f}, Accuracy={result.accuracy:.4f} on {result.samples} test images")
    return record


def epoch_record(epoch, args, ctx, precision, train_loss, result, images, train_time, eval_time, lr):
    """One line of --metrics-file. Times in seconds; throughput counts training images
    actually processed on all ranks during the training phase (evaluation excluded)."""
    return {"epoch": epoch, "train_loss": train_loss, "val_loss": result.loss,
            "val_accuracy": result.accuracy, "val_samples": result.samples,
            "epoch_time_s": train_time, "eval_time_s": eval_time,
            "images_per_sec": images / train_time, "train_images": images, "lr": lr,
            "world_size": ctx.world_size, "precision": precision.name, "synthetic": args.synthetic,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def throughput(records):
    """Images per second over ``records``: total images / total training time."""
    seconds = sum(r["epoch_time_s"] for r in records)
    return sum(r["train_images"] for r in records) / seconds if seconds else math.nan


def summarize(records, ctx):
    """The guide's final summary, with the warm-up epoch separated from the steady state."""
    last = records[-1]
    best = max(records, key=lambda r: r["val_accuracy"])
    accel = "GPUs" if ctx.device.type == "cuda" else "CPU processes"
    lines = [f"\nTraining complete. Final Accuracy: {last['val_accuracy']:.4f} "
             f"(best {best['val_accuracy']:.4f} at epoch {best['epoch']})",
             f"Total Time: {sum(r['epoch_time_s'] for r in records):.1f}s, "
             f"Throughput: {throughput(records):.1f} img/s"]
    if len(records) > 1:
        lines.append(f"Throughput excluding epoch 1 (warm-up): {throughput(records[1:]):.1f} img/s; "
                     f"epoch 1: {throughput(records[:1]):.1f} img/s")
    lines.append(f"Number of nodes: {ctx.num_nodes}, {accel} per node: {ctx.local_world_size}, "
                 f"total {accel}: {ctx.world_size}")
    return lines


def _rank_or_zero():
    try:
        return env_rank()
    except UserError:
        return 0


def run_cli(main):
    """Run an entry point: a UserError becomes one line on stderr and exit status 2."""
    try:
        main()
    except UserError as err:
        rank = _rank_or_zero()
        if rank == 0 or not err.same_on_every_rank:
            print(f"{f'[rank {rank}] ' if rank else ''}error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
