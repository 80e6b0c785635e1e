"""Checkpoints: what a run needs to continue exactly where it stopped, on any number of GPUs,
without losing or overwriting anything already written.

- A checkpoint folder belongs to one run. A new run refuses a folder that holds
  checkpoints; ``--resume`` continues the run in it; ``--resume=auto`` (the job scripts)
  continues it when there is a checkpoint and starts a new run otherwise.
- Global rank 0 writes every checkpoint atomically, keeps the newest two of its own run
  (pruning never touches a file this run did not write) and chooses the checkpoint a resume
  starts from; every rank loads exactly that file, or the run stops with one error.
- Checkpoints are written at the end of an epoch at most every ``--checkpoint-interval``
  minutes (0 = every epoch), and always on a stop request and at the end of training.
- A resume with another model, data set, recipe or optimizer is refused in one line.
"""

import errno
import hashlib
import itertools
import os
import time
import zipfile
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch

from engine.errors import ResourceProblem, UserError, size_text
from engine.files import atomic_save
from engine.flags import FOLDER, KEEP_CHECKPOINTS
from engine.log import count, flag_value
from engine.memory import is_out_of_memory
from engine.processes import FLIGHT_RECORDER_PREFIX, any_rank, from_rank0, gather_objects
from engine.weights import (BEST_WEIGHTS, JOB_WEIGHTS, MODEL_EMA, check_weights_target, read_weights, save_weights,
                            with_model_file)
from engine.task import DATASETS, fingerprints_differ

CHECKPOINT_PREFIX, CHECKPOINT_FORMAT = "checkpoint_", 1


RUN_FLAGS = "run_flags"  # BEST_WEIGHTS' record of the flags that define its run (Checkpointer's ``defining``)

UNREADABLE_SUFFIX = ".unreadable"  # an unreadable checkpoint is renamed aside, never deleted


def checkpoint_paths(directory):
    """Checkpoints in ``directory``, newest first (the names sort by optimizer step)."""
    return sorted(Path(directory).glob(f"{CHECKPOINT_PREFIX}*.pt"), reverse=True)


def continues_run(directory, resume):
    """Whether this run continues the run in ``directory`` (True) or starts a new one (False).

    ``resume``: None (a new run), "required" (--resume: continue, error if nothing to continue)
    or "auto" (continue when there is a checkpoint). A new run never starts in a folder that
    holds checkpoints: its own would overwrite and prune the other run's, and a later --resume
    would not know which run it continues. Call on global rank 0 (``from_rank0``).
    """
    existing = checkpoint_paths(directory) if directory else []
    aside = [] if existing or not directory else set_aside(directory)
    if resume == "required":
        if aside:  # unreadable, not absent: no new run is suggested over them
            raise UserError(f"--resume: no readable checkpoint in {directory}: {count(len(aside), 'was', 'were')} "
                            f"set aside as unreadable (newest: {aside[0].name}); see docs/checkpoints.md")
        if not existing:  # before the header and the first step, not after them
            raise UserError(f"--resume: no checkpoint in {directory}, nothing to continue (--resume=auto starts a "
                            "new run where there is none)")
        return True
    if resume == "auto":
        if aside:  # a run was here: a new one would take its model_best.pt for its own, and replace it
            raise UserError(f"--resume=auto: no readable checkpoint in {directory}: {count(len(aside), 'was', 'were')} "
                            f"set aside as unreadable (newest: {aside[0].name}), so no new run starts there: move "
                            f"{'it' if len(aside) == 1 else 'them'} away first, or give this run another "
                            "--checkpoint-dir; see docs/checkpoints.md")
        return bool(existing)
    if existing:
        raise UserError(f"--checkpoint-dir {directory} already holds checkpoints of an earlier run (newest: "
                        f"{existing[0].name}); continue that run with --resume, or give this run another "
                        "--checkpoint-dir")
    if directory and (Path(directory) / BEST_WEIGHTS).exists():  # its checkpoints gone, its best weights not
        raise UserError(f"--checkpoint-dir {directory} holds {BEST_WEIGHTS} (an earlier run's best weights, or a file "
                        "of your own), which this run would replace: move it elsewhere, or give this run another "
                        "--checkpoint-dir (a run of these flags that was killed before its first checkpoint: "
                        "--resume=auto starts it again and keeps the better weights)")
    return False


@contextmanager
def claimed_folder(directory, resume, ctx, weights=None):
    """``with claimed_folder(...) as continuing``: global rank 0 holds ``directory`` (or None)
    for this run (engine/folder_lock.py: a second run on it is refused in one line), and every
    rank learns whether the run in it continues (continues_run). The run's --save-weights
    file, ``weights``, must not be another run's (check_weights_target)."""
    with ExitStack() as held:
        yield from_rank0(lambda: claim(held, directory, resume, weights), ctx.control_group)


def check_claim(directory, resume, weights=None):
    """What claimed_folder would refuse (a folder another run holds, a --resume with nothing to
    continue, another run's checkpoints or --save-weights file), asked before any data is read
    or decoded (train_utils.check_outputs): the folder is held while it is checked, then let
    go. claimed_folder holds it again for the run, and decides. Call on global rank 0."""
    with ExitStack() as held:
        claim(held, directory, resume, weights)


def claim(held, directory, resume, weights):
    """Hold ``directory`` (or None) in ``held`` (an ExitStack) and return whether the run in it
    continues (continues_run), or refuse in one line."""
    if resume == "required" and directory and not os.path.isdir(directory):  # a typo: say so, make nothing
        raise UserError(f"--resume: there is no folder {directory} (--checkpoint-dir): nothing to continue")
    if directory:
        from engine.folder_lock import FolderLock
        held.enter_context(FolderLock(directory))
    continuing = continues_run(directory, resume)
    check_weights_target(weights, directory, continuing)
    return continuing


def check_not_the_folders_own(path, directory, flag):
    """An output file of ``flag`` (--save-weights, --metrics-file) may lie in --checkpoint-dir
    (the job scripts' DIR/weights.pt), but not under a name the folder keeps for itself: it
    would replace the best epoch's weights (BEST_WEIGHTS) or a checkpoint, be written into one,
    or be pruned as one."""
    if not path or not directory or Path(path).resolve().parent != Path(directory).resolve():
        return
    name = Path(path).name
    if name == BEST_WEIGHTS:
        kept = "the best epoch's weights"
    elif name.startswith(CHECKPOINT_PREFIX) and name.endswith(".pt"):
        kept = "its checkpoints"
    else:
        return
    hint = (f" (the job scripts write their weights to {Path(directory) / JOB_WEIGHTS})" if flag == "--save-weights"
            else "")
    raise UserError(f"{flag} {path}: --checkpoint-dir {directory} keeps {kept} under that name; give {flag} "
                    f"another{hint}")


def set_aside(directory):
    """The checkpoints in ``directory`` that choose_checkpoint renamed as unreadable, newest first."""
    return sorted(Path(directory).glob(f"{CHECKPOINT_PREFIX}*.pt{UNREADABLE_SUFFIX}*"), reverse=True)


# A read that failed for the node's sake, not the file's: the file system (an I/O error, a stale
# NFS handle, a time-out, a permission), or memory. Others (EINVAL from torch's zip reader on a
# file cut short, say) are the file's.
NODE_ERRNOS = {errno.EIO, errno.EACCES, errno.EPERM, errno.ESTALE, errno.ETIMEDOUT, errno.ENOMEM, errno.ENOENT,
               errno.EAGAIN}


def read_checkpoint(path):
    """The checkpoint at ``path``, on the CPU and memory-mapped: restore copies each tensor to
    its parameter's device, so a resume never holds the model twice in GPU memory, and the
    ranks of a node share the file's pages instead of each reading it whole into its own."""
    # A file that is not a zip (torch.save's format) cannot be mapped: read, it says what it is.
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError("not a checkpoint of these scripts")
    return checkpoint


def _why(err):
    """A short, whole reason: the error's type and the first sentence of its message (torch.load's
    messages run to several sentences of advice that do not apply here)."""
    text = " ".join(str(err).split())
    first = text.split(". ", 1)[0].rstrip(".")
    return f"{type(err).__name__}: {first}" if first else f"{type(err).__name__} (empty or truncated file?)"


def _aside(path):
    """Where an unreadable checkpoint goes: NAME.unreadable (.2, .3, ...: never over an earlier one)."""
    for n in itertools.count(1):
        aside = path.with_name(f"{path.name}{UNREADABLE_SUFFIX}{f'.{n}' if n > 1 else ''}")
        if not aside.exists():
            return aside


def choose_checkpoint(directory, log):
    """(path, checkpoint): the newest checkpoint in ``directory`` that reads. A newer one that
    does not read is renamed to NAME.unreadable (kept, out of the way) with a warning. Never a
    silent fresh start: nothing readable is an error. A read that failed for the node's sake,
    not the file's (an I/O or permission error, memory running out), stops the resume with
    every file in place: an older checkpoint would lose the newer steps, and the next attempt
    may read it. Call on global rank 0."""
    problems = []
    for path in checkpoint_paths(directory):
        try:
            return path, read_checkpoint(path)
        except Exception as err:  # truncated, corrupted, or foreign; or the node's
            if (isinstance(err, OSError) and err.errno in NODE_ERRNOS) or is_out_of_memory(err):
                why = "out of memory" if is_out_of_memory(err) else _why(err)
                raise UserError(f"--resume: cannot read {path} ({why}); it is left in place and no older "
                                "checkpoint is tried: run again once it can be read (the same command "
                                "continues)") from None
            aside = _aside(path)
            try:
                os.replace(path, aside)
                kept = f"renamed to {aside.name}"
            except OSError:
                kept = "left in place"
            log.info(f"WARNING: checkpoint {path} is unreadable ({_why(err)}), {kept}; trying the previous one")
            # Each reason again in the error: a batch job's error file holds this line, its
            # output file the warnings.
            problems.append(f"{path.name}: {_why(err)}, {kept}")
    found = f" ({'; '.join(problems)})" if problems else ""
    raise UserError(f"--resume: no readable checkpoint in {directory}{found}")


def load_agreed_checkpoint(directory, ctx, log):
    """(path, checkpoint), the same file on every rank: global rank 0 chooses it, every other
    rank reads exactly that file. A rank that cannot read it (a folder that is not shared, a
    file-system error) stops every rank with the same one-line error; no rank falls back to
    another checkpoint on its own, which would resume the ranks at different steps."""
    chosen = {}

    def choose():
        path, chosen["checkpoint"] = choose_checkpoint(directory, log)
        return str(path)

    path = from_rank0(choose, ctx.control_group)
    failure = None
    if not ctx.is_main:
        try:
            chosen["checkpoint"] = read_checkpoint(path)
        except Exception as err:
            failure = _why(err)
    failures = {rank: why for rank, why in enumerate(gather_objects(failure, ctx.control_group)) if why}
    if failures:
        rank, why = next(iter(failures.items()))
        raise UserError(f"--resume: rank(s) {sorted(failures)} cannot read {path}, the checkpoint rank 0 chose "
                        f"(rank {rank}: {why}); every node must see the same --checkpoint-dir, on a "
                        "shared file system")
    return Path(path), chosen["checkpoint"]


def check_resumable(checkpoint, flags, fingerprint, model_key, optimizer, check_fits, defaults, recipe_flags,
                    scheduler_class="LambdaLR", recipe_code=None):
    """Refuse to continue a run with another model, data set, optimizer or recipe (it would not
    be the same run). ``flags``: this run's, by name, as a checkpoint records them (its "args").
    ``check_fits(state_dict, source)`` raises when the model's shape differs;
    ``optimizer`` is the one this run built, ``scheduler_class`` the name of its LR scheduler's
    class (LambdaLR: lr_factor's; recipe.make_scheduler's own); ``recipe_flags``: the names of
    the flags a resume must keep; ``recipe_code``: what recipe.py's code made of this run in
    words (Run.recipe_code), to compare with the checkpoint's. A checkpoint written before a
    flag existed ran with its default (``defaults``: the flags' defaults, by name)."""
    saved = {**defaults, **checkpoint["args"]}
    trained_on = checkpoint["data"].get("dataset", defaults["dataset"])
    if trained_on != fingerprint["dataset"]:
        raise other_data_set(trained_on, flags["dataset"], saved["dataset"])
    if checkpoint.get("model_key", defaults["model"]) != model_key:
        raise UserError(f"the checkpoint was trained with --model {saved['model']}, this run has --model "
                        f"{flags['model']}; "
                        f"resume with --model {saved['model']}, or start a new run in another --checkpoint-dir")
    old, new = checkpoint["data"], fingerprint
    differ = fingerprints_differ(old, new)
    if differ:
        other = {"test_images": f"{old.get('test_images')} test images then, {new.get('test_images')} now",
                 "train_labels_sha256": "different labels",
                 "classes": class_change(old.get("classes"), new.get("classes")),
                 "image_shape": f"images of shape {old.get('image_shape')} then, {new.get('image_shape')} now",
                 "train_sample_sha256": "other pixels in a sample of the training images",
                 "train_names_sha256": "other file names (renamed, moved or replaced), which may move images "
                                       "between --val-fraction's training and validation",
                 **{key: f"training images of mean {old[key]} then, {new[key]} now"
                    for key in differ if key.startswith("train_mean")}}

        def images(of):  # a fingerprint's
            return f"{of['train_images']} {'--synthetic ' if of['synthetic'] else ''}training images"

        counts = (f"{images(new)}, as then" if images(old) == images(new) else
                  f"{images(old)} then, {images(new)} now")
        raise UserError(f"the checkpoint was trained on other data ({counts}"
                        + "".join(f"; {other[key]}" for key in other if key in differ) + "): resume on the data it "
                        "was trained on, or start a new run in another --checkpoint-dir")
    # Other data before the model's shape: a class folder added makes the model's head another size.
    check_fits(checkpoint["model"], "the checkpoint")
    saved_class, now = checkpoint.get("optimizer_class", "SGD"), type(optimizer).__name__
    if saved_class != now and saved["optimizer"] != flags["optimizer"]:
        raise UserError(f"the checkpoint was trained with the optimizer {saved_class}, this run builds {now} "
                        f"(--optimizer {flags['optimizer']}, recipe.py): its state would not fit; resume with "
                        f"--optimizer {saved['optimizer']}, or start a new run in another --checkpoint-dir")
    check_resume_flags(saved, flags, recipe_flags)
    edited = recipe_edits(checkpoint, {"optimizer": now, "LR scheduler": scheduler_source(scheduler_class),
                                       **(recipe_code or {})})
    if edited:
        raise UserError("--resume needs the checkpoint's recipe, but recipe.py made another since: its "
                        + ", ".join(edited) + "; restore recipe.py as it was, or start a new run in another "
                        "--checkpoint-dir (--weights takes the checkpoint's model)")


def class_change(old, new):
    """A data set's classes then (``old``) and now (``new``), in words: '4 classes then, 5 now
    (class_9 added)'; None when either is unknown."""
    if old is None or new is None:
        return None
    added, removed = [c for c in new if c not in old], [c for c in old if c not in new]
    if not added and not removed:
        return "the same classes in another order"

    def named(names, what):
        return f"{', '.join(names[:3])}{' and others' if len(names) > 3 else ''} {what}" if names else None
    changes = "; ".join(filter(None, (named(added, "added"), named(removed, "removed"))))
    return f"{len(old)} classes then, {len(new)} now ({changes})"


def other_data_set(trained_on, now, given):
    """The refusal of a resume on --dataset ``now`` from a checkpoint trained on ``trained_on``
    (``given``: that run's --dataset as it was typed, to give again)."""
    return UserError(f"the checkpoint was trained on --dataset {trained_on}, this run is --dataset {now}; resume "
                     f"with --dataset {given}, or start a new run in another --checkpoint-dir")


def recipe_edits(checkpoint, now):
    """Every difference, in words, between what recipe.py's code made of the checkpoint's run
    and of this one (``now``: "optimizer", "LR scheduler" and Run.recipe_code's entries, by
    name), so that one refusal names them all. A checkpoint older than a record has none."""
    saved = {"optimizer": checkpoint.get("optimizer_class", "SGD"),
             "LR scheduler": scheduler_source(checkpoint.get("scheduler_class", "LambdaLR")),
             **(checkpoint.get("recipe_code") or {})}
    return [f"{what} {saved[what]} (now {value})" for what, value in now.items()
            if what in saved and saved[what] != value]


def scheduler_source(name):
    """An LR scheduler's class ``name`` and where it comes from: LambdaLR is lr_factor's,
    as recipe.make_scheduler returns None; any other class is make_scheduler's own."""
    return "lr_factor's LambdaLR" if name == "LambdaLR" else f"recipe.make_scheduler's {name}"


# Checkpoints written before --model-ema's defaults followed the run's length recorded the old
# defaults filled in: such a run, resumed without those flags, goes on (with the derived ones).
FILLED_IN_BEFORE = {"model_ema_decay": 0.99, "model_ema_steps": 32}


def recorded_accuracy(path, run=None):
    """The validation accuracy a weights file of keep_best records, -1 when there is none.
    ``run``: this run's {"model": key, "dataset": key}; a file that records another model or
    data set is another run's (--resume=auto in someone else's folder) and is refused: this
    run's best epoch would replace it, or be taken for it. So is a file keep_best cannot have
    written (it writes atomically, with the accuracy): a user's own weights, or any file."""
    if not path.exists():
        return -1.0
    keep = ("; this run keeps its best epoch's weights under that name: move it elsewhere, or give this run another "
            "--checkpoint-dir")
    try:
        metadata = read_weights(path, BEST_WEIGHTS, mmap=True).metadata
    except UserError as err:  # not weights (keep_best writes atomically), or a file the OS will not let us read
        why = str(err).removeprefix(f"{BEST_WEIGHTS} {path} ")
        raise UserError(f"--checkpoint-dir {path.parent}: its {BEST_WEIGHTS} {why}{keep}") from None
    accuracy = metadata.get("val_accuracy")
    if not isinstance(accuracy, (int, float)):
        raise UserError(f"--checkpoint-dir {path.parent}: its {BEST_WEIGHTS} records no validation accuracy, so no "
                        f"run of these scripts wrote it (your own weights?){keep}")
    theirs = {key: metadata[key] for key in (run or {}) if metadata.get(key) is not None and key != RUN_FLAGS}
    if any(theirs[key] != run[key] for key in theirs):
        raise UserError(f"--checkpoint-dir {path.parent} holds {BEST_WEIGHTS} of another run (--model "
                        f"{metadata.get('model')} on --dataset {metadata.get('dataset')}; this run: --model "
                        f"{run['model']} on --dataset {run['dataset']}): move it elsewhere, or give this run another "
                        "--checkpoint-dir")
    recorded = metadata.get(RUN_FLAGS) if isinstance(metadata.get(RUN_FLAGS), dict) else {}
    changed = [flag_change(name, recorded[name], value) for name, value in ((run or {}).get(RUN_FLAGS) or {}).items()
               if name in recorded and recorded[name] != value]  # a flag newer than the file: not compared
    if changed:  # a run of these flags killed before its first checkpoint is this one again
        raise UserError(f"--checkpoint-dir {path.parent} holds {BEST_WEIGHTS} of a run of other flags ("
                        f"{', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}), which this run would replace "
                        "or take for its own: move it elsewhere, or give this run another --checkpoint-dir")
    return float(accuracy)


def check_resume_flags(saved, flags, recipe_flags):
    """The part of check_resumable that needs only the checkpoint's flags ``saved`` (defaults
    filled in), against this run's ``flags`` (by name): the recipe's and the other
    run-defining ``recipe_flags``, and --epochs, which may grow but not shrink. Cheap enough
    to run before any data is read (newest_checkpoint)."""
    changed = [flag_change(name, saved.get(name), flags[name])
               for name in recipe_flags if saved.get(name) != flags[name]
               and not (flags[name] is None and FILLED_IN_BEFORE.get(name) == saved.get(name))]
    if flags["epochs"] < saved["epochs"]:
        changed.append(f"--epochs {saved['epochs']} (now {flags['epochs']}: a run can be extended with a larger "
                       "--epochs, not shortened)")
    if changed:
        raise UserError("--resume continues the checkpoint's run, which had " + ", ".join(changed)
                        + "; rerun with its values or start a new --checkpoint-dir"
                        + smaller_steps_hint(saved.get("batch_size"), flags["batch_size"], flags["accumulate"]))


def flag_change(name, then, now):
    """A run-defining flag that differs, in words: --base-lr 0.1 (now 0.2)."""
    return f"--{name.replace('_', '-')} {as_typed(then)} (now {as_typed(now)})"


def as_typed(value):
    """A flag's value in words: 0.9, 32x32, on or off (a switch), not given (None)."""
    if value is None:
        return "not given"
    if isinstance(value, bool):
        return "on" if value else "off"
    return flag_value(value)


class NewestFlags(NamedTuple):
    normalization: dict  # {"mean": (C,), "std": (C,)} the run trained with; {} when none is recorded
    epochs: int          # the run's --epochs, when this run gives none (flags["epochs"] None)


def check_newest_flags(directory, flags, defaults, recipe_flags):
    """--resume, before any data is read or decoded: check_resume_flags of the newest
    checkpoint in ``directory`` that reads (``defaults``: every flag's, for a checkpoint older
    than a flag); nothing to check when none reads. Returns NewestFlags: the normalization the
    resumed run keeps, whatever its loader would measure, and its --epochs: those of the
    checkpoint's run when --epochs is not given (flags.parse_args made it None), so that a resume
    continues the run rather than extending it to the default's 100. Call on global rank 0."""
    saved = newest_checkpoint(directory)
    if saved is None:
        return NewestFlags({}, flags["epochs"] or defaults["epochs"])
    trained = {**defaults, **saved["args"]}
    flags = {**flags, "epochs": flags["epochs"] or trained["epochs"]}
    trained_on = trained["dataset"]
    built_in = {*DATASETS, FOLDER}  # a FILE.py:NAME may be named two ways; check_resumable compares it
    if trained_on != flags["dataset"] and {trained_on, flags["dataset"]} <= built_in:  # before a download
        raise other_data_set(trained_on, flags["dataset"], trained_on)
    check_resume_flags(trained, flags, recipe_flags)
    task = saved.get("task") or {}
    return NewestFlags({key: tuple(task[key]) for key in ("mean", "std") if key in task}, flags["epochs"])


def newest_checkpoint(directory):
    """The newest checkpoint in ``directory`` that reads, memory-mapped (its tensors are not
    read), or None. For the early check of a resume; choose_checkpoint, later, sets aside the
    unreadable ones and says so."""
    for path in checkpoint_paths(directory):
        try:
            return read_checkpoint(path)
        except Exception:  # unreadable, or not a checkpoint: choose_checkpoint's to report
            continue
    return None


def smaller_steps_hint(saved_batch, batch, accumulate):
    """A resume with a smaller --batch-size is usually a step that no longer fits in memory:
    the same global batch in smaller micro-batches (--accumulate) keeps the recipe."""
    if not saved_batch or batch >= saved_batch or saved_batch % batch:
        return ""
    return (f"; for smaller steps of the same recipe, resume with --batch-size {saved_batch} --accumulate "
            f"{accumulate * saved_batch // batch}")


def folder_identity(directory):
    """{"path", "device", "inode"} of the checkpoint folder ``directory``, recorded in each
    checkpoint, so that a resume can tell a copy of the folder from the folder moved or seen
    under another path (forked_run_id); None when it cannot be read (the checkpoint's own
    write then says why)."""
    try:
        folder = Path(directory).resolve()
        stat = folder.stat()
        return {"path": str(folder), "device": stat.st_dev, "inode": stat.st_ino}
    except OSError:
        return None


def forked_run_id(written_in, directory, run_id):
    """The run ID that a run resumed in ``directory`` from a checkpoint ``written_in``
    (folder_identity; None for checkpoints before it was recorded) of run ``run_id`` goes on
    as: None for the same run, else a copy of the folder, which goes on as a run of its own so
    that it drops no line of the original's from a shared --metrics-file.

    The same run: the same path, or the same folder under another path (moved within its file
    system: the same device and inode; a link, or another node's mount of it, where device
    numbers differ: the folder written in is this one). Anything else is taken for a copy,
    also a folder moved to another file system (a new path and inode): taking a copy for the
    same run would drop the original's lines, while the other mistake only shows a moved run's
    earlier epochs under two IDs. Its ID is derived from the original's and the copy's path
    and inode (not its device, which nodes may number otherwise), so every attempt of the
    copy's resume agrees, and no other folder's does. Not told apart: a folder that reuses the
    inode of a deleted original on its file system (a backup restored) is taken for it."""
    here = folder_identity(directory)
    if not written_in or not here or here["path"] == written_in["path"]:
        return None
    if (written_in.get("device"), written_in["inode"]) == (here["device"], here["inode"]):
        return None
    try:
        if Path(written_in["path"]).samefile(directory):
            return None
    except OSError:  # gone, moved away or not mounted here: this folder is another one
        pass
    return hashlib.sha256(f"{run_id} {here['path']} {here['inode']}".encode()).hexdigest()[:12]


def restore(checkpoint, module, optimizer, scheduler, scaler, ctx, ema=None):
    """Load model, optimizer, schedule, scaler and the model's moving average ``ema`` (an
    AveragedModel, or None) from ``checkpoint``; returns this rank's RNG states (None when it
    was saved at an epoch boundary or by another number of ranks). Where the run was, the
    loop's TrainState, is ``checkpoint["state"]``, as ``save`` wrote it."""
    module.load_state_dict(checkpoint["model"])
    if ema is not None:
        ema.module.load_state_dict(checkpoint[MODEL_EMA])
        ema.n_averaged.fill_(checkpoint["model_ema_updates"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    scaler.load_state_dict(checkpoint["scaler"])
    rng = checkpoint["rng"]
    return rng[ctx.rank] if rng and len(rng) == ctx.world_size else None


def remove_partial_writes(directory):
    """Remove the temporary files of the folder's own names (atomic_save's .NAME.tmpPID of a
    checkpoint or BEST_WEIGHTS) that a killed save left: SIGKILL during a stop checkpoint that
    outlasted the grace, a node that crashed. They are never completed, each as large as a
    checkpoint, and only the run that holds the folder (claimed_folder) writes those names.
    Returns the line that says so (none when there were none). Call on global rank 0."""
    partial = sorted({*directory.glob(f".{CHECKPOINT_PREFIX}*.pt.tmp*"), *directory.glob(f".{BEST_WEIGHTS}.tmp*")})
    removed, size = [], 0
    for path in partial:
        try:
            size += path.stat().st_size
            path.unlink()
        except FileNotFoundError:  # removed meanwhile
            continue
        removed.append(path.name)
    if not removed:
        return []
    return [f"Removed {count(len(removed), 'partial file', 'partial files')} ({size_text(size)}) that a killed save "
            f"left in {directory}: {', '.join(removed)}"]


ARCHIVED_TRACE_PREFIX = "rank_"  # an earlier hang's dump, moved: torchfrtrace DIR -p nccl_trace_rank_ skips it


def keep_earlier_traces(directory):
    """Move the NCCL flight-recorder dumps (FLIGHT_RECORDER_PREFIX + rank) that a hang of an
    earlier run of the folder left into a folder of their own, DIR/nccl_traces-DATE-TIME (the
    newest dump's time; -2, -3 when taken), as rank_N: a hang of this run dumps under the
    same names, which would overwrite them, and torchfrtrace finds a prefix anywhere in a name
    below the folder it reads. Returns the lines that say so (none when there were none); a
    file system that refuses is a warning, never the end of the run. Call on global rank 0,
    as the run starts: a dump of its own comes only after a collective timed out."""
    try:
        dumps = {path: path.stat().st_mtime for path in sorted(directory.glob(f"{FLIGHT_RECORDER_PREFIX}*"))
                 if path.is_file()}
        if not dumps:
            return []
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(dumps.values())))
        for n in itertools.count(1):
            folder = directory / f"nccl_traces-{stamp}{f'-{n}' if n > 1 else ''}"
            try:
                folder.mkdir()
                break
            except FileExistsError:
                continue
    except OSError as err:  # a dump removed meanwhile, a folder this user may not write in
        return [f"WARNING: the NCCL flight-recorder dumps of an earlier hang stay in {directory} "
                f"({err.strerror or err}): a hang of this run would overwrite them"]
    moved, stayed = [], []
    for path in dumps:
        try:
            path.rename(folder / f"{ARCHIVED_TRACE_PREFIX}{path.name.removeprefix(FLIGHT_RECORDER_PREFIX)}")
            moved.append(path.name)
        except OSError:
            stayed.append(path.name)
    return ([f"Moved the NCCL flight-recorder dumps of an earlier hang ({', '.join(moved)}) to {folder}, where this "
             f"run's cannot overwrite them; read them with torchfrtrace {folder}"] if moved else []) + (
        [f"WARNING: could not move {', '.join(stayed)} out of {directory}: a hang of this run would overwrite them"]
        if stayed else [])


# After a signal, torchrun (fixed in 2.7; 2.14 has --shutdown-timeout) and Slurm's KillWait
# (30 s by default) give the ranks 30 s before SIGKILL. A checkpoint that takes most of that
# may be cut short after a signal (the previous one stays: the writes are atomic): a warning
# says so, once.
SIGNAL_GRACE_S = 30
SLOW_CHECKPOINT_S = 20


class Checkpointer:
    """Writes one run's checkpoints into its folder: global rank 0 writes, every rank waits
    for the file (so none exits while it is written). Records how often and how long, and
    warns once through ``warn`` when one takes so long that a stop signal could cut it.
    ``flags``: the run's command line, by name, recorded in each checkpoint (what a resume checks);
    ``defining``: the names of those that make the run what it is (train_utils.resume_rules),
    recorded in BEST_WEIGHTS too; ``new_run``: {"model": key, "dataset": key} of a run that
    starts in the folder (None: it continues the run there, whose checkpoint says what it is):
    another run's BEST_WEIGHTS, of another model, data set or ``defining`` flag, is refused."""

    def __init__(self, directory, interval_minutes, ctx, flags, warn=print, new_run=None, defining=()):
        self.directory = Path(directory)
        self.flags = flags
        self.run_flags = {name: flags[name] for name in defining}
        self.interval_s = interval_minutes * 60
        self.ctx = ctx
        self.warn = warn
        self.warned = False
        self.last_time = time.monotonic()
        self.newest = None  # (optimizer step, epoch, step in it) of the newest checkpoint written or loaded
        self.count, self.seconds = 0, 0.0
        # The validation accuracy of the weights in BEST_WEIGHTS: a file left by this run before a
        # kill (or a requeued job's first attempt) is replaced only by better weights.
        new_run = new_run and {**new_run, RUN_FLAGS: self.run_flags}
        self.best = from_rank0(lambda: recorded_accuracy(self.directory / BEST_WEIGHTS, new_run), ctx.control_group)
        for line in from_rank0(lambda: remove_partial_writes(self.directory) + keep_earlier_traces(self.directory),
                               ctx.control_group):
            warn(line)

    def loaded(self, step, state):
        """The run was resumed from the checkpoint of optimizer step ``step`` at ``state``
        (train_utils.TrainState): not written again."""
        self.newest = (step, state.epoch, state.step)

    def due(self):
        """At the end of an epoch: is a checkpoint due? Decided by rank 0's clock, so every
        rank agrees (a one-element all-reduce on the CPU)."""
        late = time.monotonic() - self.last_time >= self.interval_s
        return any_rank(self.ctx.is_main and late, self.ctx.control_group)

    def save(self, run, state, rng_states=None):
        """Write the checkpoint of the run at ``state`` (train_utils.TrainState) (unless exactly that one was written
        already) and prune this run's older ones, keeping KEEP_CHECKPOINTS. Returns its path."""
        step = run.scheduler.last_epoch  # optimizer steps so far: the name sorts by progress
        path = self.directory / f"{CHECKPOINT_PREFIX}{step:09d}.pt"
        # The epoch too: a run stopped after an epoch's last step and resumed evaluates that epoch
        # at the same optimizer step, and its checkpoint then replaces the stopped one.
        if (step, state.epoch, state.step) == self.newest:
            return path
        start = time.perf_counter()
        last = state.records[-1] if state.records else None
        trained = MODEL_EMA if run.trained(last) is not run.module else "model"  # what a weights file reads of it
        kept = [name for name in state.checkpoints if name != path.name] + [path.name]
        state.checkpoints, pruned = kept[-KEEP_CHECKPOINTS:], kept[:-KEEP_CHECKPOINTS]

        def write():
            try:
                atomic_save({"format": CHECKPOINT_FORMAT, "state": asdict(state), "model": run.module.state_dict(),
                             "optimizer": run.optimizer.state_dict(),
                             "optimizer_class": type(run.optimizer).__name__, "scheduler": run.scheduler.state_dict(),
                             "scheduler_class": type(run.scheduler).__name__, "recipe_code": run.recipe_code(),
                             "scaler": run.scaler.state_dict(), "rng": rng_states, "args": self.flags,
                             "data": run.task.data.fingerprint, "model_key": run.task.model_key,
                             "task": with_model_file(run.weights_metadata(last), path), "trained": trained,
                             "world_size": run.ctx.world_size, "folder": folder_identity(self.directory),
                             "loader": run.task.loader,
                             **({MODEL_EMA: run.ema.module.state_dict(), "model_ema_updates": int(run.ema.n_averaged)}
                                if run.ema else {})}, path, "checkpoint")
            except ResourceProblem as err:
                state.checkpoints = [name for name in kept if (self.directory / name).exists()]  # one it replaced too
                newest = state.checkpoints[-1] if state.checkpoints else None
                raise ResourceProblem(f"{err}; " + (f"the previous checkpoint {self.directory / newest} is kept: "
                                                    "continue from it with --resume once there is space"
                                                    if newest else "no checkpoint of this run is kept")) from None
            for name in pruned:  # only this run's own files, once the new one is on disk
                (self.directory / name).unlink(missing_ok=True)

        from_rank0(write, self.ctx.control_group)  # every rank waits until the file is on disk
        seconds = time.perf_counter() - start
        self.last_time, self.newest = time.monotonic(), (step, state.epoch, state.step)
        self.count, self.seconds = self.count + 1, self.seconds + seconds
        if seconds > SLOW_CHECKPOINT_S and not self.warned and self.ctx.is_main:
            self.warned = True
            self.warn(f"WARNING: checkpoint {path.name} took {seconds:.0f} s to write; after a stop signal "
                      f"(scancel, Ctrl-C through torchrun) processes get {SIGNAL_GRACE_S} s before SIGKILL, so a "
                      "stop checkpoint may be cut (the previous one is kept): stop with --stop-file, which the "
                      "job scripts use, or give --checkpoint-dir a faster disk")
        return path

    def keep_best(self, accuracy, model, metadata):
        """When ``accuracy`` (an epoch's validation) beats the weights in BEST_WEIGHTS, write
        ``model``'s there in their place (global rank 0, atomically; every rank waits, and every
        rank decides alike: the accuracy is all-reduced). One that cannot be written (a full
        disk) is a warning: the run goes on, its checkpoints are what a resume needs, and the file
        keeps what it held, which a later epoch that beats that replaces."""
        if accuracy <= self.best:
            return

        def write():
            try:
                save_weights(model, self.directory / BEST_WEIGHTS, {**metadata, RUN_FLAGS: self.run_flags},
                             BEST_WEIGHTS)
                return accuracy
            except ResourceProblem as err:
                kept = (f"{BEST_WEIGHTS} keeps the earlier weights that validated at {self.best:.4f}"
                        if self.best >= 0 else f"no {BEST_WEIGHTS} is kept")
                self.warn(f"WARNING: {err}; this epoch's weights, the best so far, are not kept ({kept}), training "
                          "goes on")
                return self.best

        self.best = from_rank0(write, self.ctx.control_group)  # what the file holds, on every rank


