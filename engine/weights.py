"""Weights files (--weights, --finetune, --save-weights, predict.py): the plain state_dict,
the guide's layout, with what it was trained on (the model, classes, image size, stored
size, normalization) in its metadata, so that an evaluation or a prediction maps outputs to
the same labels and prepares images the same way (for --eval-only: as_trained,
as_trained_split). A checkpoint serves as a weights file too.
"""

import itertools
import os
import pickle
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from engine.errors import ResourceProblem, UserError
from engine.files import NameTaken, atomic_save
from engine.log import count, flag_value
from engine.task import MODEL_FILE, MODEL_FILE_NEAR, held_out_again, names_sha256

WEIGHTS_METADATA = "task"  # the key of a weights file's metadata (state_dict._metadata[""])
WRITTEN_FROM = "checkpoint_dir"  # in that metadata: the checkpoint folder of the run that wrote it, resolved
MODEL_EMA = "model_ema"  # in a checkpoint of a --model-ema run: the average's state_dict, its weights
# The weights files a checkpoint folder holds: its best epoch's (timm's model_best), and the job scripts' --save-weights.
BEST_WEIGHTS, JOB_WEIGHTS = "model_best.pt", "weights.pt"


class SavedWeights(NamedTuple):
    state: dict     # tensor name -> tensor, DDP's "module." and torch.compile's "_orig_mod." removed
    metadata: dict  # what they were trained on (DataInfo.weights_metadata plus "model"), {} when unknown


def save_weights(model, path, metadata=None, what="--save-weights", new=False):
    """The model's state_dict, written atomically, with ``metadata`` (the data's classes,
    image size, normalization) in its ``_metadata``: torch.load returns it with the tensors,
    and load_state_dict ignores it, so the file loads strictly into the model as the guide's did.
    ``new``: never over a file (files.atomic_save)."""
    state = model.state_dict()
    if metadata is not None:
        state._metadata[""] = {**state._metadata.get("", {}), WEIGHTS_METADATA: with_model_file(metadata, path)}
    atomic_save(state, path, what, new)


def save_trained_weights(model, path, metadata, checkpoint=None, unsaved=None):
    """--save-weights after training, which a full disk must not lose: when ``path`` cannot be
    written, the line says where the model is instead: in the run's final ``checkpoint`` (a
    weights file for --weights and predict.py), or else in a copy written to the first of
    rescue_folders() that takes it. The metadata names the checkpoint folder, whose run may
    replace the file when it continues (check_weights_target). A file that appeared at
    ``path`` during the run (another run's, started alongside) is kept: the weights go beside
    it. Returns the line that says where they went.
    ``unsaved``: the ResourceProblem of a final checkpoint that did not fit (``checkpoint`` is
    then None): the model, trained to the end, must not go with it. It is written all the same,
    to ``path`` or (None: no --save-weights) to a rescue folder, and ``unsaved`` raised with where."""
    folder = Path(checkpoint).parent if checkpoint else None
    if folder:
        metadata = {**metadata, WRITTEN_FROM: str(folder.resolve())}
    problem = unsaved
    if path is not None:
        try:
            written, note = write_new_weights(model, path, metadata, folder)
        except ResourceProblem as err:
            if checkpoint:
                raise ResourceProblem(f"{err}; the trained model is in the final checkpoint {checkpoint} (--weights "
                                      "and predict.py read it as a weights file)") from None
            problem = f"{unsaved}; {err}" if unsaved else err
        else:
            if unsaved:
                raise ResourceProblem(f"{unsaved}; the trained weights were written to {written}{note}") from None
            return f"Model weights written to {written}{note}"
    name = Path(path or JOB_WEIGHTS).name
    for spare in rescue_folders():
        try:
            rescue = save_beside(model, spare / f"{Path(name).stem}-rescued{Path(name).suffix}", metadata,
                                 "the weights")
        except ResourceProblem:
            continue
        raise ResourceProblem(f"{problem}; the trained weights were written to {rescue} instead: move them where "
                              "they belong") from None
    raise ResourceProblem(f"{problem}; no folder of {', '.join(map(str, rescue_folders()))} could take them either: "
                          "the trained model is lost") from None


def write_new_weights(model, path, metadata, folder):
    """save_weights to ``path``, or beside it when it holds another run's file (one that appeared
    during this run; ``folder``: this run's checkpoint folder, whose own file it replaces).
    Returns (the path written, a note on why there)."""
    appeared = f" ({path} appeared during this run, from another run, and is kept)"
    own = os.path.isfile(path) and is_runs_own(path, folder)  # the run continued (check_weights_target let it)
    if os.path.isfile(path) and not own:
        return save_beside(model, Path(path), metadata), appeared
    try:
        save_weights(model, path, metadata, new=not own)
    except NameTaken:  # written by another run since the look above: kept, as there
        return save_beside(model, Path(path), metadata), appeared
    return Path(path), ", in place of this run's earlier ones" if own else ""


def save_beside(model, path, metadata, what="--save-weights"):
    """save_weights to a new file named after ``path`` and the time, NAME-DATE-TIME.pt (-2, -3,
    ... when runs finish in the same second): never over a file. Returns its path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        beside = path.with_name(f"{path.stem}-{stamp}{f'-{n}' if n > 1 else ''}{path.suffix or '.pt'}")
        if beside.exists():
            continue
        try:
            save_weights(model, beside, metadata, what, new=True)
            return beside
        except NameTaken:  # made in between
            continue


def check_weights_target(path, checkpoint_dir, continuing):
    """--save-weights never replaces another run's weights: a file already at ``path`` is
    refused at start, in one line, unless this run continues the run in ``checkpoint_dir``
    whose file it is (is_runs_own). Call on global rank 0, before training."""
    if not path or not os.path.isfile(path):  # a folder is check_writable's line
        return
    if continuing and is_runs_own(path, checkpoint_dir):
        return
    raise UserError(f"--save-weights {path} exists already and is not this run's: choose a new file name, or move "
                    "that file away first; nothing is overwritten")


def is_runs_own(path, checkpoint_dir):
    """Whether the weights file ``path`` is the run's in ``checkpoint_dir``: it lies in that
    folder (the job scripts' DIR/weights.pt, also from before files named their folder), or
    names it (WRITTEN_FROM; samefile: the folder seen through another mount or link)."""
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return False
    if os.path.samefile(Path(path).resolve().parent, checkpoint_dir):
        return True
    recorded = written_from(path)
    return bool(recorded) and os.path.isdir(recorded) and os.path.samefile(recorded, checkpoint_dir)


def written_from(path):
    """The checkpoint folder the weights file ``path`` names as its run's (WRITTEN_FROM), or
    None. Memory-mapped: the tensors are not read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return getattr(state, "_metadata", {}).get("", {}).get(WEIGHTS_METADATA, {}).get(WRITTEN_FROM)
    except Exception:  # not a weights file of these scripts, unreadable: nobody's known
        return None


def rescue_folders():
    """Where weights go when their own path is full: the home folder, then $TMPDIR and the
    system's temporary folder, in that order, without repeats. Home first: a Slurm job's
    $TMPDIR is often node-local scratch that is wiped when the job ends, with the weights."""
    folders = [Path.home(), os.environ.get("TMPDIR"), tempfile.gettempdir()]
    return list(dict.fromkeys(Path(folder) for folder in folders if folder))


def read_weights(path, flag="--weights", mmap=False):
    """SavedWeights of a state_dict file or a checkpoint, read without running any pickled
    code (weights_only). One line, naming ``flag`` and the file, when it is not one.
    ``mmap``: the tensors stay in the file until used (for the metadata alone)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UserError(f"{flag} {path}: no such file", same_on_every_rank=False) from None
    except IsADirectoryError:  # a checkpoint folder, often: the file in it that is meant
        meant = next((Path(path) / name for name in (BEST_WEIGHTS, JOB_WEIGHTS) if (Path(path) / name).is_file()), None)
        raise UserError(f"{flag} {path} is a folder, not a weights file"
                        + (f"; did you mean {meant}?" if meant else ""), same_on_every_rank=False) from None
    except Exception as err:  # not a torch file, truncated, or pickled objects we refuse to run
        if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in str(err):  # weights_only refused a class
            raise UserError(f"{flag} {path} holds pickled Python objects (a whole model saved with "
                            "torch.save(model)?), not a state_dict; save one with torch.save(model.state_dict(), PATH)",
                            same_on_every_rank=False) from None
        if mmap:  # a file of the legacy format (before PyTorch 1.6) cannot be memory-mapped: read it whole
            return read_weights(path, flag)
        if isinstance(err, OSError) and err.strerror:  # the file system's reason: Permission denied, ...
            raise UserError(f"{flag} {path} cannot be read ({err.strerror})", same_on_every_rank=False) from None
        # Not torch.load's error type (a KeyError for a text file, an EOFError for an empty one): it
        # tells a user nothing. An empty file is said as such (a copy or a save that never finished).
        empty = " (it is empty)" if Path(path).stat().st_size == 0 else ""
        raise UserError(f"{flag} {path} is not a readable state_dict: not a file torch.save wrote, or a damaged "
                        f"one{empty}", same_on_every_rank=False) from None
    metadata = {}
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # a checkpoint of train_utils
        metadata = state.get("task") or state.get("data") or {}  # "data": checkpoints before "task" existed
        if "model" not in metadata and state.get("model_key"):
            metadata = {**metadata, "model": state["model_key"]}
        # --model-ema: the average when it validated better ("trained"; checkpoints before it: always)
        state = state.get(state.get("trained", MODEL_EMA)) or state["model"]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise UserError(f"{flag} {path} holds a {type(state).__name__} that is not a state_dict (names -> tensors)")
    metadata = getattr(state, "_metadata", {}).get("", {}).get(WEIGHTS_METADATA, metadata)
    return SavedWeights(_strip_prefixes(state), dict(metadata))


def with_model_file(metadata, path):
    """``metadata`` of a file written to ``path``, with where its --model FILE.py lies relative
    to that file (MODEL_FILE_NEAR): found again when the folder moves as a whole."""
    if not metadata.get(MODEL_FILE):
        return metadata
    near = os.path.relpath(metadata[MODEL_FILE], Path(path).resolve().parent)
    return {**metadata, MODEL_FILE_NEAR: near}


def load_weights(model, path, model_name=None, expected=None, evaluating=False):
    """Load a state_dict file (or the model of a checkpoint) into ``model``. One line when it
    is not one, does not fit ``model``, or was trained on other classes than ``expected``'s
    (naming --finetune, which starts from them with a new head, unless ``evaluating``)."""
    saved = read_weights(path)
    check_classes(saved.metadata.get("classes"), (expected or {}).get("classes"), path, evaluating)
    # After the classes: weights for other classes do not fit the head either, and their names say more.
    check_state_fits(model, saved.state, f"--weights {path}", model_name, finetune_path=None if evaluating else path)
    model.load_state_dict(saved.state)


def check_classes(classes, wanted, path, evaluating=False):
    """One line where the --weights ``path``, trained on ``classes`` (None: not recorded), would
    be read as the labels ``wanted`` (None: unknown) of other classes."""
    # Numbers name the classes of --synthetic, and of the built-in data sets in weights saved before their names were
    # read: only the count can differ then.
    numbered = classes is not None and list(classes) == [str(label) for label in range(len(classes))]
    if classes is None or wanted is None or list(classes) == list(wanted) or (numbered and len(classes) == len(wanted)):
        return
    if len(classes) == len(wanted):
        label = next(i for i, (a, b) in enumerate(zip(classes, wanted)) if a != b)
        detail = f"label {label} is {classes[label]!r} there and {wanted[label]!r} here"
    else:
        detail = f"{len(classes)} classes there, {len(wanted)} here"
    raise UserError(f"--weights {path} were trained on other classes ({detail}): their outputs would be "
                    "read as the wrong labels; use the data set they were trained on"
                    + ("" if evaluating else ", or --finetune to start from them with a new head"))


def check_folder_classes(data_dir, weights):
    """--eval-only on an image folder whose class folders are not the classes the --weights
    record: check_classes' line from the folders' names, before the images are decoded
    (minutes for a large folder, and a cache on disk) to be refused by load_weights."""
    from engine.image_folder import class_folders, split_folders
    try:
        folders, _ = split_folders(Path(data_dir).expanduser(), held_out=True)
        names = class_folders(folders["train"])
    except (UserError, OSError, KeyError):  # no folder, no class folders, mixed layouts: the scan's line says it
        return
    check_classes(read_weights(weights, mmap=True).metadata.get("classes"), names, weights, evaluating=True)


def _strip_prefixes(state):
    """Accept state_dicts saved from a DDP-wrapped or torch.compile'd model too."""
    def clean(key):
        for prefix in ("module.", "_orig_mod."):
            key = key.removeprefix(prefix)
        return key
    return {clean(key): value for key, value in state.items()}


def check_state_fits(model, state, source, model_name=None, finetune_path=None):
    """One clear line instead of load_state_dict's multi-line error for another model shape.
    ``finetune_path``: the file of --weights, named in the line when only the last layers
    differ in shape (weights for other classes: --finetune starts from them with a new head)."""
    own = model.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    reshaped = [k for k in own.keys() & state.keys() if tuple(own[k].shape) != tuple(state[k].shape)]
    if not (missing or unexpected or reshaped):
        return
    order = list(own)
    if finetune_path and not missing and not unexpected and min(map(order.index, reshaped)) > max(
            (order.index(k) for k in own if k not in reshaped), default=-1):
        first = min(reshaped, key=order.index)
        raise UserError(f"{source} does not fit {model_name or type(model).__name__}: its last layers have other "
                        f"shapes ({first} is {tuple(state[first].shape)} there, {tuple(own[first].shape)} here: "
                        f"weights for other classes); to start from them with a new head for your classes, use "
                        f"--finetune {finetune_path} instead of --weights")
    example = sorted(missing or unexpected or reshaped)[0]
    raise UserError(f"{source} does not fit {model_name or type(model).__name__}: "
                    f"{len(missing)} missing, {len(unexpected)} unexpected and {len(reshaped)} "
                    f"differently shaped tensors (e.g. {example}): weights of another --model or --dataset?")


def recorded_model(metadata, weights_path, flag="--weights"):
    """The --model a weights file (or checkpoint) records, as a reference that loads from here:
    its module:NAME, or its FILE.py:NAME where the file was (absolute), else where it is
    relative to the weights file as it was then (the folder moved as a whole). None when the
    file records no model; one line naming --model when the file is in neither place."""
    key, file = metadata.get("model"), metadata.get(MODEL_FILE)
    if not key or not file:
        return key
    name = key.rpartition(":")[2]
    near = Path(weights_path).resolve().parent / metadata.get(MODEL_FILE_NEAR, Path(file).name)
    for candidate in (Path(file), near):
        if candidate.is_file():
            return f"{candidate}:{name}"
    elsewhere = f" (nor at {near})" if near != Path(file) else ""  # the weights beside it: one place to look
    raise UserError(f"{flag} {weights_path} were trained with --model {file}:{name}, which is no longer there"
                    f"{elsewhere}; pass --model path/to/{Path(file).name}:{name}")


# ---------------------------------------------------------------------------------------------
# --eval-only: the images prepared as the weights' training prepared its own, and the images it
# held out found again (dataset_utils.build_data calls these with --eval-only alone).

def trained_preprocessing(prep, trained, weights):
    """(Preprocessing, the start-up block's line) of --eval-only: ``prep`` normalized as the
    --weights file ``weights`` records (``trained``: its metadata) that its training images
    were, after checking that their sizes agree; (``prep``, None) for a file that records none."""
    if "mean" not in trained:
        return prep, None
    stored = tuple(trained.get("stored_size") or trained["image_size"])
    if tuple(trained["image_size"]) != prep.image_shape[:2] or stored != prep.stored:
        raise UserError(f"--weights {weights} were trained on {flag_value(trained['image_size'])} images (stored at "
                        f"{flag_value(stored)}), these are {flag_value(prep.image_shape[:2])} (stored at "
                        f"{flag_value(prep.stored)}): evaluate them on the data they were trained on")
    prep = replace(prep, mean=tuple(trained["mean"]), std=tuple(trained["std"]))
    return prep, (f"Preprocessing: from --weights {weights}: {flag_value(prep.image_shape[:2])} input, stored "
                  f"{flag_value(prep.stored)}, trained with --augment {trained.get('augment', prep.augment)}; "
                  f"normalization mean {prep.mean}, std {prep.std}")


def check_evaluable(data_dir, weights):
    """--eval-only evaluates an image folder's test/: one that holds its class folders directly
    has none, and --val-fraction (the advice to a training run) would evaluate a part of it,
    calling the rest training images. predict.py --labelled evaluates all of it; where it holds,
    by name, the images the --weights held a part of out (the folder they trained on, moved:
    engine/flags.py matched it by path), predict.py --held-out evaluates that part again."""
    from engine.image_folder import FLAT, split_folders
    root = Path(data_dir).expanduser()
    try:
        _, layout = split_folders(root, held_out=True)
    except (UserError, OSError):  # no folder, no class folders, mixed layouts: the scan's line says it
        return
    if layout != FLAT:
        return
    problem = (f"--eval-only evaluates the test/ images of an image folder, and --data-dir {data_dir} holds its class "
               "folders directly")
    record = read_weights(weights, mmap=True).metadata.get("split")
    if record and record.get("names_sha256") == folder_names_sha256(root, record["skipped"]):
        raise UserError(f"{problem}: the images --weights {weights} trained on, of which validation held "
                        f"{record['fraction']:g} out (--val-fraction); python predict.py --weights {weights} "
                        f"--held-out {data_dir} evaluates those again")
    raise UserError(f"{problem}: python predict.py --weights {weights} --labelled {data_dir} gives the accuracy over "
                    "all of its images")


def as_trained(train, test, info, weights):
    """--eval-only: the images normalized as the --weights file's training normalized its own
    (engine/flags.py took --image-size and --augment from the file); the start-up block says so."""
    prep, note = trained_preprocessing(info.prep, read_weights(weights, mmap=True).metadata, weights)
    if note is None:  # a plain state_dict: the data's own normalization
        return train, test, info
    return (train.with_prep(prep), test.with_prep(prep) if test is not None else None,
            replace(info, prep=prep, notes=(*info.notes, note)))


def as_trained_split(train, info, weights):
    """(train, info) of --eval-only on the image folder the --weights were trained on, with the
    split they record (engine/flags.py took its --val-fraction and --seed): the training images
    as training had them, before the split. An image unreadable then and mended since is left out
    again, as predict.py --held-out leaves it out; a folder changed otherwise (images added,
    removed, renamed) is one line, where another split would be evaluated silently, holding out
    images the weights trained on."""
    trained = read_weights(weights, mmap=True).metadata
    record = trained.get("split")
    if not record or info.data_dir is None or trained.get("data_dir") != info.data_dir:
        return train, info
    mended = set(record["skipped"]) - set(info.skipped)
    names = cached_names(info.data_dir, info.skipped) if mended else []
    if mended and len(names) == len(train):  # else the folder changed since the cache: refused below
        keep = [i for i, name in enumerate(names) if name not in mended]
        train = train.subset(keep)
        shown = ", ".join(sorted(mended)[:3]) + (", ..." if len(mended) > 3 else "")
        info = replace(info, skipped=tuple(record["skipped"]), names_sha256=names_sha256(names[i] for i in keep),
                       notes=(*info.notes, f"Left out: {count(len(mended), 'image', 'images')} unreadable in training "
                                           f"and readable now ({shown}), as training had them"))
    held_out_again(train.labels, record, f"--data-dir {info.data_dir}", info.names_sha256)
    return train, info


def folder_names_sha256(root, skipped):
    """names_sha256 of the image folder ``root``'s training images less ``skipped``, or None
    where it cannot be scanned (the scan's own line says why, where the run reads it)."""
    try:
        return names_sha256(cached_names(root, skipped))
    except (UserError, OSError):
        return None


def cached_names(data_dir, skipped):
    """The paths within the image folder ``data_dir`` of its training images in the order the
    cache (or DALI's list) holds them: the folder's scan order, less ``skipped`` (unreadable)."""
    from engine.image_folder import scan
    root, left_out = Path(data_dir), set(skipped)
    names = (str(path.relative_to(root)) for path in scan(root, held_out=True).splits["train"][0])
    return [name for name in names if name not in left_out]
