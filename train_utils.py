"""The one training loop behind train.py and train_ddp.py, read top down: ``fit`` runs the
epochs, ``run_epoch`` trains and evaluates one, ``train_steps`` is the step; then how the
run is prepared (optimizer, schedule, precision) and the recipe's small pure pieces.

Both entry points build a task.Task (the model and the data) and call ``fit``; train_ddp.py
also joins a process group, shards the data by rank and wraps the model in DDP, and nothing
here needs to know. The loop names no model and no data set: it trains whatever the task
holds. Only global rank 0 prints and writes files. The flags are in flags.py; checkpoints,
weights files, resume and stop requests in checkpoint_utils.py; the LR schedule in
lr_schedule.py; what is printed in log_utils.py.
"""

from __future__ import annotations  # Run names Precision, defined further down with the recipe

import argparse
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoint_utils import (Checkpointer, StopRequests, TrainingStopped, TrainState, check_resumable,
                              check_state_fits, continues_run, epoch_seed, load_agreed_checkpoint, new_run_id,
                              reconcile_metrics, restore, restore_rng, rng_snapshot, save_weights)
from dataset_utils import set_loader_epoch
from device_utils import (RunAborted, UserError, all_reduce, broadcast_buffers, check_replicas_in_sync, device_name,
                          from_rank0, gather_objects, memory_format, network_report, peak_memory_gib,
                          reset_peak_memory, synchronize)
from flags import defaults as flag_defaults
from flags import rank_or_zero
from log_utils import (Progress, RunClock, RunLogger, accuracy_scope, count, describe_evaluation, describe_run,
                       epoch_line, eta_seconds, summarize, timestamp)
from lr_schedule import Cycle, describe_extension, extend, first_cycle, make_scheduler
from monitor import Monitors

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NO_STEP = 2**62  # "no non-finite loss yet" in the all-reduce (min) of the first bad step
RANK0_FIRST_S = 10  # the longest a silent rank waits for rank 0 to print its line and exit (let_rank0_fail_first)


# ---------------------------------------------------------------------------------------------
# The run: epochs, then the summary.

def fit(task, args, ctx):
    """Train ``task.model`` (plain or DDP-wrapped) on its data for up to --epochs, evaluating
    after each epoch and checkpointing when due, stopping early at --target-accuracy.
    Returns the epochs' metrics records."""
    clock = RunClock()
    # Before anything is printed: a new run in another run's folder is refused at once.
    continuing = not args.eval_only and from_rank0(lambda: continues_run(args.checkpoint_dir, args.resume),
                                                   ctx.control_group)
    run = prepare_run(task, args, ctx, continuing)
    run.clock = clock
    train_loader, test_loader = task.train_loader, task.test_loader
    if args.eval_only:
        return [evaluate_once(run, test_loader)]
    state, rng_state = start_or_resume(run, continuing)
    reached = partial(target_reached, state.history, args.target_accuracy, args.patience)  # history grows in place
    with (StopRequests(ctx, args.stop_file, args.checkpoint_dir) as run.stop,
          Monitors(args, ctx, run.log, state.run_id, state.records[-1] if state.records else None,
                   continuing) as run.monitor):
        while state.epoch <= args.epochs and not reached():
            run_epoch(run, train_loader, test_loader, state, rng_state)
            rng_state = None
            stop = run.stop.agreed()  # asked during evaluation: stop before the next epoch
            if stop and state.epoch <= args.epochs and not reached():
                path = run.checkpointer.save(run, state) if run.checkpointer.directory else None
                raise run.stop.stopped(stop, f"after epoch {state.epoch - 1}", path)
        if run.checkpointer.directory:
            run.checkpointer.save(run, state)  # the finished run (no-op when just written)
    if reached():
        run.log.info(f"Target accuracy reached. Early stopping after epoch {state.epoch - 1}.")
    for line in summarize(state.records, ctx, len(test_loader.dataset), run.clock.elapsed(), continuing):
        run.log.info(line)
    if run.checkpointer.count:
        wall = run.clock.elapsed()
        run.log.info(f"Checkpoints: {run.checkpointer.count} written to {args.checkpoint_dir} in "
                     f"{run.checkpointer.seconds:.1f}s ({100 * run.checkpointer.seconds / wall:.1f}% of this "
                     f"run's {wall:.1f}s)")
    if args.save_weights and ctx.is_main:
        save_weights(run.module, args.save_weights, {"model": task.model_key, **task.data.weights_metadata()})
        run.log.info(f"Model weights written to {args.save_weights}")
    return state.records


def start_or_resume(run, continuing):
    """(TrainState, this rank's RNG states or None): a new run, or (``continuing``) the run in
    --checkpoint-dir continued from the checkpoint global rank 0 chose, loaded on every rank."""
    args, ctx = run.args, run.ctx
    if not continuing:
        if args.resume == "auto":
            run.log.info(f"No checkpoint in {args.checkpoint_dir}: starting a new run there")
        return TrainState(run_id=from_rank0(new_run_id, ctx.control_group),  # one ID: the traces' names
                          lr_cycles=[list(first_cycle(args.epochs, args.warmup_epochs, run.steps))]), None
    path, checkpoint = load_agreed_checkpoint(args.checkpoint_dir, ctx, run.log)
    check_resumable(checkpoint, args, run.task.data.fingerprint, run.task.model_key,
                    partial(check_state_fits, run.module, model_name=run.task.model_name), flag_defaults())
    saved = checkpoint["args"]
    planned = saved["epochs"]
    # A checkpoint written before extensions existed has the one cycle its flags define.
    cycles = checkpoint["state"].get("lr_cycles") or [first_cycle(planned, saved["warmup_epochs"], run.steps)]
    finished = target_reached(checkpoint["state"]["history"], args.target_accuracy, args.patience)
    if args.epochs > planned and not finished:
        cycles = extend(cycles, args, run.steps, checkpoint["scheduler"]["last_epoch"], args.lr_schedule)
        run.log.info(describe_extension(planned, args, Cycle(*cycles[-1]), run.steps))
    run.scheduler = make_scheduler(run.optimizer, args, run.steps, cycles)  # restore loads its step
    state, rng_state = restore(run, checkpoint)
    state.lr_cycles = [list(c) for c in cycles]
    fit_optimizer_to_params(run.optimizer, ctx.device)
    run.checkpointer.last_step = run.scheduler.last_epoch  # that checkpoint need not be written again
    where = f"epoch {state.epoch}, after step {state.step}" if state.step else f"after epoch {state.epoch - 1}"
    run.log.info(f"Resuming from {path}: {where} (saved by {count(checkpoint['world_size'], 'process', 'processes')}"
                 f", now {ctx.world_size})"
                 + (f"; its weights replace --weights {args.weights}" if args.weights else ""))
    if state.epoch > args.epochs or target_reached(state.history, args.target_accuracy, args.patience):
        run.log.info(f"The run in {args.checkpoint_dir} is complete (epoch {state.epoch - 1}): nothing to train")
    if run.log.metrics_path:
        reconcile_metrics(run.log.metrics_path, state.run_id, state.records)
    return state, rng_state


def evaluate_once(run, test_loader):
    start = time.perf_counter()
    result = evaluate(run, test_loader)  # ends in a host sync (the all-reduced sums)
    record = {"epoch": 0, "val_loss": result.loss, "val_accuracy": result.accuracy, "val_samples": result.samples,
              "eval_time_s": time.perf_counter() - start, "world_size": run.ctx.world_size,
              "precision": run.precision.name, "weights": str(run.args.weights),
              "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    run.log.record(record)
    run.log.info(f"{timestamp()} Evaluation: Loss={result.loss:.4f}, Accuracy={result.accuracy:.4f} "
                 f"{accuracy_scope(record, len(test_loader.dataset))}")
    return record


# ---------------------------------------------------------------------------------------------
# One epoch, one step, one evaluation.

def run_epoch(run, train_loader, test_loader, state, rng_state=None):
    """Train epoch state.epoch from step state.step on, evaluate, log, and checkpoint when
    one is due. On a stop request: checkpoint mid-epoch and raise TrainingStopped."""
    set_loader_epoch(train_loader, state.epoch - 1)
    torch.manual_seed(epoch_seed(run.args.seed, state.epoch, run.ctx.rank))
    batches = islice(train_loader, run.steps)
    for _ in range(min(state.step, run.steps)):  # resuming mid-epoch: the same batches, skipped
        next(batches)
    if rng_state is not None:
        restore_rng(rng_state)  # where the interrupted run was after those steps
    reset_peak_memory(run.ctx.device)
    synchronize(run.ctx.device)
    start = time.perf_counter()
    done = train_steps(run, batches, state)
    synchronize(run.ctx.device)
    train_end = time.perf_counter()
    phase = run.monitor.end_of_training_phase(start, train_end)  # a partial epoch resumed: its last part only
    loss_sum, images, seconds = (a + b for a, b in zip(state.partial, (done.loss_sum, done.images, train_end - start)))
    if done.first_bad:
        kept = Path(run.args.checkpoint_dir) / state.checkpoints[-1] if state.checkpoints else None
        raise RunAborted(f"non-finite training loss in epoch {state.epoch} at step {done.first_bad}; stopping "
                         + (f"(last good checkpoint: {kept})" if kept else "without saving the model")
                         + "; try a lower --base-lr or --precision fp32")
    if done.stop:
        state.partial = (loss_sum, images, seconds)
        check_replicas_in_sync(run.module, f"after step {state.step} of epoch {state.epoch}")
        path = None
        if run.checkpointer.directory:  # the same on every rank, so every rank joins the gather or none
            path = run.checkpointer.save(run, state, gather_objects(rng_snapshot(), run.ctx.control_group))
        raise run.stop.stopped(done.stop, f"after step {state.step} of epoch {state.epoch}", path)
    broadcast_buffers(run.module)  # evaluate exactly the model rank 0 holds (and saves)
    result = evaluate(run, test_loader, f"Evaluation after epoch {state.epoch}")
    record = epoch_record(state, run, loss_sum / max(images, 1), result, images, seconds,
                          time.perf_counter() - train_end, done.lr, phase)
    if not run.args.check_sync_every:
        check_replicas_in_sync(run.module, f"after epoch {state.epoch}")  # before the checkpoint
    state.history.append(result.accuracy)
    state.records.append(record)
    state.epoch, state.step, state.partial = state.epoch + 1, 0, (0.0, 0, 0.0)
    if run.checkpointer.due():
        run.checkpointer.save(run, state)  # before the metrics line, so a line is never written twice
    run.log.record(record)
    run.monitor.record(record)
    run.clock.epoch_done()
    eta = eta_seconds(run.clock.epoch_walls, run.args.epochs - record["epoch"])
    run.log.info(epoch_line(record, run.args.epochs, run.clock.elapsed(), eta))
    return record


class StepTotals(NamedTuple):
    """What ``train_steps`` did, summed over all ranks."""
    loss_sum: float  # training loss times images
    images: int
    first_bad: int   # first step with a non-finite loss, 0 if none
    lr: float        # of the last step
    stop: int        # the agreed stop request (checkpoint_utils.NO_STOP, STOP_FILE or STOP_SIGNAL)


def train_steps(run, batches, state):
    """Train on ``batches`` (steps state.step + 1 ... of epoch state.epoch), stopping early
    when any rank has a stop request. The loss stays on the device; the host waits for the
    GPU only in the final all-reduce."""
    device, start = run.ctx.device, state.step
    run.model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    first_bad = torch.full((), NO_STEP, dtype=torch.int64, device=device)
    images, lr, stop = 0, run.optimizer.param_groups[0]["lr"], 0
    progress = Progress(run.ctx.is_main, f"Epoch {state.epoch}/{run.args.epochs}", run.steps, run.args.log_interval,
                        first=start)
    for step, (x, y) in enumerate(batches, start=start + 1):
        # (B, C, H, W), (B,). Asynchronous from pinned memory; no-ops for the device loader.
        x = x.to(device, memory_format=run.memory_format, non_blocking=True)
        y = y.to(device, non_blocking=True)
        lr = run.optimizer.param_groups[0]["lr"]  # a Python float: no sync
        with run.precision.autocast(device):
            loss = run.loss_fn(run.model(x), y)
        run.optimizer.zero_grad(set_to_none=True)
        run.scaler.scale(loss).backward()  # DDP all-reduces gradients during backward
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.scheduler.step()
        loss_sum += loss.detach() * y.size(0)
        first_bad = torch.where(torch.isfinite(loss.detach()), first_bad, torch.clamp(first_bad, max=step))
        images += y.size(0)
        state.step = step
        run.monitor.step(state.epoch, step)
        # Reads the running loss (a GPU sync) only when a line is shown.
        progress.update(step, images * run.ctx.world_size, lambda: f"loss {loss_sum.item() / images:.4f}")
        if run.args.check_sync_every and run.scheduler.last_epoch % run.args.check_sync_every == 0:
            check_replicas_in_sync(run.module, f"after step {step} of epoch {state.epoch}")
        # All ranks stop after the same step; the agreement runs on the CPU during the next step.
        stop = run.stop.after_step()
        if stop:
            break
    run.stop.drain()  # the last step's agreement: every collective after it finds the group idle
    progress.close()
    totals = all_reduce(torch.stack([loss_sum, torch.tensor(float(images), dtype=torch.float64, device=device)]))
    first_bad = int(all_reduce(first_bad, op="min"))  # host sync, once per epoch (or stop)
    loss_total, images_total = totals.tolist()
    return StepTotals(loss_total, int(images_total), 0 if first_bad == NO_STEP else first_bad, lr, stop)


@torch.no_grad()
def evaluate(run, loader, label="Evaluation"):
    """Accuracy and loss over this rank's shard of the test set, summed over all ranks.

    Runs the unwrapped, uncompiled model: a DDP forward may broadcast buffers, a collective
    that would hang when the shards have different numbers of batches.
    """
    model, device, precision = run.module, run.ctx.device, run.precision
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [correct, loss sum]
    count = 0
    batches = min(len(loader), run.args.limit_batches or len(loader))
    progress = Progress(run.ctx.is_main, label, batches, run.args.log_interval)
    for batch, (x, y) in enumerate(islice(loader, batches), start=1):
        x = x.to(device, memory_format=run.memory_format, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with precision.autocast(device):
            logits = model(x)  # (B, classes)
        loss = F.cross_entropy(logits.float(), y, reduction="sum")
        sums += torch.stack([(logits.argmax(dim=1) == y).sum().double(), loss.double()])
        count += y.size(0)
        # Rank 0's shard so far; reading it waits for the GPU, only when a line is shown.
        progress.update(batch, count * run.ctx.world_size, lambda: f"accuracy {sums[0].item() / count:.4f} (rank 0)")
    progress.close()
    totals = all_reduce(torch.cat([sums, torch.tensor([float(count)], dtype=torch.float64, device=device)]))
    return eval_summary(*totals.tolist())


def epoch_record(state, run, train_loss, result, images, train_time, eval_time, lr, phase):
    """One line of --metrics-file. Times in seconds; throughput counts training images
    actually processed on all ranks during the training phase (evaluation excluded); ``phase``:
    what the monitors saw of the training phase (GPU utilization %, power W, None on the CPU;
    whether the profiler recorded in it)."""
    return {"epoch": state.epoch, "train_loss": train_loss, "val_loss": result.loss,
            "val_accuracy": result.accuracy, "val_samples": result.samples,
            "epoch_time_s": train_time, "eval_time_s": eval_time,
            "images_per_sec": images / train_time, "train_images": images, "lr": lr,
            "world_size": run.ctx.world_size, "nodes": run.ctx.num_nodes, "batch_size": run.args.batch_size,
            "per_process_batch": run.args.batch_size // run.ctx.world_size, "loader": run.task.loader,
            "precision": run.precision.name, "synthetic": run.args.synthetic,
            "dataset": run.args.dataset, "model": run.args.model, "epochs": run.args.epochs,
            "lr_cycle": len(state.lr_cycles),
            "device": run.device_name, "peak_memory_gib": peak_memory_gib(run.ctx.device), **phase,
            "run_id": state.run_id, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}


# ---------------------------------------------------------------------------------------------
# Preparing the run: optimizer, schedule, precision, and what is printed once.

@dataclass
class Run:
    """What the loop works with, built once by ``prepare_run``."""
    model: nn.Module       # what trains: DDP-wrapped in train_ddp.py
    module: nn.Module      # the plain model: evaluated, checked and checkpointed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    loss_fn: nn.Module
    precision: Precision
    memory_format: torch.memory_format  # of the input batches: the model's layout
    ctx: object            # device_utils.DistContext: who this process is
    args: argparse.Namespace
    task: object           # task.Task: the model as built, the loaders and what the data is
    log: RunLogger
    steps: int             # optimizer steps per epoch
    checkpointer: Checkpointer
    device_name: str       # what runs: GPU model and memory, or the CPU
    clock: RunClock = field(default_factory=RunClock)
    stop: StopRequests = None
    monitor: Monitors = field(default_factory=Monitors)  # GPU sampling, TensorBoard, profiler: all off


def prepare_run(task, args, ctx, continuing=False):
    """Build the optimizer, schedule, scaler and loss for ``task``, and print the derived
    values once."""
    model, train_loader = task.model, task.train_loader
    precision = configure_precision(args.precision, ctx.device)
    log = RunLogger(ctx.is_main, args.metrics_file, checkpointed=bool(args.checkpoint_dir))
    steps = min(len(train_loader), args.limit_batches or len(train_loader))
    if steps == 0 and not args.eval_only:
        raise UserError(f"the {len(train_loader.dataset)} training images give no full batch of "
                        f"{train_loader.batch_size} per process; lower --batch-size")
    layout = memory_format(args.channels_last, ctx.device)  # the model's, from task.build_model
    name = device_name(ctx.device)
    module = unwrap(model)
    parameters = sum(p.numel() for p in module.parameters())
    header = (describe_evaluation(args, ctx, name, precision, layout == torch.channels_last, task) if args.eval_only
              else describe_run(args, ctx, name, precision, layout == torch.channels_last, task, parameters, steps,
                                continuing))
    for line in header:
        log.info(line)
    if ctx.process_group:
        for line in network_report(ctx):
            log.info(line)
    if args.synthetic:
        log.info("WARNING: --synthetic: the data are random, so loss and accuracy are meaningless.")
    optimizer = make_optimizer(model, args, ctx.device)
    if args.compile:
        model = torch.compile(model)  # compiles lazily, during the first steps
    return Run(model=model, module=module, optimizer=optimizer,
               scheduler=make_scheduler(optimizer, args, steps),
               scaler=torch.amp.GradScaler(ctx.device.type, enabled=precision.name == "fp16"),
               loss_fn=nn.CrossEntropyLoss(label_smoothing=args.label_smoothing), precision=precision,
               memory_format=layout, ctx=ctx, args=args, task=task, log=log, steps=steps,
               checkpointer=Checkpointer(args.checkpoint_dir, args.checkpoint_interval, ctx), device_name=name)


# ---------------------------------------------------------------------------------------------
# Small pure pieces of the recipe.

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
    # Only bf16 the GPU computes natively: PyTorch reports emulated bf16 (pre-Ampere GPUs) as
    # supported by default, and it runs slower than fp32 there.
    native_bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    if requested == "auto":
        requested = "bf16" if native_bf16 else "fp32"
    if requested in ("fp16", "tf32") and not cuda:
        raise UserError(f"--precision {requested} needs a CUDA GPU; on the CPU use fp32 (or bf16)")
    if requested == "bf16" and cuda and not native_bf16:
        raise UserError("--precision bf16: this GPU has no bf16 support; use fp16 or fp32")
    if cuda:
        # PyTorch lets cuDNN use TF32 for convolutions by default, so the guide's "fp32" was
        # partly TF32. Here fp32 means fp32; every other mode allows TF32 for fp32 leftovers.
        torch.backends.cuda.matmul.allow_tf32 = requested != "fp32"
        torch.backends.cudnn.allow_tf32 = requested != "fp32"
    return Precision(requested, AUTOCAST_DTYPES.get(requested))


def optimizer_kernels(device):
    """SGD implementation: one fused kernel for all parameters on CUDA, for-each on the CPU."""
    return {"fused": True, "foreach": None} if device.type == "cuda" else {"fused": None, "foreach": None}


def make_optimizer(model, args, device):
    """SGD whose momentum buffers exist from the start: zeros in each parameter's layout.

    The first step then computes what SGD's own first step does (buffer = gradient, as
    dampening is 0). Left to itself the fused kernel creates them with ``empty_like`` on its
    first call, and when the GradScaler skips that step (an fp16 overflow, common at the
    initial scale of 65536) it returns before filling them: training would go on from
    uninitialised memory.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum, nesterov=args.nesterov,
                                weight_decay=args.weight_decay, **optimizer_kernels(device))
    if args.momentum:
        for param in model.parameters():
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
    return optimizer


def fit_optimizer_to_params(optimizer, device):
    """After ``load_state_dict`` of a checkpoint saved elsewhere: this device's SGD kernels,
    and every state tensor in its parameter's memory layout. ``load_state_dict`` keeps the
    saved layout (NCHW from a CPU run or --no-channels-last), and the fused CUDA kernel needs
    parameters, gradients and momentum buffers to share strides."""
    for group in optimizer.param_groups:
        group.update(optimizer_kernels(device))
        for param in group["params"]:
            state = optimizer.state[param]
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param).copy_(value)  # empty_like keeps param's strides


def unwrap(model):
    """The plain module inside a DDP (or similar) wrapper."""
    return getattr(model, "module", model)


# ---------------------------------------------------------------------------------------------
# For benchmark.py: the loop's training steps, timed.

class StepTiming(NamedTuple):
    images_per_sec: float  # of the timed steps, over all ranks
    warmup_s: float        # wall time of the untimed warm-up steps (cuDNN autotuning, compilation)
    precision: str         # as resolved for this device


def time_training_steps(task, args, ctx, batches, warmup_steps, steps, timed_context=nullcontext):
    """Train ``task.model`` on ``batches`` with this loop's steps (the flags' recipe, precision
    and layout): ``warmup_steps`` untimed, then ``steps`` timed, the device synchronized
    before each clock reading, inside ``timed_context()`` (a profiler, say). No evaluation,
    checkpoints or stop requests."""
    run = prepare_run(task, args, ctx)
    run.stop = StopRequests(ctx)  # not entered: no handlers, so nothing but Ctrl-C stops it
    state = TrainState(run_id="benchmark")
    synchronize(ctx.device)
    start = time.perf_counter()
    train_steps(run, islice(batches, warmup_steps), state)  # returns after a host sync
    warmup_s = time.perf_counter() - start
    with timed_context():
        start = time.perf_counter()
        images = train_steps(run, islice(batches, steps), state).images  # ends in a host sync
        seconds = time.perf_counter() - start
    return StepTiming(images / seconds, warmup_s, run.precision.name)


# ---------------------------------------------------------------------------------------------
# Entry points.

def let_rank0_fail_first():
    """On a rank that prints nothing for an error or a stop that rank 0 prints: wait (at most
    RANK0_FIRST_S) for torchrun to end this process. torchrun stops every rank as soon as one
    fails; were that this rank, rank 0 could be stopped before its line, and the user would
    see only torchrun's report."""
    time.sleep(RANK0_FIRST_S)


def run_cli(main):
    """Run an entry point. A UserError becomes one line on stderr and its exit status (2, or 3
    for an aborted run); a stop request ends with one line on stdout after its checkpoint."""
    rank = rank_or_zero()
    try:
        main()
    except TrainingStopped as stop:
        if rank == 0:
            print(stop, flush=True)
        elif stop.exit_code:
            let_rank0_fail_first()
        sys.exit(stop.exit_code)
    except UserError as err:
        prints = rank == 0 or not err.same_on_every_rank
        if prints:
            print(f"{f'[rank {rank}] ' if rank else ''}error: {err}", file=sys.stderr, flush=True)
        if getattr(err, "exit_at_once", False):  # a lost rank: no clean-up that could hang (device_utils.RanksLost)
            sys.stdout.flush()
            os._exit(err.exit_code)
        if not prints:
            let_rank0_fail_first()
        sys.exit(err.exit_code)
    except KeyboardInterrupt as err:  # outside training (data, model, start-up), or a second Ctrl-C in it
        if rank == 0:
            print(f"Interrupted ({str(err) or 'Ctrl-C'})", file=sys.stderr)
        sys.exit(130)
