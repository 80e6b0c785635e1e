"""The one training loop behind train.py and train_ddp.py, read top down: ``fit`` runs the
epochs and ``finish`` ends the run (the summary, --save-weights), ``run_epoch`` trains and
evaluates one, ``train_steps`` keeps the books around ``train_step``, the step itself;
``evaluate`` is the test loop; then what they keep as they run (``Progress``, ``LossBooks``)
and the lines they print (``epoch_line``, ``summarize``).
Then how a run is built: the command line, the task (``build_task``), the start-up block and
the run's objects (``prepare_run``, ``resume``).
Between two steps the loop calls one piece of machinery, ``run.stop`` (engine/stopping.py);
docs/architecture.md maps the rest.

Both entry points build a Task (engine/task.py: the model and the data) and call ``fit``;
train_ddp.py also joins a process group, shards the data by rank and wraps the model in DDP,
and nothing here needs to know. The loop names no model, no data set and no optimizer: the
model and data come from --model and --dataset, the optimizer, loss, schedule and
augmentations from recipe.py. Only global rank 0 prints and writes files.
"""

from __future__ import annotations  # Run names Precision and friends in its annotations

import argparse
import math
import os
import re
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import recipe
from dataset_utils import (as_compose, batch_temporaries, build_data, build_loaders, choose_loader, dali_choice,
                           default_num_workers, set_loader_epoch, skip_batches, with_image_transforms)
from device_utils import (Precision, broadcast_buffers, check_every_parameter_learns, check_replicas_in_sync,
                          configure_precision, device_name, memory_format, peak_memory_gib,
                          reset_peak_memory)
from engine import flags
from engine.cli import user_code_error
from engine.errors import ResourceProblem, RunAborted, UserError, release_stop_request
from engine.log import (UNWATCHED, RunClock, RunLogger, count, describe_data, describe_device, describe_length,
                        describe_resume, epoch_record, flag_value, per_process, processes, reconcile_metrics,
                        size_warning, throughput, validated, validated_ema)
from engine.memory import device_memory, is_out_of_memory, measured_training
from engine.models import build_model
from engine.optimization import (Cycle, check_batch_transform, check_loss, check_optimizer, check_schedule_length,
                                 describe_extension, describe_loss, describe_optimizer, extend, first_cycle,
                                 fit_optimizer_to_params, kernel_choices, make_scheduler, prefill_momentum)
from engine.plugins import load_plugin, own_file, plugin_key
from engine.processes import all_reduce, from_rank0, gather_objects, synchronize
from engine.seeds import epoch_seed, restore_rng, resumed_steps, rng_snapshot
from engine.stopping import StopRequests, check_stop_file
from engine.task import Task


# ---------------------------------------------------------------------------------------------
# The run: epochs, then the summary.

def fit(task, args, ctx, clock=None):
    """Train ``task.model`` (plain or DDP-wrapped) on its data for up to --epochs, evaluating
    after each epoch and checkpointing when due, stopping early at --target-accuracy.
    ``clock``: the run's RunClock, started by the entry point before the data was read.
    Returns the epochs' metrics records."""
    clock = clock or RunClock()
    stops = None if args.eval_only else StopRequests(ctx, args.stop_file, args.checkpoint_dir)
    if stops is None:
        release_stop_request()  # an evaluation ends at once on a SIGUSR1, as on any signal
    # Before anything is printed: a held folder, another run's folder or --save-weights file is refused.
    with claimed_outputs(None if args.eval_only else args.checkpoint_dir, args.resume, ctx,
                         None if args.eval_only else args.save_weights) as continuing:
        # From the start-up block, which promises a checkpoint on a stop request, to the end of
        # the run a signal only sets a flag: one that comes while a resume reads its checkpoint
        # stops the run after its first step; one after the last step (Ctrl-C, scancel during the
        # summary) waits for the final weights, which are written. An evaluation stops at once.
        with stops or nullcontext():
            run, state, rng_state = prepare_run(task, args, ctx, continuing, clock, stops)
            if args.eval_only:
                return [evaluate_once(run, task.test_loader)]
            run.clock.loop_started()
            with run.monitor or nullcontext():
                while epochs_left(state, args):
                    run_epoch(run, state, rng_state)
                    rng_state = None
                    stop = run.stop.agreed()  # asked during evaluation: stop before the next epoch
                    if stop and epochs_left(state, args):
                        path = run.checkpointer.save(run, state) if run.checkpointer else None
                        raise run.stop.stopped(stop, f"after epoch {state.epoch - 1}", path)
                final, unsaved = None, None
                try:
                    final = run.checkpointer.save(run, state) if run.checkpointer else None  # no-op when just written
                except ResourceProblem as err:  # trained to the end: the model is written all the same (finish)
                    unsaved = err
            finish(run, state, continuing, final, unsaved)
    return state.records


def finish(run, state, continuing, final, unsaved=None):
    """The end of a run that trained to its end: why it ended, the summary, and the
    --save-weights file (``final``: the final checkpoint's path, or None; ``unsaved``: the
    ResourceProblem of a final checkpoint that did not fit, raised once the weights are written)."""
    args, clock = run.args, run.clock
    reached = target_reached(state.history, args.target_accuracy, args.patience)
    if reached and state.epoch - 1 < args.epochs:
        run.log.info(f"Target accuracy reached. Early stopping after epoch {state.epoch - 1} of {args.epochs} "
                     f"(--target-accuracy {args.target_accuracy:g} for --patience {args.patience}; the LR schedule "
                     f"had not finished: LR {state.records[-1]['lr']:.3g}; --target-accuracy off trains all --epochs).")
    elif reached:  # in the last epoch: nothing was cut short
        run.log.info(f"Target accuracy reached (--target-accuracy {args.target_accuracy:g} for --patience "
                     f"{args.patience}) in the last of the {args.epochs} epochs.")
    elif args.target_accuracy is not None and state.records:
        run.log.info(f"Early stop not reached (--target-accuracy {args.target_accuracy:g} for --patience "
                     f"{args.patience}): trained to --epochs {args.epochs}.")
    for line in summarize(state.records, run.ctx, len(run.task.test_loader.dataset), clock.elapsed(), continuing,
                          run.task.data.held_out):
        run.log.info(line)
    if run.checkpointer and run.checkpointer.count:
        wall, spent = clock.elapsed(), run.checkpointer.seconds
        run.log.info(f"Checkpoints: {run.checkpointer.count} written to {args.checkpoint_dir} in {spent:.1f}s "
                     f"({100 * spent / wall:.1f}% of this run's {wall:.1f}s)")
    if args.save_weights or unsaved:  # never lost to a full disk: written elsewhere, or found in the final checkpoint
        from engine.weights import save_trained_weights
        last = state.records[-1] if state.records else None
        line = from_rank0(lambda: save_trained_weights(run.trained(last), args.save_weights,
                                                       run.weights_metadata(last), final, unsaved),
                          run.ctx.control_group)
        run.log.info(line + which_weights(last))
    if run.stop.received:
        run.log.info(f"({run.stop.received} came after the last step: the run is complete)")


def claimed_outputs(checkpoint_dir, resume, ctx, save_weights):
    """``with claimed_outputs(...) as continuing``: engine/checkpoints.claimed_folder (one run
    per folder; whether the run in it continues; a --save-weights file that is another run's is
    refused) when the run writes either; a run that writes neither claims nothing."""
    if not checkpoint_dir and not save_weights:
        return nullcontext(False)
    from engine.checkpoints import claimed_folder
    return claimed_folder(checkpoint_dir, resume, ctx, save_weights)


def evaluate_once(run, test_loader):
    start = time.perf_counter()
    result = evaluate(run, run.module, test_loader)  # ends in a host sync (the all-reduced sums)
    record = {"epoch": 0, "val_loss": result.loss, "val_accuracy": result.accuracy, "val_top5": result.top5,
              "val_samples": result.samples,
              "eval_time_s": time.perf_counter() - start, "world_size": run.ctx.world_size,
              "precision": run.precision.name, "weights": str(run.args.weights),
              "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    run.log.record(record)
    top5 = f", Top-5={result.top5:.4f}" if result.top5 is not None else ""
    run.log.info(f"{timestamp()} Evaluation: Loss={result.loss:.4f}, Accuracy={result.accuracy:.4f}{top5} "
                 f"{accuracy_scope(record, len(test_loader.dataset), run.task.data.held_out)}")
    return record


# ---------------------------------------------------------------------------------------------
# One epoch, one step, one evaluation.

def run_epoch(run, state, rng_state=None):
    """Train epoch state.epoch from step state.step on, evaluate, log, and checkpoint when
    one is due. On a stop request: checkpoint mid-epoch and raise TrainingStopped."""
    train_loader = run.task.train_loader
    set_loader_epoch(train_loader, state.epoch - 1)
    torch.manual_seed(epoch_seed(run.args.seed, state.epoch, run.ctx.rank))
    skipped = min(state.step, run.steps)
    # Resuming mid-epoch: DALI goes on from the place its checkpoint recorded, the device loader and
    # the DataLoader leave the batches out; any other loader draws them and they are dropped.
    ahead = resumed_steps(train_loader, rng_state, skipped)
    if ahead < skipped and (skipped == run.steps or skip_batches(train_loader, skipped)):
        ahead = skipped  # none left to draw (a stop after the epoch's last step), or left out
    # Held to the epoch's end: a loader that keeps its place (DALI) lets go of it when this is dropped,
    # and a stop mid-epoch checkpoints that place (rng_snapshot) below.
    batches = islice(train_loader, run.steps - ahead)
    for _ in range(skipped - ahead):
        next(batches)
    if rng_state is not None:
        restore_rng(rng_state)  # where the interrupted run was after those steps
    reset_peak_memory(run.ctx.device)
    synchronize(run.ctx.device)
    start = time.perf_counter()
    done = train_steps(run, batches, state)
    synchronize(run.ctx.device)
    train_end = time.perf_counter()
    # What the monitors saw (a partial epoch resumed: its last part only); nothing watched: UNWATCHED.
    phase = run.monitor.end_of_training_phase(start, train_end) if run.monitor else UNWATCHED
    # A resumed epoch adds its steps to those the interrupted run had trained of it.
    loss_sum = state.partial[0] + done.loss_sum
    images = state.partial[1] + done.images
    seconds = state.partial[2] + train_end - start
    if done.first_bad:
        kept = Path(run.args.checkpoint_dir) / state.checkpoints[-1] if state.checkpoints else None
        raise RunAborted(f"non-finite training loss in epoch {state.epoch} at step {done.first_bad}; stopping "
                         + (f"(last good checkpoint: {kept})" if kept else "without saving the model")
                         + "; try a lower --base-lr" + (" or --precision fp32" if run.precision.name != "fp32" else ""))
    if done.stop:
        state.partial, state.last_lr = (loss_sum, images, seconds), done.lr
        check_replicas_in_sync(run.module, f"after step {state.step} of epoch {state.epoch}")
        path = None
        if run.checkpointer:  # the same on every rank, so every rank joins the gather or none
            path = run.checkpointer.save(run, state, gather_objects(rng_snapshot(train_loader), run.ctx.control_group))
        raise run.stop.stopped(done.stop, f"after step {state.step} of epoch {state.epoch}", path)
    label = f"Evaluation after epoch {state.epoch}"
    broadcast_buffers(run.module)  # evaluate exactly the model rank 0 holds (and saves)
    result = evaluate(run, run.module, run.task.test_loader, label)
    average = None  # --model-ema's average, evaluated too: the better one is kept
    if run.ema:
        broadcast_buffers(run.ema.module)
        average = evaluate(run, run.ema.module, run.task.test_loader, f"{label} (EMA)")
    record = epoch_record(state, run.record_fields(), loss_sum / max(images, 1), result, images, seconds,
                          time.perf_counter() - train_end, done.lr, phase, peak_memory_gib(run.ctx.device), average)
    if not run.args.check_sync_every:
        check_replicas_in_sync(run.module, f"after epoch {state.epoch}")  # before the checkpoint
    state.history.append(validated(record))  # early stopping, like --save-weights, goes by the better of the two
    state.records.append(record)
    state.epoch, state.step, state.partial, state.last_lr = state.epoch + 1, 0, (0.0, 0, 0.0), None
    if run.checkpointer:
        run.checkpointer.keep_best(state.history[-1], run.trained(record), run.weights_metadata(record))  # model_best
        # Before the metrics line, so a line is never written twice; the last epoch's is fit's final
        # checkpoint, which a full disk does not cost the trained model.
        if epochs_left(state, run.args) and run.checkpointer.due():
            run.checkpointer.save(run, state)
    run.log.record(record)
    if run.monitor:
        run.monitor.record(record)
    run.clock.epoch_done(1 - skipped / run.steps)
    eta = eta_seconds(run.clock.epoch_walls, run.args.epochs - record["epoch"], state.records)
    run.log.info(epoch_line(record, run.args.epochs, run.clock.elapsed(), eta))
    return record


def train_step(run, x, y):
    """One optimizer step on images x (B, C, H, W) and labels y (B,): forward, loss, backward
    for each of the --accumulate micro-batches (B / N images each, gradients summed), then
    optimizer step, schedule. Returns the loss of the B images, a 0-dim tensor still on the
    device: nothing here waits for the GPU, but GradScaler.step under --precision fp16 with an
    optimizer that has no fused kernel (it reads whether a gradient overflowed)."""
    if run.compiled and run.compiled.graphs:  # CUDA graphs: a new step, so PyTorch may reuse the last replay's outputs
        torch.compiler.cudagraph_mark_step_begin()
    run.optimizer.zero_grad(set_to_none=True)
    parts, total, ddp = run.args.accumulate, 0.0, run.task.model  # run.model may be its compiled wrapper
    for i, (xs, ys) in enumerate(zip(x.chunk(parts), y.chunk(parts))):
        # DDP all-reduces gradients during the last micro-batch's backward only.
        with ddp.no_sync() if i < parts - 1 and hasattr(ddp, "no_sync") else nullcontext():
            with run.autocast():
                loss = run.loss_fn(run.model(xs), ys)  # logits (B / N, classes) -> a scalar
                loss = loss / parts if parts > 1 else loss  # the mean over all B images (no kernel when N is 1)
            run.scaler.scale(loss).backward()
        total = total + loss.detach()
    if run.args.clip_grad_norm:  # of the true gradients: unscaled first under fp16 (a no-op otherwise)
        run.scaler.unscale_(run.optimizer)
        nn.utils.clip_grad_norm_(run.module.parameters(), run.args.clip_grad_norm)  # no host sync
    run.scaler.step(run.optimizer)     # fp16: skipped when a gradient overflowed
    run.scaler.update()
    run.scheduler.step()
    return total


def train_steps(run, batches, state):
    """Train on ``batches`` (steps state.step + 1 ... of epoch state.epoch), stopping early
    when any rank has a stop request. The loss stays on the device; the host waits for the
    GPU only in the final all-reduce."""
    if run.ema:
        from engine.model_ema import update_model_ema  # --model-ema only
    device, start, began = run.ctx.device, state.step, time.perf_counter()
    run.model.train()
    books = LossBooks(device, first_step=start + 1)
    # The LR of the last step, reported with the epoch: a resumed epoch that trains none (stopped
    # after its last step) reports the stopped run's, not the next step's that the optimizer holds.
    lr, stop = state.last_lr if state.last_lr is not None else run.optimizer.param_groups[0]["lr"], 0
    progress = Progress(run.ctx.is_main, f"Epoch {state.epoch}/{run.args.epochs}", run.steps, run.args.log_interval,
                        first=start)
    for step, (x, y) in enumerate(batches, start=start + 1):
        # (B, C, H, W), (B,). Asynchronous from pinned memory; no-ops for the device loader.
        x = x.to(device, memory_format=run.memory_format, non_blocking=True)
        y = y.to(device, non_blocking=True)
        if run.mix:  # recipe.py's erasing, MixUp, CutMix: labels become soft (B, classes)
            # Drawn from torch's generators: seeded per epoch and rank, and in a mid-epoch checkpoint.
            x, y = run.mix(x, y)
            x = x.contiguous(memory_format=run.memory_format)  # the model's layout again
        lr = run.optimizer.param_groups[0]["lr"]  # a Python float: no sync
        try:
            loss = train_step(run, x, y)
        except Exception as err:
            if mistake := step_mistake(run, err, state, f"step {step} of epoch {state.epoch} (training)",
                                       step > start + 1 or state.epoch > 1):
                raise mistake from None
            raise
        if step == start + 1:  # DDP: a parameter without a gradient is one line, not DDP's error next step
            check_every_parameter_learns(run.task.model, run.module, f"--model {run.args.model}")  # not compiled
            if run.compiled and run.clock.first_step_s is None:  # the step that compiled the model
                synchronize(device)  # once per process
                run.clock.first_step_s = time.perf_counter() - began  # its batch included
                for line in run.compiled.after_first_step(run.clock.first_step_s, run.task.model):
                    run.log.info(f"{timestamp()} {line}")
        if run.ema:  # recipe.py's model EMA, every ema_every optimizer steps; copies during the warm-up
            update_model_ema(run.ema, run.module, run.scheduler.last_epoch, run.ema_warmup, run.ema_every)
        books.add(loss, y.size(0))
        state.step = step
        if run.monitor and run.monitor.profile is not None:  # --profile-dir: the profiler's window counts the steps
            run.monitor.step(state.epoch, step)
        # Reads the running loss (a GPU sync) only when a line is shown.
        progress.update(step, books.images * run.ctx.world_size,
                        lambda: f"loss {books.sums[0].item() / books.images:.4f}")
        if run.args.check_sync_every and run.scheduler.last_epoch % run.args.check_sync_every == 0:
            check_replicas_in_sync(run.module, f"after step {step} of epoch {state.epoch}")
        # All ranks stop after the same step; the agreement runs on the CPU during the next step.
        stop = run.stop.after_step()
        if stop:
            break
    run.stop.drain()  # the last step's agreement: every collective after it finds the group idle
    progress.close()
    return books.totals(lr, stop)


@torch.no_grad()
def evaluate(run, model, loader, label="Evaluation"):
    """Accuracy (top-1, and top-5 with more than 5 classes) and loss of ``model`` over this
    rank's shard of the test set, summed over all ranks.

    ``model`` is unwrapped and uncompiled (run.module, or the --model-ema average): a DDP
    forward may broadcast buffers, a collective that would hang when the shards have different
    numbers of batches.
    """
    device = run.ctx.device
    model.eval()
    top5 = len(run.task.data.classes) > 5
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # [correct, loss sum, images, top-5 correct]
    count = 0  # images, on the host too: for progress lines
    batches = limited(loader, run.args.limit_batches)
    progress = Progress(run.ctx.is_main, label, batches, run.args.log_interval)
    for batch, (x, y) in enumerate(islice(loader, batches), start=1):
        x = x.to(device, memory_format=run.memory_format, non_blocking=True)
        y = y.to(device, non_blocking=True)
        try:
            with run.autocast():
                logits = model(x)  # (B, classes)
        except Exception as err:
            if mistake := step_mistake(run, err, None, f"batch {batch} of {label.lower()}", True):
                raise mistake from None
            raise
        loss = F.cross_entropy(logits.float(), y, reduction="sum")
        sums[:2] += torch.stack([(logits.argmax(dim=1) == y).sum().double(), loss.double()])
        sums[2] += y.size(0)  # no host-to-device copy, no sync
        if top5:
            sums[3] += (logits.topk(5, dim=1).indices == y[:, None]).any(dim=1).sum()
        count += y.size(0)
        # Rank 0's shard so far; reading it waits for the GPU, only when a line is shown.
        progress.update(batch, count * run.ctx.world_size, lambda: f"accuracy {sums[0].item() / count:.4f} (rank 0)")
    progress.close()
    correct, loss_sum, images, top5_correct = all_reduce(sums).tolist()  # the one host sync of an evaluation
    return eval_summary(correct, loss_sum, images, top5_correct if top5 else None)


# ---------------------------------------------------------------------------------------------
# What the loop keeps as it runs: where the run is, the progress line of a phase, the books of an
# epoch's steps and of an evaluation.

@dataclass
class TrainState:
    """Where the run is. The loop updates it in place; every checkpoint saves it whole."""
    run_id: str                                      # tags this run's lines in --metrics-file
    epoch: int = 1                                   # the epoch in progress (1-based)
    step: int = 0                                    # optimizer steps done in it
    partial: tuple = (0.0, 0, 0.0)                   # loss sum, images, seconds of those steps (all ranks)
    last_lr: float = None                            # the LR of the last of them (None: none trained)
    history: list = field(default_factory=list)      # validation accuracy of each finished epoch
    records: list = field(default_factory=list)      # --metrics-file record of each finished epoch
    checkpoints: list = field(default_factory=list)  # file names of this run's kept checkpoints, oldest first
    lr_cycles: list = field(default_factory=list)    # the LR schedule's cycles (optimization.Cycle as lists)


def new_run_id():
    return uuid.uuid4().hex[:12]


TERMINAL_INTERVAL_S = 0.5  # how often the updating terminal line is redrawn


class Progress:
    """Progress within one phase (an epoch's training steps, an evaluation), on rank 0.

    On a terminal: one line redrawn at most every TERMINAL_INTERVAL_S, erased at the end. In a
    batch log (stdout not a terminal): a timestamped line at most every ``log_interval_s``
    seconds (0: never). ``update`` only reads a clock; ``detail()`` (e.g. the running loss,
    which waits for the GPU) is called only for a line that is shown: one GPU sync per line.
    """

    def __init__(self, enabled, label, total, log_interval_s, first=0, stream=None, clock=time.perf_counter):
        self.stream = stream or sys.stdout
        self.terminal = self.stream.isatty()
        self.interval_s = TERMINAL_INTERVAL_S if self.terminal else log_interval_s
        self.enabled = enabled and self.interval_s > 0
        self.label, self.total, self.first, self.clock = label, total, first, clock  # first: batches done before
        self.start = self.last = clock()
        self.shown = False

    def update(self, done, images, detail=None):
        """``done`` of ``total`` batches, ``images`` processed on all ranks so far."""
        if not self.enabled or done >= self.total or self.clock() - self.last < self.interval_s:
            return  # (the last batch is followed by the epoch's or the evaluation's own line)
        text = detail() if detail else ""  # may wait for the GPU: before reading the clock
        now = self.clock()
        self.last, self.shown = now, True
        elapsed, done_here = now - self.start, done - self.first
        left = elapsed / done_here * (self.total - done) if done_here > 0 else None
        line = (f"{self.label} [{done}/{self.total}]{f' {text}' if text else ''}, "
                f"{images / max(elapsed, 1e-9):.1f} img/s, {duration(left)} left")
        if self.terminal:
            self.stream.write(f"\r{line}\033[K")
        else:
            self.stream.write(f"{timestamp()} {line}\n")
        self.stream.flush()

    def close(self):
        if self.shown and self.terminal:
            self.stream.write("\r\033[K")
            self.stream.flush()


# ---------------------------------------------------------------------------------------------
# The lines the loop prints between its progress lines: each epoch's (the guide's, with a
# timestamp, elapsed time and ETA) and the final summary.

def timestamp(now=None):
    """Local wall-clock time, as a batch log wants it: 2026-11-21 14:03:07."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))


def duration(seconds):
    """H:MM:SS (or D days, H:MM:SS) for elapsed times and ETAs; '?' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(max(seconds, 0)), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{f'{days}d ' if days else ''}{hours}:{minutes:02d}:{secs:02d}"


def eta_seconds(epoch_walls, remaining_epochs, records=()):
    """Seconds left for ``remaining_epochs`` at this process's pace: the mean wall time per epoch
    (training, evaluation, checkpoint), leaving out this process's first epoch once there are
    others (it includes cuDNN autotuning, compilation and loader start-up). Before this process
    has trained a step (resumed after an epoch's last step), the run's earlier epochs' training
    and evaluation time in ``records``; None if unknown."""
    if remaining_epochs <= 0:
        return 0.0
    steady = (epoch_walls[1:] or epoch_walls
              or [r["epoch_time_s"] + r.get("eval_time_s", 0.0) for r in records if "epoch_time_s" in r])
    return sum(steady) / len(steady) * remaining_epochs if steady else None


def epoch_line(record, epochs, elapsed_s, eta_s):
    """The guide's epoch line, with a timestamp in front, this GPU's peak memory (the headroom
    left), and the run's elapsed time and ETA at the end (ETA: until --epochs; early stopping
    may end the run sooner)."""
    peak = record.get("peak_memory_gib")
    return (f"{timestamp()} Epoch {record['epoch']}/{epochs}: Time={record['epoch_time_s']:.3f}s, "
            f"Train Loss={record['train_loss']:.4f}, Val Loss={record['val_loss']:.4f}, "
            f"Val Accuracy={record['val_accuracy']:.4f}{scores(record)}, "
            f"Throughput={record['images_per_sec']:.1f} img/s, "
            f"LR={record['lr']:.5g}, Eval={record['eval_time_s']:.1f}s"
            + (f", Peak memory={peak:.1f} GiB" if peak is not None else "")
            + f" | elapsed {duration(elapsed_s)}, ETA {duration(eta_s)}")


def scores(record):
    """What the epoch line adds to the guide's Val Accuracy: ', Top-5=0.9812' (more than 5
    classes) and ', EMA Accuracy=0.9120' (--model-ema's average); '' for neither."""
    top5, ema = record.get("val_top5"), record.get("ema_val_accuracy")
    return (f", Top-5={top5:.4f}" if top5 is not None else "") + (f", EMA Accuracy={ema:.4f}" if ema is not None
                                                                  else "")


def accuracy_scope(record, test_size, held_out=False):
    """'on 320 of 10000 test images' (with why, when it is not all of them); 'held-out images'
    for --val-fraction's."""
    seen, images = record.get("val_samples"), "held-out images" if held_out else "test images"
    if seen is None or test_size is None or seen == test_size:
        return f"on all {seen if seen is not None else '?'} {images}"
    return f"on {seen} of {test_size} {images} (--limit-batches)"


def which_weights(record):
    """' (the EMA average: ...)' after the weights line, when the run kept one; else ''."""
    if not record or record.get("ema_val_accuracy") is None:
        return ""
    ema, model = record["ema_val_accuracy"], record["val_accuracy"]
    return (f" (the model's EMA average, which validated better: {ema:.4f} against the model's {model:.4f})"
            if validated_ema(record) else
            f" (the model, which validated at least as well as its EMA average: {model:.4f} against {ema:.4f})")


def more_scores(record):
    """[the summary's line of top-5 and --model-ema accuracy] of the final epoch's ``record``, or []."""
    top5, ema, ema_top5 = record.get("val_top5"), record.get("ema_val_accuracy"), record.get("ema_val_top5")
    parts = ([f"Top-5 Accuracy: {top5:.4f}"] if top5 is not None else []) + (
        [f"EMA average: Accuracy {ema:.4f}" + (f", Top-5 {ema_top5:.4f}" if ema_top5 is not None else "")]
        if ema is not None else [])
    return ["; ".join(parts)] if parts else []


def summarize(records, ctx, test_size=None, wall_s=None, resumed=False, held_out=False):
    """The guide's final summary: accuracy and on how many images, training, evaluation and
    wall time apart, and throughput with the warm-up epoch separated from the steady state.
    ``resumed``: this process continued a run, so some epochs ran before it; ``held_out``:
    validation ran on training images held out (--val-fraction), not a test set."""
    if not records:
        return []
    last = records[-1]
    best = max(records, key=validated)
    accel = "GPUs" if ctx.device.type == "cuda" else "CPU processes"
    train_s = sum(r["epoch_time_s"] for r in records)
    eval_s = sum(r.get("eval_time_s", 0.0) for r in records)
    of_best = ", the EMA average's" if validated_ema(best) else ""
    lines = [f"\n{timestamp()} Training complete. Final Accuracy: {last['val_accuracy']:.4f} "
             f"{accuracy_scope(last, test_size, held_out)} (best {validated(best):.4f} at epoch {best['epoch']}"
             f"{of_best})", *more_scores(last),
             f"Time: training {train_s:.1f}s + evaluation {eval_s:.1f}s over the run's "
             f"{count(len(records), 'epoch', 'epochs')}" + (" (those before the resume too)" if resumed else "")
             + (f"; wall time{' of this start' if resumed else ''} {wall_s:.1f}s (reading the data, start-up and "
                "checkpoints included; Python's imports not)" if wall_s is not None else ""),
             f"Throughput: {throughput(records):.1f} img/s (training images / training time)"]
    if len(records) > 1:
        lines.append(f"Throughput excluding epoch 1 (warm-up): {throughput(records[1:]):.1f} img/s; "
                     f"epoch 1: {throughput(records[:1]):.1f} img/s")
    # The epochs a resumed run trained before on other processes, as their records say.
    this_start = {(ctx.world_size, ctx.num_nodes)}
    earlier = ", ".join(f"{count(size, 'process', 'processes')} on {count(nodes, 'node', 'nodes')}"
                        for size, nodes in sorted({(r["world_size"], r["nodes"]) for r in records if "nodes" in r}
                                                  - this_start))
    lines.append(f"Number of nodes: {ctx.num_nodes}, {accel} per node: {ctx.local_world_size}, "
                 f"total {accel}: {ctx.world_size}" + (f" (epochs before the resume: {earlier})" if earlier else ""))
    if "device" in last:  # (records of runs saved before it was recorded lack it)
        peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
        lines.append(f"Device (rank 0): {last['device']}" + (f", peak memory {max(peaks):.2f} GiB" if peaks else ""))
    return lines


# The books are kept on the device, so that no step waits for the GPU, and summed over the ranks
# once, at the end of the epoch (or at a stop).

class StepTotals(NamedTuple):
    """What ``train_steps`` did, summed over all ranks."""
    loss_sum: float  # training loss times images
    images: int
    first_bad: int   # first step with a non-finite loss, 0 if none
    lr: float        # of the last step
    stop: int        # the agreed stop request (engine.stopping.NO_STOP, STOP_FILE or STOP_SIGNAL)


class LossBooks:
    """The running loss sum and the first step with a non-finite loss, kept on the device so
    that no step waits for the GPU; read once, summed over ranks, by ``totals``.

    A step adds its loss in three kernels whose arguments are the loss tensor and the batch
    size alone, the same every step (no step number): what a CUDA graph can replay. The step
    of the first non-finite loss follows from the sum itself: such a loss makes it non-finite
    for good (inf + x = inf, NaN + x = NaN), so counting the steps after which it is still
    finite counts the steps before that one."""

    NONE = 2**62  # "no non-finite loss": larger than any step, so the minimum over ranks works

    def __init__(self, device, first_step=1):
        # [loss times images, steps after which that sum was finite]: float64, exact to 2**53.
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)
        self.first_step = first_step  # the number of the first step added
        self.images = 0  # on the host: progress lines and the totals

    def add(self, loss, images):
        self.sums[:1].add_(loss, alpha=images)  # ``images``: a kernel argument, no copy, no sync
        self.sums[1:].add_(torch.isfinite(self.sums[:1]))
        self.images += images

    def totals(self, lr, stop):
        """Summed over all ranks: the all-reduces are queued, then one host sync reads them, once
        per epoch (or stop). NONE (2**62) and step numbers are exact in float64."""
        first_bad = torch.where(torch.isfinite(self.sums[0]), self.NONE, self.first_step + self.sums[1])
        first_bad = all_reduce(first_bad[None], op="min")
        sums = all_reduce(torch.stack([self.sums[0], self.sums.new_full((), self.images)]))  # a fill, not a copy
        loss_total, images_total, first_bad = torch.cat([sums, first_bad]).tolist()
        first_bad = int(first_bad)
        return StepTotals(loss_total, int(images_total), 0 if first_bad == self.NONE else first_bad, lr, stop)


class EvalResult(NamedTuple):
    accuracy: float  # fraction of test images classified correctly
    loss: float      # mean cross-entropy per image
    samples: int     # test images seen, summed over all ranks
    top5: float = None  # fraction whose class is among the 5 most probable (None: 5 classes or fewer)


def eval_summary(correct, loss_sum, count, top5_correct=None):
    """Metrics from sums over all ranks: each image weighs the same, however uneven the shards.
    ``top5_correct``: images whose class is among the five highest logits, None when not counted."""
    if count <= 0:
        return EvalResult(math.nan, math.nan, 0)
    return EvalResult(correct / count, loss_sum / count, int(count),
                      None if top5_correct is None else top5_correct / count)


# ---------------------------------------------------------------------------------------------
# Building a run: the command line, the task, the run's objects.

def build_parser(description):
    """The one definition of every flag: the engine's (engine/flags.py) and the recipe's."""
    return flags.build_parser(description, recipe.add_arguments)


def parse_args(description, argv=None):
    return flags.parse_args(build_parser(description), recipe.check_arguments, argv)


def check_outputs(args, ctx):
    """Every output the flags name, checked before any data is read: an unwritable one fails now
    (one line), not after hours of training (engine/files.py), and so does one that fit's claim
    of the outputs would refuse (engine/checkpoints.check_claim: a folder another run holds or
    has written, another run's --save-weights file, a --resume with nothing to continue), not
    after minutes of decoding."""
    output_files = {"--metrics-file": args.metrics_file, "--save-weights": args.save_weights}
    output_folders = {"--checkpoint-dir": args.checkpoint_dir, "--tensorboard": args.tensorboard,
                      "--profile-dir": args.profile_dir}
    if any(output_files.values()) or any(output_folders.values()):  # the same on every rank
        from engine import files
        files.check_outputs(output_files, output_folders, ctx.control_group, json_lines={"--metrics-file"})
    if args.checkpoint_dir and any(output_files.values()):  # not under a name the folder keeps for itself
        from engine.checkpoints import check_not_the_folders_own
        for flag, path in output_files.items():
            check_not_the_folders_own(path, args.checkpoint_dir, flag)
    if not args.eval_only and (args.checkpoint_dir or args.save_weights):  # what claimed_outputs writes
        from engine.checkpoints import check_claim
        from_rank0(partial(check_claim, args.checkpoint_dir, args.resume, args.save_weights), ctx.control_group)
    if args.stop_file:  # watched by global rank 0, which decides for all
        from_rank0(partial(check_stop_file, args.stop_file), ctx.control_group)


def build_task(args, ctx):
    """The Task of the flags on this rank: its shard of the data, the model on its device, the
    loaders (--loader auto: the data set on the GPU only if a measured training step fits too)."""
    weights = {flag: path for flag, path in (("--weights", args.weights), ("--finetune", args.finetune)) if path}
    if weights and not args.eval_only:  # --eval-only read its --weights with the flags
        from engine.weights import read_weights
        for flag, path in weights.items():  # their metadata alone (mmap): a wrong path is one line before any decoding
            read_weights(path, flag, mmap=True)  # a file older than PyTorch 1.6 cannot be mapped: read whole, twice
    normalization = {}  # a resumed run's own, as its checkpoints record it
    # Flags the run in --checkpoint-dir did not have: one line before any data is read. Not for an
    # evaluation, which the job scripts give --resume=auto too: it reads --weights, no checkpoint.
    if args.resume and not args.eval_only:
        from engine.checkpoints import check_newest_flags
        normalization, args.epochs = from_rank0(lambda: check_newest_flags(args.checkpoint_dir, vars(args),
                                                                           *resume_rules()), ctx.control_group)
    load_plugin(args.model, "--model")  # a typo in its name is one line before minutes of decoding, not after
    per_image = as_compose(recipe.image_transforms(args))  # a v2.Compose for the DataLoader's workers, or None
    loader, reason = dali_choice(args, ctx.device, ctx.control_group, per_image)  # (None, None) but for DALI
    train_set, test_set, data = build_data(args, ctx, listed=loader == "dali", normalization=normalization)
    layout = memory_format(args.channels_last, ctx.device)
    model, name = build_model(args.model, data, args.seed, ctx.device, layout, args.weights, args.eval_only)
    # Before DDP wraps the model: DDP syncs only the parameters that train.
    note = ""
    if args.finetune:
        from engine.finetune import finetune
        note = finetune(model, args.finetune, args.freeze_backbone, name, data.classes)
    batch = flags.per_process_batch(args.batch_size, ctx.world_size, args.accumulate)
    if loader != "dali":  # DALI decodes, crops and flips the images itself (recipe.dali_images)
        measured = (measured_training(model, args.model, configure_precision(args.precision, ctx.device),
                                      args.accumulate, ctx, data.prep.image_shape, batch, layout)
                    if args.loader == "auto" and not args.eval_only else None)
        temporaries = batch_temporaries(data.prep, batch, train_set.dtype, ctx.device) if measured else 0
        train_set, per_image = with_image_transforms(train_set, per_image)
        data = replace(data, prep=train_set.prep)  # the start-up block names the per-image transforms too
        loader, reason = choose_loader(args.loader, train_set.nbytes + test_set.nbytes, device_memory(ctx.device),
                                       measured, temporaries, per_image)
    workers = args.num_workers if args.num_workers is not None else default_num_workers(ctx.local_world_size)
    train_loader, test_loader = build_loaders(
        train_set, test_set, batch, loader=loader, num_workers=workers, device=ctx.device, rank=ctx.rank,
        world_size=ctx.world_size, seed=args.seed, pin_memory=ctx.device.type == "cuda")
    return Task(model, name, plugin_key(args.model), train_loader, test_loader, data, loader, reason, note,
                own_file(args.model))


def resume_rules():
    """(every flag's default, the names of those a resume must keep): what a resume compares
    the checkpoint's flags with (a checkpoint older than a flag ran with its default)."""
    parser = build_parser("")
    return vars(parser.parse_args([])), flags.run_defining_flags(parser, recipe.RECIPE_GROUP)


@dataclass(frozen=True)
class Run:
    """What the loop works with, built once by ``prepare_run``."""
    model: nn.Module       # what trains: DDP-wrapped in train_ddp.py, compiled with --compile
    module: nn.Module      # the plain model: evaluated, checked and checkpointed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    loss_fn: nn.Module
    precision: Precision
    autocast: object       # precision.autocaster: () -> the forward pass's context (torch.autocast or none)
    memory_format: torch.memory_format  # of the input batches: the model's layout
    ctx: object            # engine.processes.DistContext: who this process is
    args: argparse.Namespace
    task: Task             # the model as built, the loaders and what the data is
    log: RunLogger
    steps: int             # optimizer steps per epoch
    checkpointer: object   # engine/checkpoints.Checkpointer: writes --checkpoint-dir; None without one
    device_name: str       # what runs: GPU model and memory, or the CPU
    clock: RunClock = field(default_factory=RunClock)
    stop: StopRequests = None  # entered by fit: the signal handlers and the stop-file thread
    monitor: object = None  # engine/monitor.Monitors: GPU sampling, TensorBoard, profiler; None: none of them
    mix: object = None     # recipe.make_batch_transform: (x, labels) -> (x, soft labels), or None
    ema: nn.Module = None  # recipe.make_model_ema: the weights' moving average (an AveragedModel), or None
    ema_every: int = 0     # optimizer steps between updates of ``ema`` (recipe.ema_schedule)
    ema_warmup: int = 0    # optimizer steps of the LR warm-up, during which ``ema`` restarts after each update
    compiled: object = None  # --compile: its mode and caches (engine/compiling.Compilation), else None
    regularization: dict = field(default_factory=dict)  # recipe.batch_settings: named in the metrics
    optimizer_settings: str = ""  # describe_optimizer as recipe.py built it, before any scheduler moved it

    def record_fields(self):
        """What the run is, the same in each epoch's metrics record (engine.log.epoch_record)."""
        return {"world_size": self.ctx.world_size, "nodes": self.ctx.num_nodes, "batch_size": self.args.batch_size,
                "per_process_batch": self.args.batch_size // self.ctx.world_size, "loader": self.task.loader,
                "precision": self.precision.name, "synthetic": self.args.synthetic, "dataset": self.args.dataset,
                "model": self.args.model, "epochs": self.args.epochs, "optimizer": type(self.optimizer).__name__,
                "loss": type(self.loss_fn).__name__, "augment": [op.__name__ for op in self.task.data.prep.ops],
                "per_image": [type(t).__name__ for t in getattr(self.task.data.prep.per_image, "transforms", ())],
                "regularization": self.regularization, "device": self.device_name}

    def recipe_code(self):
        return recipe_code(self.loss_fn, self.task.data.prep, self.optimizer_settings)

    def trained(self, record=None):
        """The weights --save-weights and model_best.pt keep: the --model-ema average when it
        validated better than the model in ``record`` (an epoch's metrics), else the model."""
        return self.ema.module if self.ema and validated_ema(record) else self.module

    def weights_metadata(self, record=None):
        """What the weights ``trained(record)`` are trained on, that they are the average (with
        its settings) when they are, and how they validated."""
        ema = {"model_ema": self.regularization} if self.ema and validated_ema(record) else {}
        scores = {"val_accuracy": validated(record), "epoch": record["epoch"]} if record else {}
        return {**self.task.weights_metadata(), **ema, **scores}


# ---------------------------------------------------------------------------------------------
# The start-up block: the run's derived values, printed once.

def describe_run(args, ctx, name, precision, channels_last, task, parameters, steps, continuing=False,
                 optimizer="", loss="", regularization="", own_schedule=None, compiled=None):
    """The derived values, printed once at the start of training (``task``: the task.Task;
    ``parameters``: the model's parameter count; ``continuing``: the run in --checkpoint-dir
    is resumed; ``optimizer``, ``loss``: what runs, described from the objects;
    ``regularization``: the recipe's words for its batch-level settings that are on;
    ``own_schedule``: the class name of recipe.make_scheduler's scheduler, None for lr_factor's;
    ``compiled``: --compile's mode and why, None without it)."""
    data = task.data
    workers = task.train_loader.num_workers
    unused = f": --num-workers {args.num_workers} has no effect" if args.num_workers else ""
    loader = {"device": f"device (data set and augmentation on {ctx.device}, no worker processes{unused})",
              "dali": f"NVIDIA DALI (decoding and augmentation on the {'GPU' if ctx.device.type == 'cuda' else 'CPU'}, "
                      f"{count(getattr(task.train_loader, 'threads', 0), 'CPU thread', 'CPU threads')} per process)",
              }.get(task.loader, f"torchvision DataLoader, {count(workers, 'worker process', 'worker processes')} per "
                                 "training process")
    size = f"{parameters / 1e6:.1f} M" if parameters >= 100_000 else f"{parameters:,}"  # not "0.0 M" for a small net
    lines = [
        f"{timestamp()} Training {task.model_name}, {size} parameters, on {data.title} with Batch "
        f"Size: {args.batch_size} ({per_process(task.train_loader.batch_size, args.accumulate)} x "
        f"{processes(ctx, ctx.world_size)}, {count(ctx.num_nodes, 'node', 'nodes')})",
        describe_device(ctx, name, precision, channels_last, compiled),
        f"Loader: {loader}; {task.loader_reason}",
        f"Data: {describe_data(data, task.train_loader, task.test_loader)}, {count(steps, 'step', 'steps')} per epoch",
        *data.notes,
        *size_warning(data),
        f"Augmentation: {data.prep.describe()}",
        f"Weights: {describe_weights(args, continuing, task.weights_note)}",
        f"Recipe: {optimizer}; loss {loss}; LR schedule: "
        + (f"{own_schedule} (recipe.make_scheduler)" if own_schedule
           else f"{args.warmup_epochs:g} warm-up epochs, then {args.lr_schedule}"),
        *([f"Regularization: {regularization}"] if regularization else []),
        describe_length(args.epochs, args.target_accuracy, args.patience),
        # Of the run's first schedule: said when it starts (an extension's own line says what the LR does next).
        *([] if own_schedule or continuing else warmup_notes(args.warmup_epochs, args.epochs, args.lr_schedule)),
        *([f"Note: {' and '.join(ignored)} {'shape' if len(ignored) > 1 else 'shapes'} lr_factor's schedule, which "
           f"recipe.make_scheduler's {own_schedule} replaces: "
           f"{'they have' if len(ignored) > 1 else 'it has'} no effect"]
          if own_schedule and (ignored := unused_schedule_flags(args)) else []),
    ]
    if args.checkpoint_dir:
        lines.append(f"Checkpoints: {args.checkpoint_dir}, "
                     + (f"at the end of an epoch at most every {args.checkpoint_interval:g} min"
                        if args.checkpoint_interval else "after every epoch")
                     + ", on a stop request and at the end")
    elif args.save_weights:  # the weights asked for come at the end: a stop before it would keep nothing
        lines.append(f"Checkpoints: none: a stop before the end (Ctrl-C, scancel, a time limit) keeps nothing, not "
                     f"even {args.save_weights}; --checkpoint-dir DIR keeps the run")
    return lines


def unused_schedule_flags(args):
    """--warmup-epochs and --lr-schedule given other than their defaults: lr_factor's, which a
    scheduler of recipe.make_scheduler's own replaces."""
    def shown(values):
        return {"--warmup-epochs": f"{values.warmup_epochs:g}", "--lr-schedule": values.lr_schedule}

    default = shown(parse_args("", []))  # as recipe.check_arguments completes them
    return [f"{flag} {value}" for flag, value in shown(args).items() if value != default[flag]]


def describe_evaluation(args, ctx, name, precision, channels_last, task):
    """The start-up block of --eval-only: what is evaluated where, no training recipe."""
    split = "held-out images" if task.data.held_out else "test set"
    return [f"{timestamp()} Evaluating {task.model_name} weights {args.weights} on the {task.data.title} {split} "
            f"({task.test_loader.batch_size} images per batch and process x {processes(ctx, ctx.world_size)})",
            describe_device(ctx, name, precision, channels_last),
            f"Data: {describe_data(task.data, None, task.test_loader)}",
            *task.data.notes,
            *size_warning(task.data),
            # The job scripts pass --save-weights to every run: said, not refused.
            *[f"Note: {flag} {path} is not written: --eval-only trains nothing"
              for flag, path in (("--save-weights", args.save_weights), ("--checkpoint-dir", args.checkpoint_dir),
                                 ("--tensorboard", args.tensorboard), ("--profile-dir", args.profile_dir)) if path],
            # A training command line with --eval-only added: the recipe it keeps is said unused, not refused.
            *([f"Note: {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect: --eval-only trains "
               "nothing"] if (unused := unused_recipe_flags(args)) else [])]


TRAINING_LENGTH_FLAGS = ("epochs", "target_accuracy", "patience", "checkpoint_interval")  # --eval-only ignores them


def unused_recipe_flags(args):
    """The recipe's flags that --eval-only does not use (all but --batch-size and --augment), and
    those of the training's length, as ``args`` sets them other than their defaults
    (--optimizer's own defaults for its choice)."""
    default = parse_args("", [])
    return [typed_flag(name, getattr(args, name)) for name in recipe_flags_set(args)
            if name not in ("batch_size", "augment")] + [
        typed_flag(name, getattr(args, name)) for name in TRAINING_LENGTH_FLAGS
        if getattr(args, name) not in (None, getattr(default, name))]


def recipe_flags_set(args):
    """The names of the recipe's flags that ``args`` sets other than their defaults
    (--optimizer's own defaults for its choice)."""
    default, chosen = parse_args("", []), vars(parse_args("", ["--optimizer", args.optimizer]))
    names = flags.group_flags(build_parser(""), recipe.RECIPE_GROUP)
    return [name for name in names
            if getattr(args, name) != (default.optimizer if name == "optimizer" else chosen[name])]


def typed_flag(name, value):
    """A flag as on the command line: --model-ema, --no-nesterov, --base-lr 0.1."""
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {flag_value(value)}"


def flags_not_passed_on(args, optimizer, loss_fn):
    """The start-up Note for recipe flags given that recipe.py's code, as edited, did not pass
    on as given (an AdamW built with its own lr, a loss with its own label_smoothing, --momentum
    to an optimizer without one): the Recipe line says what runs, this which flags changed
    nothing there. None when every one given arrived."""
    built = {"base_lr": optimizer.defaults.get("lr"), "weight_decay": optimizer.defaults.get("weight_decay"),
             "momentum": optimizer.defaults.get("momentum"), "nesterov": optimizer.defaults.get("nesterov"),
             "label_smoothing": getattr(loss_fn, "label_smoothing", None)}
    built = {name: float(value) if torch.is_tensor(value) else value for name, value in built.items()}  # a tensor lr
    missed = [typed_flag(name, getattr(args, name)) for name in recipe_flags_set(args)
              if name in built and built[name] != getattr(args, name)]
    return (f"Note: recipe.py did not pass on {', '.join(missed)} as given: the Recipe line has what runs"
            if missed else None)


def warmup_notes(warmup_epochs, epochs, schedule):
    """[the Note on lr_factor's warm-up that fills the run], or []: longer than the run, the
    learning rate never reaches the base LR; as long, the run ends at it, before any decay."""
    if warmup_epochs > epochs:
        return [f"Note: the {warmup_epochs:g} warm-up epochs are longer than this {epochs}-epoch run: the "
                f"learning rate peaks at {epochs / warmup_epochs:.0%} of the base LR"]
    if warmup_epochs == epochs and schedule != "constant":
        return [f"Note: the {warmup_epochs:g} warm-up epochs are the whole of this {epochs}-epoch run: it ends at the "
                f"base LR, before any {schedule} decay (a lower --warmup-epochs or a higher --epochs has one)"]
    return []


def describe_weights(args, continuing=False, note=""):
    if continuing:
        return f"from the newest readable checkpoint in {args.checkpoint_dir} (resuming)"
    if note:
        return note
    if args.weights:
        return f"loaded from {args.weights}"
    return f"random initialization (--seed {args.seed})"


def prepare_run(task, args, ctx, continuing=False, clock=None, stop=None):
    """(Run, TrainState, this rank's RNG states or None): the optimizer, schedule, scaler and
    loss for ``task``, a new run's state or (``continuing``) the checkpoint's, loaded on every
    rank; the derived values printed once. ``stop``: fit's StopRequests, entered already (None:
    a new one, for the tools that call this and the loop's functions themselves)."""
    precision = configure_precision(args.precision, ctx.device)
    log = RunLogger(ctx.is_main, args.metrics_file, checkpointed=bool(args.checkpoint_dir))
    steps = limited(task.train_loader, args.limit_batches)  # optimizer steps per epoch
    if steps == 0 and not args.eval_only:
        kept, held = len(task.train_loader.dataset), len(task.test_loader.dataset)
        split = (f" (--val-fraction {args.val_fraction:g} held out {held} of {kept + held})" if task.data.held_out
                 else "")
        shards = f" ({kept // ctx.world_size} for each of {ctx.world_size} processes)" if ctx.world_size > 1 else ""
        raise UserError(f"the {kept} training images{split} give no full batch of {task.train_loader.batch_size} per "
                        f"process{shards}; lower --batch-size" + (" or --val-fraction" if split else ""))
    ema_schedule = None if args.eval_only else recipe.ema_schedule(args, args.epochs * steps)  # --model-ema's
    module = unwrap(task.model)
    if not args.eval_only and not any(p.requires_grad for p in module.parameters()):  # else the optimizer's error
        raise UserError(f"--model {args.model} has no trainable parameters: nothing to train")
    optimizer, loss_fn = recipe.make_optimizer(module, args, ctx.device), recipe.make_loss(args)
    check_optimizer(optimizer)
    described = describe_optimizer(optimizer)  # as recipe.py set it: a scheduler may rewrite lr, momentum (OneCycleLR)
    prefill_momentum(optimizer)
    # recipe.py's own LR scheduler, or None: lr_factor's, built with the schedule's cycles below.
    own = None if args.eval_only else recipe.make_scheduler(optimizer, args, args.epochs * steps)
    schedule_notes = []
    if own is None and not args.eval_only:  # lr_factor's, tabulated per step: a bounded length
        check_schedule_length(args.epochs, steps)
    if own is not None:  # what its first step (or its last) would find in a traceback, and a length meant as epochs
        from engine.own_scheduler import check_scheduler, schedule_length_notes
        check_scheduler(own, args.epochs * steps)
        schedule_notes = schedule_length_notes(own, args.epochs * steps, steps)
    mix = recipe.make_batch_transform(args, len(task.data.classes))
    if not args.eval_only:  # what the first step would otherwise find, in a traceback
        check_loss(loss_fn, len(task.data.classes), bool(args.mixup_alpha or args.cutmix_alpha), ctx.device)
        check_batch_transform(mix, task.data.prep.image_shape, len(task.data.classes), ctx.device)
    compiled = None
    if args.compile and not args.eval_only:
        from engine.compiling import prepare_compile  # --compile only
        compiled = prepare_compile(args.compile_mode or "auto", ctx.device.type, ctx.process_group, args.accumulate,
                                   args.checkpoint_dir, os.environ)
    # The checkpoint to continue, refused before the start-up block when it is another run's (other data,
    # another --model or recipe): the error is the one line the user sees.
    resumed = resumable_checkpoint(task, args, ctx, log, optimizer, loss_fn, own, described) if continuing else None
    layout = memory_format(args.channels_last, ctx.device)  # the model's, from build_task
    name = device_name(ctx.device)
    header = (describe_evaluation(args, ctx, name, precision, layout == torch.channels_last, task) if args.eval_only
              else describe_run(args, ctx, name, precision, layout == torch.channels_last, task,
                                sum(p.numel() for p in module.parameters()), steps, continuing,
                                described, describe_loss(loss_fn),
                                recipe.describe_regularization(args, steps, ema_schedule),
                                type(own).__name__ if own is not None else None, compiled and compiled.describe()))
    ignored = None if args.eval_only else flags_not_passed_on(args, optimizer, loss_fn)
    warmup = first_cycle(args.epochs, args.warmup_epochs, steps).warmup  # optimizer steps
    for line in [*header, *([ignored] if ignored else []),
                 *recipe.ema_warning(args, ema_schedule, args.epochs * steps, warmup),
                 *schedule_notes]:
        log.info(line)
    if ctx.process_group:  # the NCCL that is loaded, the network variables in effect
        from engine.nccl_log import network_report
        for line in network_report(ctx):
            log.info(line)
    if args.synthetic:
        log.info("WARNING: --synthetic: the data are random, so loss and accuracy are meaningless.")
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=precision.name == "fp16")
    checkpointer = None
    if args.checkpoint_dir and not args.eval_only:  # an evaluation writes no checkpoint, and holds no folder
        from engine.checkpoints import Checkpointer
        checkpointer = Checkpointer(args.checkpoint_dir, args.checkpoint_interval, ctx, vars(args), log.info,
                                    new_run=None if continuing else {"model": task.model_key, "dataset": task.data.key},
                                    defining=resume_rules()[1])
    factor = partial(recipe.lr_factor, schedule=args.lr_schedule)
    ema = recipe.make_model_ema(module, ema_schedule)
    if continuing:
        state, rng_state, scheduler = resume(resumed, task, args, ctx, log, optimizer, scaler, ema, checkpointer, steps,
                                             factor, own)
    else:
        if args.resume == "auto" and not args.eval_only:
            log.info(f"No checkpoint in {args.checkpoint_dir}: starting a new run there")
        cycles = [list(first_cycle(args.epochs, args.warmup_epochs, steps))]
        state = TrainState(run_id=from_rank0(new_run_id, ctx.control_group), lr_cycles=cycles)  # one ID: traces
        rng_state = None
        scheduler = own if own is not None else make_scheduler(optimizer, cycles, factor, args.epochs * steps)
    run = Run(model=torch.compile(task.model, mode=compiled.mode) if compiled else task.model,  # in the first step
              module=module, optimizer=optimizer, scheduler=scheduler, scaler=scaler, loss_fn=loss_fn,
              precision=precision, autocast=precision.autocaster(ctx.device), memory_format=layout, ctx=ctx,
              args=args, task=task, log=log, steps=steps,
              checkpointer=checkpointer, device_name=name, clock=clock or RunClock(),
              stop=stop or StopRequests(ctx, args.stop_file, args.checkpoint_dir),
              monitor=monitors(ctx, log, state, continuing, (args.epochs - state.epoch + 1) * steps - state.step, steps,
                               args.tensorboard, args.profile_dir, args.profile_skip, args.profile_steps),
              mix=mix, ema=ema,
              ema_every=ema_schedule.every if ema_schedule else 0,
              ema_warmup=warmup if ema_schedule else 0,
              regularization=recipe.batch_settings(args, ema_schedule), compiled=compiled,
              optimizer_settings=described)
    return run, state, rng_state


def monitors(ctx, log, state, continuing, steps_left, steps_per_epoch, tensorboard, profile_dir, profile_skip,
             profile_steps):
    """engine/monitor.Monitors for a run on a GPU (NVML), or with --tensorboard or --profile-dir;
    None for any other (a CPU run watches nothing: the module is not imported)."""
    if ctx.device.type != "cuda" and not tensorboard and not profile_dir:
        return None
    from engine.monitor import Monitors
    return Monitors(ctx, log, state.run_id, state.records[-1] if state.records else None, continuing, steps_left,
                    steps_per_epoch, tensorboard, profile_dir, profile_skip, profile_steps)


def resumable_checkpoint(task, args, ctx, log, optimizer, loss_fn, own=None, optimizer_settings=""):
    """(path, checkpoint): the one global rank 0 chose in --checkpoint-dir, read on every rank,
    once it is known to continue this run: the same data, --model, optimizer and recipe
    (engine/checkpoints.check_resumable), and a larger --epochs only where the schedule can be
    extended (``own``: recipe.make_scheduler's scheduler or None; ``optimizer_settings``: Run's)."""
    from engine.checkpoints import check_resumable, load_agreed_checkpoint
    from engine.weights import check_state_fits
    path, checkpoint = load_agreed_checkpoint(args.checkpoint_dir, ctx, log)
    check_resumable(checkpoint, vars(args), task.data.fingerprint, task.model_key, optimizer,
                    partial(check_state_fits, unwrap(task.model), model_name=task.model_name), *resume_rules(),
                    scheduler_class=type(own).__name__ if own is not None else "LambdaLR",
                    recipe_code=recipe_code(loss_fn, task.data.prep, optimizer_settings))
    planned = checkpoint["args"]["epochs"]
    if own is not None and args.epochs > planned and not target_reached(checkpoint["state"]["history"],
                                                                         args.target_accuracy, args.patience):
        raise UserError(f"--epochs {args.epochs}: the run in {args.checkpoint_dir} planned {planned}, and "
                        f"recipe.make_scheduler's {type(own).__name__} cannot be extended (lr_factor's "
                        f"schedule can); resume with --epochs {planned}, or start a new run")
    return path, checkpoint


def resume(resumed, task, args, ctx, log, optimizer, scaler, ema, checkpointer, steps, factor, own=None):
    """(TrainState, this rank's RNG states or None, scheduler) of the run in --checkpoint-dir,
    continued from ``resumed`` (resumable_checkpoint's path and checkpoint) on every rank; a
    larger --epochs extends lr_factor's schedule by a warm restart (``own``:
    recipe.make_scheduler's scheduler, which keeps the run's --epochs)."""
    from engine.checkpoints import forked_run_id, restore
    module = unwrap(task.model)
    path, checkpoint = resumed
    saved = checkpoint["args"]
    planned = saved["epochs"]
    # A checkpoint written before extensions existed has the one cycle its flags define.
    cycles = checkpoint["state"].get("lr_cycles") or [first_cycle(planned, saved["warmup_epochs"], steps)]
    finished = target_reached(checkpoint["state"]["history"], args.target_accuracy, args.patience)
    if args.epochs > planned and not finished and own is None:  # an own scheduler: resumable_checkpoint refused it
        cycles = extend(cycles, args.epochs, args.warmup_epochs, steps, checkpoint["scheduler"]["last_epoch"], factor)
        log.info(describe_extension(planned, args.epochs, args.base_lr, args.lr_schedule, Cycle(*cycles[-1]), steps))
    scheduler = own if own is not None else make_scheduler(optimizer, cycles, factor, args.epochs * steps)
    kernels = kernel_choices(optimizer)
    rng_state = restore(checkpoint, module, optimizer, scheduler, scaler, ctx, ema)
    state = replace(TrainState(**checkpoint["state"]), lr_cycles=[list(c) for c in cycles])
    fit_optimizer_to_params(optimizer, kernels)
    checkpointer.loaded(scheduler.last_epoch, state)  # that checkpoint need not be written again
    log.info(describe_resume(path, state, checkpoint["world_size"], ctx.world_size, args.weights))
    if checkpoint.get("loader", task.loader) != task.loader:  # --loader auto's choice on another GPU, say
        log.info(f"Note: the run trained on --loader {checkpoint['loader']} before, now {task.loader}: the same "
                 "images in the same order, with other random augmentation draws (each loader draws its own)")
    fork = from_rank0(lambda: forked_run_id(checkpoint.get("folder"), args.checkpoint_dir, state.run_id),
                      ctx.control_group)
    replaces = None  # the run whose lines in --metrics-file this one's records replace
    if fork:  # a copy of the folder: its lines in --metrics-file (TensorBoard, traces) are its own
        metrics = Path(args.metrics_file) if args.metrics_file else None
        if metrics is not None and metrics.exists():
            copied = copied_with(metrics, args.checkpoint_dir, checkpoint["folder"]["path"])
            replaces = state.run_id if copied else None  # the original's lines there are the copy's epochs
            lines = (" (its --metrics-file, copied with it, goes on under the new ID)" if copied
                     else " (--metrics-file keeps the lines of both)")
        else:
            lines = ""
        log.info(f"Note: {args.checkpoint_dir} is a copy of {checkpoint['folder']['path']}: it goes on as run {fork}, "
                 f"apart from run {state.run_id} there{lines}")
        state = replace(state, run_id=fork, records=[{**record, "run_id": fork} for record in state.records])
    if state.epoch > args.epochs or target_reached(state.history, args.target_accuracy, args.patience):
        log.info(f"The run in {args.checkpoint_dir} is complete (epoch {state.epoch - 1}): nothing to train")
    if args.metrics_file:  # rewritten by rank 0; a failure stops every rank
        for warning in from_rank0(lambda: reconcile_metrics(log.metrics_path, state.run_id, state.records, replaces),
                                  ctx.control_group):
            log.info(warning)
    return state, rng_state, scheduler


def copied_with(file, copy, original):
    """Whether ``file`` inside the folder ``copy`` of the folder ``original`` was copied with it:
    the original holds a file at the same place that is another file (not the shared one, as when
    the copy is a parent of the original)."""
    file, copy = Path(file).resolve(), Path(copy).resolve()
    if not file.is_relative_to(copy):
        return False
    there = Path(original) / file.relative_to(copy)
    try:
        return there.exists() and not there.samefile(file)
    except OSError:
        return False


def recipe_code(loss_fn, prep, optimizer_settings=""):
    """What recipe.py's code, beyond its flags, made of a run, in words: its loss, the
    augmentation, the per-image transforms (``prep``: the data's Preprocessing) and the
    optimizer's settings as built (describe_optimizer: an edited weight_decay=0.5, which the
    checkpoint's optimizer state would silently replace on a resume). A checkpoint records it,
    and a resume after an edit that changes it is refused (check_resumable)."""
    per_image = "none" if prep.per_image is None else re.sub(r"\s+", " ", repr(prep.per_image))  # one line
    per_image = re.sub(r" at 0x[0-9a-fA-F]+", "", per_image)  # a plain object's repr, without its address
    operations = ", ".join(op.__name__ for op in prep.ops)
    settings = {"optimizer settings": optimizer_settings} if optimizer_settings else {}
    return {"loss": describe_loss(loss_fn), "augmentation": f"{prep.augment} ({operations})",
            "per-image transforms": per_image, **settings}


def step_mistake(run, err, state, where, steps_done):
    """What a forward or backward that raised ``err`` at ``where`` is, when it is not a bug of
    ours: out of memory (run_out_of_memory), or an exception in the user's --model file on
    this batch (its line: engine.cli.user_code_error); None otherwise (the traceback)."""
    if is_out_of_memory(err):
        return run_out_of_memory(run, state, where, steps_done)
    return user_code_error(err, [run.task.model_file] if run.task.model_file else [])


def run_out_of_memory(run, state, where, steps_done):
    """engine.out_of_memory's error for this run: its micro-batch, image size, precision and
    newest checkpoint (of ``state``, a TrainState, or None)."""
    from engine.out_of_memory import out_of_memory  # imported by a run that ran out of memory alone
    checkpoints = state.checkpoints if state else []
    kept = Path(run.args.checkpoint_dir) / checkpoints[-1] if checkpoints else None
    micro = run.task.train_loader.batch_size // run.args.accumulate
    return out_of_memory(where, run.ctx.device, run.args.accumulate, micro, run.task.data.prep.image_shape[:2],
                         run.precision.name, steps_done, kept, sized_images=run.args.dataset == flags.FOLDER,
                         checkpointed=run.args.checkpoint_dir is not None)


def unwrap(model):
    """The plain module inside a DDP (or similar) wrapper."""
    return getattr(model, "module", model)


# ---------------------------------------------------------------------------------------------
# Small pure pieces.

def limited(loader, limit_batches):
    """The batches of ``loader`` an epoch (or evaluation) takes: all, or at most --limit-batches."""
    return min(len(loader), limit_batches or len(loader))


def epochs_left(state, args):
    """Does the run train another epoch: one of --epochs is left, and --target-accuracy is not
    reached? The same on every rank (the history is of all-reduced accuracies)."""
    return state.epoch <= args.epochs and not target_reached(state.history, args.target_accuracy, args.patience)


def target_reached(history, target, patience):
    """True when the last ``patience`` validation accuracies are all >= ``target`` (None: never)."""
    return target is not None and len(history) >= patience and all(acc >= target for acc in history[-patience:])
