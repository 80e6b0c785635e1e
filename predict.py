"""Classify images with trained weights: one CSV row per image (path, prediction, its
probability, the top k). Everything comes from the weights file (the model, the classes, the
image size and normalization), so no data set is needed, and images are prepared exactly as
training prepared its test images: the predictions agree with the accuracy it reported.

    python predict.py --weights weights.pt photos/                    # the CSV to stdout (as --output -)
    python predict.py --weights weights.pt photos/ a.jpg --output preds.csv --top-k 5
    python predict.py --weights ckpt/checkpoint_000012500.pt photos/ --output preds.csv   # a checkpoint
    python predict.py --weights weights.pt --held-out my_photos --output val.csv  # validation's images, labelled
    python predict.py --weights weights.pt --held-out my_photos --confusion-matrix confusion.csv   # CSV to stdout
    python predict.py --weights weights.pt --labelled new_photos --output new.csv   # new_photos/CLASS/IMAGE
    python predict.py --weights weights.pt --model moved/my_net.py:Net photos/   # its model file moved
    srun --account=nnXXXXk --gpus=1 --time=00:10:00 python predict.py --weights weights.pt photos/ --output preds.csv

In NVIDIA's container, as singlegpu_job.sh runs python (CONTAINER_PATH there):

    srun --account=nnXXXXk --gpus=1 --time=00:10:00 apptainer exec --nv \\
        /cluster/work/support/container/pytorch_nvidia_25.06_arm64.sif python predict.py --weights weights.pt photos/

Folders are searched recursively for image files (by their ending; hidden files skipped).
An unreadable image is named on stderr and skipped; --output never replaces an existing file
(one that is not a regular file, such as /dev/stdout, a FIFO or a terminal, is written to).
--held-out DIR classifies the images training validated on: those --val-fraction held out of
the image folder DIR (the fraction, seed and unreadable files are recorded in the weights),
or its test/ folder; the CSV gets their true label and the accuracy is printed (the validation
accuracy training printed for weights saved at the end of an epoch, when it validated on all
of them: not under --limit-batches, nor for a mid-epoch checkpoint), then each class's. The confusion
matrix (rows: true class, columns: predicted class, image counts) goes to --confusion-matrix
CSV, by default beside the --output file (val-confusion.csv for val.csv), and a PNG of it
beside that (val-confusion.png) when matplotlib is installed. --labelled DIR does the same for
every image of a folder of class folders (DIR/CLASS/IMAGE) that training never saw: a new test
set, labelled by the folder each image is in, holding all of the weights' classes or some.
"""

import argparse
import csv
import os
import secrets
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from engine.errors import quiet_interrupt

quiet_interrupt()  # Ctrl-C while torch imports (seconds) ends the command without a traceback

import numpy as np
import torch

from engine.cli import OneLineParser, recipe_imported, run_cli

with recipe_imported():  # dataset_utils imports recipe.py: a mistake in it is one line, not a traceback
    from dataset_utils import centre_crop, normalization, normalize
from engine.errors import OutOfMemory, UserError
from engine.files import check_writable
from engine.flags import positive_int
from engine.image_folder import SPLIT_FOLDERS, OneClassFolder, Unreadable, class_files, decode, image_extensions, scan
from engine.log import count
from engine.memory import is_out_of_memory
from engine.models import check_output, make_model
from engine.plugins import load_plugin
from engine.processes import available_cores
from engine.task import held_out_again, names_sha256
from engine.weights import check_state_fits, read_weights, recorded_model

REQUIRED = ("classes", "image_size", "in_channels", "mean", "std")  # metadata a prediction cannot do without
MAX_THREADS = 8  # decoding threads (Pillow releases the GIL)
SHOWN_CLASSES = 5  # the most common predictions in the summary
SHOWN_EMPTY = 10  # classes without images named in the per-class lines
ANNOTATED_CLASSES = 30  # the confusion matrix's picture writes its counts up to this many classes (then unreadable)
MAX_FIGURE_INCHES, FIGURE_DPI = 40, 100  # the picture's side, at most 4000 pixels


class ReaderGone(UserError):
    """stdout's reader (head) closed it: no line, and 141, a tool's status when SIGPIPE ends it."""
    exit_code = 128 + signal.SIGPIPE
    exit_at_once = True  # one process: no rank 0 to wait for

    def __init__(self):
        super().__init__("stdout was closed by its reader", silent=True)


def build_parser():
    # train.py's flags that a user may give here too: one line on why none is needed.
    as_trained = "not needed, each image is prepared as the --weights' training prepared its own (size, crop, colours)"
    parser = OneLineParser(prog="predict.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                           settled={"--image-size": as_trained, "--augment": as_trained,
                                    "--data-dir": "not needed, give the images or folders to classify (or --held-out "
                                                  "DIR)", "--dataset": "not needed, the --weights record the classes"})
    parser.add_argument("paths", nargs="*", metavar="IMAGE_OR_FOLDER",
                        help="image files, and folders searched recursively for image files")
    parser.add_argument("--held-out", metavar="DIR", type=Path,
                        help="instead of IMAGE_OR_FOLDER: the images of the image folder DIR that training validated "
                             "on (held out by --val-fraction, or its test/), with their true label in the CSV, the "
                             "accuracy and each class's printed, and a confusion matrix (--confusion-matrix)")
    parser.add_argument("--labelled", metavar="DIR", type=Path,
                        help="instead of IMAGE_OR_FOLDER: every image of DIR/CLASS/IMAGE, a folder of class folders "
                             "named as the weights' classes (all or some), labelled by its folder; the CSV, accuracy "
                             "and confusion matrix as with --held-out")
    parser.add_argument("--weights", required=True, metavar="FILE",
                        help="a file of train.py --save-weights, or a checkpoint (CHECKPOINT_DIR/checkpoint_*.pt)")
    parser.add_argument("--model", metavar="FILE.py:NAME|module:NAME",
                        help="the network (default: the --model the weights were trained with, as recorded in them)")
    parser.add_argument("--output", metavar="CSV", type=output_path,
                        help="write the CSV to this new file (refused if it exists, unless it is not a regular file: "
                             "/dev/stdout, a FIFO; default, or -: stdout)")
    parser.add_argument("--confusion-matrix", metavar="CSV", type=Path,
                        help="with --held-out or --labelled: write the confusion matrix (a row per true class, a "
                             "column per predicted class, image counts) to this new .csv file, and a PNG of it beside "
                             "with matplotlib (default: beside the --output file, as OUTPUT_STEM-confusion.csv; none "
                             "when the predictions go to stdout)")
    parser.add_argument("--top-k", type=positive_int, default=3, metavar="K",
                        help="classes (with their probability) in the top_k column, capped at the number of "
                        "classes (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=64, metavar="IMAGES",
                        help="images per forward pass (default: %(default)s)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if sum(map(bool, (args.paths, args.held_out, args.labelled))) != 1:
        parser.error("give the images to classify (IMAGE_OR_FOLDER ...), --held-out DIR or --labelled DIR, one of them")
    has_truth = bool(args.held_out or args.labelled)
    if args.confusion_matrix is not None and not has_truth:
        parser.error("--confusion-matrix needs --held-out DIR or --labelled DIR: only their images have a true class "
                     "to compare")
    confusion = confusion_destination(args.output, has_truth, args.confusion_matrix)
    picture = confusion.with_suffix(".png") if confusion is not None and has_matplotlib() else None
    check_outputs(args.output, confusion, picture, defaulted=args.confusion_matrix is None)  # before any work
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warning = None  # about what the accuracy is of
    if args.held_out:
        model, name, meta = load_trained(args.weights, args.model, device)
        images, labels, what = held_out_images(args.held_out, meta, args.weights)
        ignored = None  # the images are named, not searched for
    elif args.labelled:
        root = labelled_folder(args.labelled)  # a wrong path before the model is loaded
        model, name, meta = load_trained(args.weights, args.model, device)
        images, labels, what, ignored = labelled_images(root, meta["classes"])
        warning = trained_here(args.labelled, meta)
    else:
        images, ignored = find_images(args.paths)  # a wrong path before the model is loaded
        model, name, meta = load_trained(args.weights, args.model, device)
        labels, what = None, None
    classes = [shown(c) for c in meta["classes"]]
    scale_shift = normalization(meta["mean"], meta["std"], torch.uint8, device)  # float32 (C,) each
    # decode's resize imports torchvision (1.5 s on a 2-core CPU): before the clock, not in the first batch's
    # threads, so that images/s is the classification's.
    from torchvision.transforms.v2 import functional  # noqa: F401
    counts, unreadable, truths, guesses, start = Counter(), 0, [], [], time.perf_counter()
    with csv_destination(args.output) as out, ThreadPoolExecutor(min(MAX_THREADS, available_cores())) as pool:
        writer = csv.writer(out, lineterminator="\n")
        header = ["path", *(["label"] if labels is not None else []), "prediction", "probability", "top_k"]
        for first, batch, decoded in decoded_batches(pool, images, args.batch_size, meta):
            good = [(first + i, path, pixels) for i, (path, (pixels, _)) in enumerate(zip(batch, decoded))
                    if pixels is not None]
            for path, (_, why) in zip(batch, decoded):
                if why and len(images) == 1:  # the one image asked for: its reason is the error line
                    raise UserError(f"{shown(path)}: not a readable image ({why})")
                if why:
                    unreadable += 1
                    print(f"unreadable, skipped: {shown(path)}: {why}", file=sys.stderr)
            if good:
                try:
                    probs = classify(model, np.stack([pixels for _, _, pixels in good]), meta, scale_shift, device)
                except Exception as err:
                    if not is_out_of_memory(err):
                        raise
                    raise OutOfMemory(f"out of memory classifying {len(good)} images of {meta['image_size']} pixels "
                                      f"on {where_of(device)}; use a smaller --batch-size (now {args.batch_size})"
                                      ) from None
                if not counts:  # the header with the first row: when no image reads, no CSV at all
                    writer.writerow(header)
                for (index, path, _), row in zip(good, probs):
                    label = None if labels is None else classes[int(labels[index])]
                    writer.writerow(csv_row(path, row, classes, args.top_k, label))
                    counts[classes[int(row.argmax())]] += 1
                    if labels is not None:
                        truths.append(int(labels[index]))
                        guesses.append(int(row.argmax()))
        if not counts:  # no CSV of a header alone
            raise UserError(f"none of the {len(images)} image files could be read (listed above)")
    summary = summary_stream(args.output)
    report(summary, counts, unreadable, ignored, where_of(device), time.perf_counter() - start, name, args.output)
    if meta.get("synthetic"):
        print(f"WARNING: --weights {shown(args.weights)} learnt --synthetic data (random images and labels): these "
              "predictions mean nothing", file=summary)
    if labels is not None:
        matrix = confusion_matrix(truths, guesses, len(classes))
        correct, total = int(np.trace(matrix)), int(matrix.sum())
        left_out = f", {count(unreadable, 'unreadable one', 'unreadable ones')} left out" if unreadable else ""
        print(f"Accuracy: {correct / total:.4f} ({correct} of {total}) on {what}{left_out}", file=summary)
        if warning:
            print(warning, file=summary)
        for line in per_class_lines(matrix, classes):
            print(line, file=summary)
        print(write_confusion(matrix, classes, confusion, picture, args.output), file=summary)
    if any(getattr(stream, "left", False) for stream in (out, summary)):  # every file asked for is written:
        raise ReaderGone()  # now the quiet end of a closed pipe


def held_out_images(root, meta, weights):
    """(files, labels, what they are) of the images training validated on in the image folder
    ``root``: those --val-fraction held out (meta's split: fraction, seed, the unreadable files
    left out before the split), or the folder's test/ (val/) images."""
    if meta.get("dataset") != "folder":
        raise UserError(f"--held-out reads an image folder; --weights {shown(weights)} were trained on --dataset "
                        f"{meta.get('dataset', 'of unknown name')}")
    record = meta.get("split")
    try:
        scanned = scan(root, held_out=True, flag="--held-out")
    except OneClassFolder as err:  # the scan's advice is for training ("add a folder for each other class")
        if err.meant:  # "did you mean --held-out DIR/photos?": the folder one level down
            raise
        classes = meta["classes"]
        names = ", ".join(map(shown, classes[:5])) + (", ..." if len(classes) > 5 else "")
        raise UserError(f"--held-out {shown(root)} holds 1 class folder ({shown(err.name)}): not the folder --weights "
                        f"{shown(weights)} were trained on, of {len(classes)} classes ({names}); --held-out takes "
                        "that folder") from None
    if list(scanned.classes) != list(meta["classes"]):
        raise UserError(f"--held-out {shown(root)} has the classes {', '.join(map(shown, scanned.classes[:5]))}"
                        f"{', ...' if len(scanned.classes) > 5 else ''}, not those --weights {shown(weights)} were "
                        "trained on: another folder?")
    if record is None:
        if "test" not in scanned.splits:
            inside = Path(root).name in (*SPLIT_FOLDERS["train"], *SPLIT_FOLDERS["test"])  # my_images/test itself
            raise UserError(f"--weights {shown(weights)} were validated on a test/ (or val/) folder, and "
                            f"--held-out {shown(root)} has none"
                            + (f"; did you mean --held-out {shown(Path(root).parent)}?" if inside else ""))
        files, labels = scanned.splits["test"]
        return files, labels, f"the {count(len(files), 'test image', 'test images')} of {shown(root)}"
    files, labels = scanned.splits["train"]
    base, skipped = Path(root).expanduser(), set(record["skipped"])  # unreadable: left out before the split
    readable = np.asarray([str(path.relative_to(base)) not in skipped for path in files], dtype=bool)
    files, labels = [path for path, ok in zip(files, readable) if ok], labels[readable]
    names = names_sha256(path.relative_to(base) for path in files)
    held = held_out_again(labels, record, f"--held-out {shown(root)}", names)
    if not len(held):  # weights of a training that validated on nothing (refused since): every class of one image
        raise UserError(f"--held-out {shown(root)}: the --val-fraction {record['fraction']:g} of --weights "
                        f"{shown(weights)} held out no image (each class had a single one, kept for training)")
    return ([files[i] for i in held], labels[held], f"the {len(held)} images --val-fraction {record['fraction']:g} "
            f"(--seed {record['seed']}) held out of {shown(root)}")


def labelled_folder(path):
    """--labelled ``path`` as a Path, or one line when it is no folder."""
    root = Path(path).expanduser()
    try:
        if not root.is_dir():
            raise UserError(f"--labelled {shown(root)}: {'a file, not a folder' if root.exists() else 'no such folder'}")
    except OSError as err:  # a parent folder that cannot be searched
        raise UserError(f"--labelled {shown(root)}: {err.strerror or err}") from None
    return root


def labelled_images(root, classes):
    """(files, labels, what they are, files that are not images) of every image in the class
    folders of the folder ``root`` (ROOT/CLASS/IMAGE, searched recursively), each labelled by
    its folder's index among ``classes`` (the weights'); folders of some of those classes are
    enough."""
    try:
        entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
        folders, strays = [p for p in entries if p.is_dir()], [p for p in entries if not p.is_dir()]
        index = {name: i for i, name in enumerate(classes)}
        unknown = [p.name for p in folders if p.name not in index]
        if unknown:
            # A data set's splits: its test images, when their class folders are the weights' classes.
            splits = [n for n in ("test", "val", "train") if n in unknown and {
                p.name for p in (root / n).iterdir() if p.is_dir() and not p.name.startswith(".")} <= index.keys()]
            hint = (f"; did you mean --labelled {shown(root / splits[0])}?" if splits else
                    f" ({', '.join(map(shown, classes[:10]))}{', ...' if len(classes) > 10 else ''})")
            raise UserError(f"--labelled {shown(root)}: {', '.join(map(shown, unknown[:5]))}"
                            f"{', ...' if len(unknown) > 5 else ''} {'is' if len(unknown) == 1 else 'are'} not among "
                            f"the {len(classes)} classes the weights were trained on{hint}")
        extensions = image_extensions()
        images = [p for p in strays if p.suffix.lower() in extensions]  # a README or Thumbs.db beside: ignored
        if images and not folders:  # a class folder itself, or a folder of unlabelled images
            hint = (f"it is class {shown(root.name)}'s folder: give the folder above it, --labelled "
                    f"{shown(root.parent)}" if root.name in index else
                    f"to classify them without labels, give the folder itself: predict.py ... {shown(root)}")
            raise UserError(f"--labelled {shown(root)} holds images ({shown(images[0].name)}, ...) but no class folders "
                            f"(ROOT/CLASS/IMAGE: an image's label is the folder it is in); {hint}")
        if images:
            raise UserError(f"--labelled {shown(root)} holds {shown(images[0].name)} beside its class folders: an "
                            "image's label is the class folder it is in (ROOT/CLASS/IMAGE); move it into one")
        files, labels, ignored = [], [], len(strays)
        for folder in folders:
            found, others = class_files(folder, extensions)
            files += found
            labels += [index[folder.name]] * len(found)
            ignored += len(others)
    except OSError as err:
        raise UserError(f"--labelled: cannot read {shown(err.filename or root)} ({err.strerror or err})") from None
    if not files:
        raise UserError(f"--labelled {shown(root)} holds no image files in class folders (ROOT/CLASS/IMAGE)")
    what = (f"the {count(len(files), 'labelled image', 'labelled images')} of {shown(root)} "
            f"({len(set(labels))} of the {len(classes)} classes)")
    return files, np.asarray(labels, dtype=np.int64), what, ignored


def trained_here(root, meta):
    """The warning under the accuracy when the --labelled folder ``root`` holds the images the
    weights were trained on (the image folder they record, or its train/), else None."""
    folder = meta.get("data_dir")
    if meta.get("dataset") != "folder" or not folder:
        return None
    if os.path.realpath(Path(root).expanduser()) not in (folder, os.path.join(folder, "train")):
        return None
    return (f"WARNING: the weights were trained on images of {shown(root)}, so this is no validation accuracy "
            f"(--held-out {shown(folder)} classifies the images its training validated on)")


def where_of(device):
    return f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"


def shown(path):
    """A path or name for the CSV and messages: file names that are not UTF-8 (Linux gives them
    with surrogate escapes) shown with backslash escapes (caf\\xe9.png) instead of failing."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def output_path(value):
    """--output's value: ``-`` is stdout (None, as without --output), anything else a file's
    path; a folder's (new/, which Path would read as the file new) is refused."""
    if value == "-":
        return None
    if value.endswith(("/", os.sep)) or os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value} names a folder: name the CSV file in it, e.g. "
                                         f"{os.path.join(value, 'predictions.csv')}")
    return Path(value)


def is_stream(path):
    """Whether ``path`` exists and is neither a regular file nor a folder: /dev/stdout, a FIFO,
    a terminal, /dev/null. It holds nothing that writing could replace, so it is written to as
    it is (and nothing is put beside it)."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def is_stdout(path):
    """Whether ``path`` is the file stdout writes to (/dev/stdout, the terminal stdout is)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):  # stdout closed, or replaced by an object without a file (pytest's capsys)
        return False


def summary_stream(output):
    """stderr when the CSV goes to stdout (no --output, --output -, /dev/stdout): the summary
    must not end up among its rows; stdout otherwise (whose reader may leave: LeavingReader)."""
    return sys.stderr if output is None or is_stdout(output) else LeavingReader(sys.stdout)


def confusion_destination(output, has_truth, given):
    """Where the confusion matrix's CSV goes: --confusion-matrix, else beside an --output file
    (OUTPUT_STEM-confusion.csv), else nowhere (only --held-out and --labelled images have true
    classes; stdout and streams have no folder to put it in)."""
    if given is not None or not has_truth or output is None or is_stream(output):
        return given
    return output.with_name(f"{output.stem}-confusion.csv")


def check_outputs(output, confusion, picture, defaulted):
    """Every file predict.py will write, checked before any work: new files (nothing a user
    wrote is ever replaced) in folders that can be written, no two of them the same; an
    --output that is a stream (is_stream) must be writable."""
    if output is not None and is_stream(output):
        if not os.access(output, os.W_OK):
            raise UserError(f"--output {shown(output)}: cannot write it (permission denied)")
    elif output is not None:
        check_new_output(output)
    if confusion is None:
        return
    what = f"--confusion-matrix {shown(confusion)}"
    if defaulted:  # a file the user did not name: say where its name came from
        what += f" (the default, beside --output {shown(output)})"
    if str(confusion) == "-":
        raise UserError("--confusion-matrix needs a file name, not - (stdout)")
    if confusion.suffix.lower() != ".csv":  # its picture's name is derived from it
        raise UserError(f"{what}: name the CSV file (FILE.csv); its picture is written beside it as FILE.png")
    named = [("--output", output), (what, confusion), (f"the picture beside {what}", picture)]
    named = [(flag, os.path.abspath(path)) for flag, path in named if path is not None]
    for i, (flag, path) in enumerate(named):
        for other, same in named[i + 1:]:
            if path == same:
                raise UserError(f"{other} and {flag} would be the same file ({shown(path)}); choose other names")
    check_new_output(confusion, what, "--confusion-matrix")
    if picture is not None:
        check_new_output(picture, f"{shown(picture)}, the picture beside {what},", "--confusion-matrix")


def check_new_output(path, what=None, flag="--output"):
    """``path`` must name a new file in a folder that can be written: nothing a user wrote is
    ever replaced. ``what``: how the error line names it (default: FLAG PATH)."""
    what = what or f"{flag} {shown(path)}"
    if os.path.lexists(path):
        # /dev/stdout with stdout redirected to a file: that file, refused like any other; say how to get stdout
        hint = ("; leave out --output (or give --output -) to write to stdout"
                if flag == "--output" and is_stdout(path) else "")
        raise UserError(f"{what} exists already; choose a new file name (nothing is overwritten){hint}")
    check_writable(path, flag)


def find_images(paths):
    """(image files, number of other files ignored): files as given, folders searched
    recursively (sorted, hidden ones skipped, images by their ending)."""
    extensions, images, ignored = image_extensions(), [], 0
    for given in paths:
        path = Path(given)
        if not os.path.exists(path):
            raise UserError(f"{shown(given)}: no such file or folder")
        if not path.is_dir():
            images.append(path)
            continue
        try:
            found, others = class_files(path, extensions)
        except OSError as err:
            raise UserError(f"cannot read {shown(err.filename or given)} ({err.strerror or err})") from None
        images += found
        ignored += len(others)
    if not images:
        raise UserError(f"no image files in {', '.join(map(shown, paths))} (image files end in "
                        f"{', '.join(sorted(extensions)[:6])}, ...; "
                        f"{count(ignored, 'other file', 'other files')} ignored)")
    unique = {}  # a file named twice (a folder and a file in it, ./a.png and a.png) is classified once
    for image in images:
        unique.setdefault(os.path.realpath(image), image)
    return list(unique.values()), ignored


def load_trained(path, model_ref, device):
    """(model in eval mode on ``device``, its name, the weights' metadata)."""
    saved = read_weights(path, "--weights")
    meta = saved.metadata
    missing = [key for key in REQUIRED if key not in meta]
    if missing:
        raise UserError(f"--weights {shown(path)} does not record {', '.join(missing)} (a plain state_dict, saved "
                        "by other code?): predict.py needs weights saved by train.py --save-weights, or a checkpoint "
                        "of train.py")
    classes = list(meta["classes"])
    if len(classes) < 2:  # softmax over one class is 1.0 for every image: predictions that say nothing
        names = f" ({', '.join(map(shown, classes))})" if classes else ""
        raise UserError(f"--weights {shown(path)} were trained on {count(len(classes), 'class', 'classes')}{names}: "
                        "a classifier needs at least two; train again on a folder of class folders (did --data-dir "
                        "point one level too high?)")
    ref = model_ref or recorded_model(meta, path)
    if not ref:
        raise UserError(f"--weights {shown(path)} does not record its --model; pass --model FILE.py:NAME")
    try:
        factory = load_plugin(ref, "--model")
    except UserError as err:
        if model_ref:
            raise
        raise UserError(f"--weights {shown(path)} were trained with --model {ref}, which does not load here: "
                        f"{str(err).removeprefix(f'--model {ref}: ')}; if it is a file, pass --model "
                        f"path/to/{ref.replace(':', '.py:', 1)}") from None
    model, name = make_model(factory, ref, num_classes=len(meta["classes"]), in_channels=meta["in_channels"],
                             image_size=tuple(meta["image_size"]))
    check_output(model, ref, (meta["in_channels"], *meta["image_size"]), len(meta["classes"]),
                 trains=False)  # gives lazy modules their shapes
    check_state_fits(model, saved.state, f"--weights {shown(path)}", name)
    model.load_state_dict(saved.state)
    layout = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    return model.to(device, memory_format=layout).eval(), name, meta


def decoded_batches(pool, images, batch_size, meta):
    """(index of the batch's first image, paths, [read_image of each]) per batch of
    ``batch_size``; the next batch is decoded on the pool's threads while the model
    classifies this one."""
    batches = [images[i:i + batch_size] for i in range(0, len(images), batch_size)]
    ahead = pool.map(lambda path: read_image(path, meta), batches[0])
    for i, batch in enumerate(batches):
        current = ahead
        if i + 1 < len(batches):
            ahead = pool.map(lambda path: read_image(path, meta), batches[i + 1])
        yield i * batch_size, batch, list(current)


def read_image(path, meta):
    """(uint8 (H, W, C) at the stored size, None), or (None, why it cannot be read)."""
    size = tuple(meta.get("stored_size") or meta["image_size"])
    try:
        return decode(path, size, "L" if meta["in_channels"] == 1 else "RGB"), None
    except Unreadable as err:
        return None, err.reason


@torch.no_grad()
def classify(model, pixels, meta, scale_shift, device):
    """Softmax probabilities float32 (B, classes) of uint8 images (B, H, W, C), prepared as
    training prepared its test images: centre crop to the input size, then normalization."""
    images = torch.from_numpy(pixels).to(device)
    images = centre_crop(images, tuple(meta["image_size"]))
    return torch.softmax(model(normalize(images, *scale_shift)).float(), dim=1).cpu()


def csv_row(path, probs, classes, k, label=None):
    """path, (its true label,) prediction, its probability, 'cat 0.912; dog 0.071; bird 0.017'."""
    top = torch.topk(probs, min(k, len(classes)))
    pairs = list(zip(top.indices.tolist(), top.values.tolist()))
    top_k = "; ".join(f"{classes[i]} {p:.3f}" for i, p in pairs)
    return [shown(path), *([label] if label is not None else []), classes[pairs[0][0]], f"{pairs[0][1]:.6f}", top_k]


class LeavingReader:
    """stdout, whose reader may close it before the last row (``predict.py ... | head``): the
    rows after that go nowhere, and the rest of the work is done (--confusion-matrix, the
    summary on stderr); ``left`` says whether the reader left. The end is then quiet
    (ReaderGone), as a Unix tool's is."""

    def __init__(self, stream):
        self.stream, self.left = stream, False

    def write(self, text):
        self._try(self.stream.write, text)
        return len(text)

    def flush(self):
        self._try(self.stream.flush)

    def _try(self, call, *args):
        if self.left:
            return
        try:
            call(*args)
        except BrokenPipeError:
            self.left = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())  # nor an error when Python flushes


@contextmanager
def csv_destination(output, flag="--output"):
    """stdout; ``output`` itself when it is a stream (is_stream: /dev/stdout, a FIFO); or a new
    file, through new_file. ``flag`` names it in error lines."""
    if output is None or is_stdout(output):  # /dev/stdout: a pipe here (check_outputs refused a file)
        out = LeavingReader(sys.stdout)
        yield out
        out.flush()
        return
    if is_stream(output):  # nothing in it to replace, and no folder of files to put a temporary file in
        try:
            with open(output, "w", newline="", encoding="utf-8") as out:
                yield out
        except BrokenPipeError:  # the FIFO's reader went away
            raise UserError(f"{flag} {shown(output)} was closed before every row was written") from None
        return
    with new_file(output, flag) as out:
        yield out


@contextmanager
def new_file(output, flag, binary=False):
    """A temporary file beside ``output``, open for writing, that becomes ``output`` when
    complete (never half-written, never replacing a file that appeared meanwhile)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own (two runs' PIDs may meet on a shared file system), created as the umask says (mkstemp: 0600).
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") if binary else open(tmp, "x", newline="", encoding="utf-8") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, output)  # fails if the file exists: no overwrite
        except FileExistsError:
            raise UserError(f"{flag} {shown(output)} was created by something else meanwhile; not replaced") from None
        except OSError:  # a file system without hard links
            os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def confusion_matrix(truths, guesses, n_classes):
    """int64 (n_classes, n_classes): row i, column j counts the images of true class i predicted
    as class j (the diagonal: those predicted right)."""
    truths, guesses = np.asarray(truths, dtype=np.int64), np.asarray(guesses, dtype=np.int64)
    return np.bincount(truths * n_classes + guesses, minlength=n_classes * n_classes).reshape(n_classes, n_classes)


def per_class_accuracy(matrix):
    """(right, total) int64 (n_classes,) each, per true class, of a confusion_matrix."""
    return np.diagonal(matrix).copy(), matrix.sum(axis=1)


def per_class_lines(matrix, classes):
    """'  cat: 0.9500 (19 of 20)' per class with images, in the classes' order, then one line
    naming those without (a --labelled folder of some of the classes, or none readable):
    the first SHOWN_EMPTY of them, not a line each of 1,000."""
    right, total = per_class_accuracy(matrix)
    lines = [f"  {name}: {r / t:.4f} ({r} of {t})" for name, r, t in zip(classes, right.tolist(), total.tolist()) if t]
    empty = [name for name, t in zip(classes, total.tolist()) if not t]
    if empty:
        more = f", ... ({len(empty)} classes)" if len(empty) > SHOWN_EMPTY else ""
        lines.append(f"  no images: {', '.join(empty[:SHOWN_EMPTY])}{more}")
    return lines


def confusion_rows(matrix, classes):
    """The CSV: a header 'true \\ predicted,CLASS1,...', then a row per true class: its name
    and its counts per predicted class."""
    return [["true \\ predicted", *classes], *([name, *row] for name, row in zip(classes, matrix.tolist()))]


def has_matplotlib():
    """Whether matplotlib imports (the confusion matrix's picture needs it; nothing else does)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_confusion(matrix, classes, path, picture, output):
    """Write the confusion matrix to the new file ``path`` (CSV) and its picture to ``picture``
    (None: matplotlib is missing); returns the summary's line saying what was written."""
    if path is None:
        went = "stdout" if output is None else shown(output)
        return (f"Confusion matrix not written: the predictions went to {went}, with no file to put it beside; "
                "pass --confusion-matrix FILE.csv to write it")
    with csv_destination(path, "--confusion-matrix") as out:
        csv.writer(out, lineterminator="\n").writerows(confusion_rows(matrix, classes))
    if picture is None:
        return (f"Confusion matrix (rows: true class, columns: predicted) written to {shown(path)}; its picture "
                f"({shown(path.with_suffix('.png'))}) was not written: matplotlib is not installed (pip install "
                "matplotlib)")
    plot_confusion(matrix, classes, picture)
    return (f"Confusion matrix (rows: true class, columns: predicted) written to {shown(path)} and, as a picture, "
            f"{shown(picture)}")


def plot_confusion(matrix, classes, path):
    """A PNG of the confusion matrix at the new file ``path``: counts as colours and (up to
    ANNOTATED_CLASSES classes) as numbers, true classes down, predicted across. matplotlib's
    Agg canvas without pyplot: no display needed on a compute node, no backend switched for
    the process, and matplotlib imported only when a picture is drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    n = len(classes)
    side = min(MAX_FIGURE_INCHES, 3 + 0.4 * n)  # room for the names, then a cap: 1000 classes are colours alone
    figure = Figure(figsize=(side + 1.5, side), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(matrix, cmap="Blues", interpolation="nearest")
    figure.colorbar(image, ax=axes, shrink=0.8, label="images").ax.yaxis.set_major_locator(
        MaxNLocator(integer=True))  # counts: no 0.25 images
    axes.set_xticks(range(n), classes, rotation=90, fontsize="small" if n > 10 else None)
    axes.set_yticks(range(n), classes, fontsize="small" if n > 10 else None)
    axes.set(xlabel="predicted class", ylabel="true class", title="Confusion matrix")
    if n <= ANNOTATED_CLASSES:
        dark = matrix.max() / 2  # white numbers on the darker cells
        for (i, j), value in np.ndenumerate(matrix):
            axes.text(j, i, str(value), ha="center", va="center", color="white" if value > dark else "black")
    with new_file(path, "--confusion-matrix", binary=True) as out:
        figure.savefig(out, format="png", dpi=FIGURE_DPI)


def report(out, counts, unreadable, ignored, device, seconds, model_name, output):
    """The summary: what was classified, how fast, what was skipped, what was predicted (``ignored``:
    files that are not images among the folders searched, None when none were)."""
    total = sum(counts.values())
    rate = total / max(seconds, 1e-9)
    shown_rate = f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"  # one image in 2.7 s: 0.37, not 0
    print(f"Classified {count(total, 'image', 'images')} with {model_name} on {device} in {seconds:.1f} s "
          f"({shown_rate} images/s)", file=out)
    others = ("" if ignored is None else
              f"; ignored {count(ignored, 'file that is not an image', 'files that are not images')}")
    print(f"Skipped {count(unreadable, 'unreadable image', 'unreadable images')}"
          f"{' (listed on stderr)' if unreadable else ''}{others}", file=out)
    common = ", ".join(f"{name}: {n}" for name, n in counts.most_common(SHOWN_CLASSES))  # "55: 61", not "55 61"
    more = f" and {len(counts) - SHOWN_CLASSES} more classes" if len(counts) > SHOWN_CLASSES else ""
    print(f"Predicted (images per class): {common}{more}", file=out)
    print(f"Predictions written to {shown(output) if output else 'stdout'}", file=out)


if __name__ == "__main__":
    run_cli(main)
