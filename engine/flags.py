"""The command line of train.py and train_ddp.py: one definition of every flag, with units
and defaults in its help, and the checks that need more than one flag.

The flags fall in groups: run length, recipe, task (--model, --dataset and how its images
are prepared), speed, output, and checkpoints. A bad command line is one line on stderr
(from global rank 0 only) and exit status 2.
"""

import argparse
import math
import os
from pathlib import Path

from engine.cli import OneLineParser
from engine.errors import EXIT_STOPPED, UserError
from engine.log import flag_value
from engine.models import DEFAULT_MODEL
from engine.processes import DEFAULT_COLLECTIVE_TIMEOUT_MIN, NCCL_TIMEOUT_MARGIN_MIN, available_cores
from engine.task import DATASETS

MAX_AUTO_WORKERS = 8
# --num-workers' bound: loader workers (processes; DALI's threads) per CPU core a process may use.
# More than a few per core only queue for the cores, and a slip (1000) started 1000 processes.
MAX_WORKERS_PER_CORE = 4
PRECISIONS = ("auto", "bf16", "fp16", "tf32", "fp32")
LOADERS = ("auto", "device", "torchvision", "dali")
# torch.compile's modes, and auto: engine/compiling.compile_mode chooses by device, DDP and --accumulate.
COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Flags outside the recipe's group that define the run all the same: a resume must keep them.
RUN_DEFINING_FLAGS = ("precision", "seed", "limit_batches", "synthetic", "val_fraction", "freeze_backbone",
                      "image_size")
KEEP_CHECKPOINTS = 2  # a run keeps its newest two checkpoints (engine/checkpoints.Checkpointer prunes the rest)
FOLDER = "folder"  # --dataset folder: an image folder in torchvision's ImageFolder layout


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the docstring's command examples as written and show every default that has a value."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:  # not `in`: 0 == False
            return action.help
        return super()._get_help_string(action)


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
open_fraction = _checked(float, lambda v: 0 < v < 1, "a number between 0 and 1 (exclusive)")


GUIDE_TARGET_ACCURACY = 0.95  # the guide's early stop, the default on its data sets
TARGET_OFF = "off"


def target_accuracy(text):
    """--target-accuracy: a fraction, or 'off'."""
    if text.lower() == TARGET_OFF:
        return TARGET_OFF
    try:
        return fraction(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err}, or {TARGET_OFF}") from None


def plugin_ref(text):
    """FILE.py:NAME or module:NAME, checked for form only (engine/plugins.py imports it). A
    file without :NAME, or a torchvision model's name alone (resnet18), is told the form it
    was meant as."""
    source, _, name = text.rpartition(":")
    if source and name.isidentifier():
        return text
    hint = ""
    if text.removesuffix(":").endswith(".py"):
        hint = f"; add the class or function in it after a colon: {text.removesuffix(':')}:NAME"
    elif text.isidentifier():
        try:  # only here: importing torchvision takes seconds, and a command line that parses needs none of it
            import torchvision.models
            builders = {n.lower(): n for n in torchvision.models.list_models(module=torchvision.models)}
        except ImportError:
            builders = {}
        if text.lower() in builders:
            hint = f"; did you mean torchvision.models:{builders[text.lower()]}?"
    raise argparse.ArgumentTypeError(f"{text!r} is not FILE.py:NAME or module:NAME{hint}")


def dataset_name(text):
    if text in DATASETS or text == FOLDER:
        return text
    if ":" in text:
        return plugin_ref(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a data set: {', '.join(DATASETS)}, {FOLDER} or FILE.py:NAME")


def image_size(text):
    """'64' -> (64, 64); '48x64' -> (48, 64): (height, width) in pixels. Under 8 pixels a
    side is refused: a few pixels hold no shapes to learn, and the networks' strides and pools
    shrink them to nothing."""
    parts = text.lower().split("x")
    if len(parts) in (1, 2) and all(p.isdigit() and int(p) > 0 for p in parts):
        height, width = (int(parts[0]), int(parts[-1]))
        if min(height, width) < 8:
            raise argparse.ArgumentTypeError(f"{text!r} is too small to learn from (under 8 pixels a side); use "
                                             "--image-size 32 or more for photos")
        return height, width
    raise argparse.ArgumentTypeError(f"{text!r} is not a size in pixels (N or HxW, e.g. 64 or 48x64)")


def add_data_arguments(group):
    """Which data, and how an image folder's images are stored: train.py's task group and
    dataset_utils.py's pre-decoding share these definitions, so that a cache pre-decoded with
    train.py's flags is the one it reuses."""
    group.add_argument("--dataset", metavar="NAME", type=dataset_name, default="cifar100",
                       help=f"{', '.join(DATASETS)} (files as torchvision lays them out), {FOLDER} (your images in "
                            "--data-dir, any image Pillow reads), or FILE.py:NAME (NAME(data_dir) returns (train, "
                            "test) data sets of (image (C, H, W), label) with a classes attribute); it sets the "
                            "model's classes and input channels")
    group.add_argument("--data-dir", metavar="DIR", default=None,
                       help="where the data set is: the folder holding cifar-100-python/, cifar-10-batches-py/, "
                            f"FashionMNIST/raw/ or MNIST/raw/ (default: datasets/ beside the scripts); for --dataset "
                            f"{FOLDER} the folder of class folders (DIR/CLASS/IMAGE, with --val-fraction) or of train/ "
                            "and test/ (or val/) holding them; for FILE.py:NAME the argument NAME gets")
    group.add_argument("--val-fraction", metavar="FRACTION", type=open_fraction, default=None,
                       help="hold out this fraction of each class of the training images for validation (e.g. 0.2), "
                            "chosen by the training run's --seed, the same on every rank and after a resume; for data "
                            f"without a test split (a --dataset {FOLDER} of class folders or of train/ alone, a FILE.py:NAME "
                            "returning (train, None)). Its test split, if any, is then not used")
    group.add_argument("--image-size", metavar="PIXELS", type=image_size, default=None,
                       help=f"--dataset {FOLDER}: the model's input size, N or HxW in pixels (images scaled to "
                            "cover, then centre-cropped; stored at 8/7 of it for --augment resized-crop); default: "
                            "the training images' most common size if half of them have it, else the median "
                            "image's by area (7/8 of it for resized-crop)")
    group.add_argument("--cache-dir", metavar="DIR", default=None,
                       help=f"--dataset {FOLDER}: where the images are kept decoded (uint8 .npy files, rebuilt when "
                            "the images change; default: datasets/cache/ beside the scripts)")


def check_data_arguments(args, error):
    """The checks of add_data_arguments' flags that need more than one: ``error(message)``
    exits with one line."""
    if args.dataset == FOLDER and not args.data_dir:
        error(f"--dataset {FOLDER} needs --data-dir DIR, the folder of class folders (DIR/CLASS/IMAGE) or of "
              "train/ and test/ holding them")
    if args.image_size and args.dataset != FOLDER:
        error(f"--image-size applies to --dataset {FOLDER} (the other data sets have one size already)")
    if args.cache_dir and args.dataset != FOLDER:
        error(f"--cache-dir applies to --dataset {FOLDER} (the other data sets are read as they are)")
    workers, cores = getattr(args, "num_workers", None), available_cores()  # dataset_utils.py has no --num-workers
    if workers is not None and workers > MAX_WORKERS_PER_CORE * cores:
        error(f"--num-workers {workers}: more than {MAX_WORKERS_PER_CORE} loader workers for each of the "
              f"{cores} CPU cores this process may use (at most {MAX_WORKERS_PER_CORE * cores}); leave it out for one "
              f"per spare core (at most {MAX_AUTO_WORKERS})")
    if args.cache_dir and args.data_dir and among_images(args.cache_dir, args.data_dir):
        error(f"--cache-dir {args.cache_dir} is inside --data-dir {args.data_dir}: the next run would read the cache "
              "as one more class folder; put it beside the images, not among them")


def among_images(path, data_dir):
    """Whether the folder ``path`` is --data-dir ``data_dir`` or lies inside it, where a scan of
    the image folder would meet it: as written (a link inside it that points elsewhere is still
    met) or with links resolved. Below a hidden name (.ckpt) it is not: the scan skips those."""
    try:
        path, data_dir = Path(path).expanduser(), Path(data_dir).expanduser()
        pairs = ((Path(os.path.abspath(path)), Path(os.path.abspath(data_dir))), (path.resolve(), data_dir.resolve()))
    except (OSError, RuntimeError):  # ~nosuchuser, a name too long: not this check's to say
        return False
    for inside, root in pairs:
        if inside == root or (inside.is_relative_to(root)
                              and not any(part.startswith(".") for part in inside.relative_to(root).parts)):
            return True
    return False


def new_folder(file):
    """The outermost folder that writing ``file`` would create (None: its folder exists)."""
    from engine.files import nearest_existing  # an output file given: check_outputs imports it too
    try:
        folder = Path(file).expanduser().absolute().parent
    except RuntimeError:  # ~nosuchuser: not this check's to say
        return None
    existing = nearest_existing(folder)
    return None if existing == folder else existing / folder.relative_to(existing).parts[0]


def build_parser(description, add_recipe_arguments):
    # No abbreviations: the job scripts find an overriding --checkpoint-dir by its full name.
    parser = OneLineParser(description=description, formatter_class=_Formatter)
    stop = parser.add_argument_group("run length and early stopping")
    stop.add_argument("--epochs", metavar="EPOCHS", type=positive_int, default=100,
                      help="maximum number of passes over the training set (with --resume: the run's own unless "
                           "given)")
    stop.add_argument("--target-accuracy", metavar="FRACTION", type=target_accuracy, default=None,
                      help="stop early once validation accuracy (fraction 0-1; with --model-ema the better of the "
                           "model's and the average's) has been at or above this for --patience consecutive epochs; "
                           f"off = train all --epochs. Default: the guide's {GUIDE_TARGET_ACCURACY:g} on its data "
                           "sets; off on your own data (an image folder, FILE.py:NAME), which runs to --epochs as "
                           "torchvision's references and timm do")
    stop.add_argument("--patience", metavar="EPOCHS", type=positive_int, default=2,
                      help="consecutive epochs (count) at or above --target-accuracy before stopping")

    add_recipe_arguments(parser)  # recipe.py's group: --batch-size, --optimizer, --base-lr, ... --augment
    numerics = parser.add_argument_group("numerics (part of the recipe: a resume keeps it)")
    numerics.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto = bf16 autocast on GPUs that support it, else fp32; fp16 = autocast "
                             "with GradScaler (CUDA only); tf32 = fp32 with TF32 matmuls and convolutions "
                             "(CUDA only); fp32 = strict fp32")

    task = parser.add_argument_group("the task: model and data")
    task.add_argument("--model", metavar="FILE.py:NAME", type=plugin_ref, default=DEFAULT_MODEL,
                      help="the network: NAME in FILE.py (a path, relative to the current directory) or in an "
                           "importable module (module:NAME), a class or function called with num_classes= and "
                           "in_channels= (and image_size=(H, W) when it takes it) that returns an nn.Module mapping "
                           "images (B, C, H, W) to logits (B, classes)")
    add_data_arguments(task)
    task.add_argument("--download", action=argparse.BooleanOptionalAction, default=True,
                      help="download a built-in data set (global rank 0 only) if it is missing")
    task.add_argument("--synthetic", action="store_true",
                      help="random images and labels of a built-in data set's shape and size instead of its files: "
                           "for smoke tests and throughput; accuracy is meaningless")
    task.add_argument("--loader", choices=LOADERS, default="auto",
                      help="device = the data set (uint8) lives on the GPU (or in CPU memory) and is cropped, flipped "
                           "and normalized there in batches, no CPU time per image; torchvision = a DataLoader with "
                           "--num-workers worker processes; dali = NVIDIA DALI reads and decodes an image folder's "
                           "files every epoch (on the GPU; no decoded copy on disk); auto = device when the data set "
                           "fits beside training (a training step measured first) in 85%% of the GPU's memory (on the "
                           "CPU: in a quarter of the node's), else torchvision; on a GPU with DALI installed, dali for "
                           "an image folder whose decoded images exceed a quarter of the GPU's memory")
    task.add_argument("--num-workers", metavar="N", type=non_negative_int, default=None,
                      help="--loader torchvision: worker processes per training process (default: CPU "
                           f"cores per process - 1, at most {MAX_AUTO_WORKERS}); --loader dali: DALI's CPU threads "
                           "per process (default: the same number, at least 1); at most "
                           f"{MAX_WORKERS_PER_CORE} per CPU core the process may use")
    task.add_argument("--seed", metavar="N", type=non_negative_int, default=0,
                      help="seed for weights, shuffling, augmentation and dropout (CPU runs repeat exactly)")

    speed = parser.add_argument_group("speed and memory (no effect on the recipe)")
    speed.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="where to train: auto = this local rank's GPU when PyTorch sees one, else the CPU; cpu = "
                            "the CPU on a GPU node too (the tutorial's --no-cuda; DDP then uses gloo); cuda = a GPU or "
                            "one line. A resume may change it")
    speed.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                       help="keep activations and weights in NHWC memory layout, which GPU tensor-core "
                            "convolutions use (default: on with CUDA, off on the CPU)")
    speed.add_argument("--accumulate", metavar="N", type=positive_int, default=1,
                       help="split each process's share of --batch-size into N micro-batches whose gradients are "
                            "summed before one optimizer step: the same recipe with 1/N of the activation memory (the "
                            "fix for running out of memory; BatchNorm then normalizes each micro-batch). A resume "
                            "may change it")
    speed.add_argument("--compile", action="store_true",
                       help="torch.compile the training model (the first steps then take minutes; the first "
                            "epoch's throughput is reported separately; with --checkpoint-dir the compiled kernels "
                            "are kept in DIR/compile_cache for a resume)")
    speed.add_argument("--compile-mode", metavar="MODE", choices=COMPILE_MODES, default=None,
                       help="--compile: torch.compile's mode, one of " + ", ".join(COMPILE_MODES) + " (default: "
                            "auto = reduce-overhead for one process on CUDA: the compiled forward and backward "
                            "replayed as CUDA graphs, which saves the host launching each kernel; default on the "
                            "CPU, with --accumulate and under DDP; docs/performance.md)")

    run = parser.add_argument_group("run control and output")
    run.add_argument("--limit-batches", metavar="BATCHES", type=positive_int, default=None,
                     help="at most this many training and this many evaluation batches per epoch "
                          "and process (smoke runs, tests)")
    run.add_argument("--log-interval", metavar="SECONDS", type=non_negative_float, default=60.0,
                     help="batch logs (stdout not a terminal, e.g. a Slurm .out file): a progress line at most "
                          "every this many seconds during training and evaluation (0 = none); each line waits "
                          "for the GPU once. On a terminal one line is updated instead")
    run.add_argument("--metrics-file", metavar="PATH", default=None,
                     help="append one JSON line per epoch to this file (global rank 0); a file there already must be "
                          "one of JSON lines (another run's metrics), else it is refused unchanged")
    run.add_argument("--tensorboard", metavar="DIR", default=None,
                     help="write each epoch's losses, accuracy, img/s, LR, times, peak GPU memory, GPU utilization "
                          "and power as TensorBoard scalars to DIR/RUN_ID (global rank 0; a resumed run continues "
                          "its own); needs the tensorboard package")
    run.add_argument("--profile-dir", metavar="DIR", default=None,
                     help="record --profile-steps training steps with torch.profiler after the first --profile-skip "
                          "of each process, write one trace per rank here (Perfetto, chrome://tracing) and print "
                          "the operators that take the most time")
    run.add_argument("--profile-skip", metavar="STEPS", type=positive_int, default=10,
                     help="--profile-dir: training steps of this process before the window (warm-up: cuDNN "
                          "autotuning, torch.compile, loader start-up)")
    run.add_argument("--profile-steps", metavar="STEPS", type=positive_int, default=5,
                     help="--profile-dir: training steps recorded")
    run.add_argument("--weights", metavar="PATH", default=None,
                     help="start from these model weights (a state_dict file, e.g. from the guide's model), "
                          "trained on the same classes")
    run.add_argument("--finetune", metavar="PATH", default=None,
                     help="start from the weights in PATH (a state_dict, e.g. torchvision's ImageNet resnet18, or "
                          "a checkpoint) that fit: every tensor of the same name and shape is loaded, the rest (a "
                          "new classifier head for your classes) starts fresh and is named at start")
    run.add_argument("--freeze-backbone", action="store_true",
                     help="--finetune: train only the new layers; the loaded ones keep their weights (BatchNorm "
                          "statistics still adapt)")
    run.add_argument("--save-weights", metavar="PATH", default=None,
                     help="write the final model's state_dict here (global rank 0, atomically); a file already "
                          "there is refused at start, unless this run continues the run that wrote it")
    run.add_argument("--eval-only", action="store_true",
                     help="evaluate the model of --weights (a state_dict or a checkpoint file) on the test set "
                          "once and exit")

    resilience = parser.add_argument_group("checkpoints and resilience")
    resilience.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                            help="this run's folder: checkpoints are written here (global rank 0, atomically, "
                                 f"keeping this run's newest {KEEP_CHECKPOINTS}); a new run refuses a folder that "
                                 "holds another run's checkpoints")
    resilience.add_argument("--checkpoint-interval", metavar="MINUTES", type=non_negative_float, default=5.0,
                            help="checkpoint at the end of an epoch at most every this many minutes (0 = every "
                                 "epoch); always on a stop request and at the end of training. A crash (kill -9, "
                                 "node failure) loses the training since the last one: up to this many minutes and "
                                 "one epoch")
    resilience.add_argument("--resume", nargs="?", const="required", choices=("required", "auto"), default=None,
                            help="continue the run in --checkpoint-dir from its newest readable checkpoint, on any "
                                 "number of GPUs (same recipe and data; a larger --epochs extends the run with a warm "
                                 "restart of the learning rate); error if there is none (--resume=required says "
                                 "the same). --resume=auto: "
                                 "continue it if there is a checkpoint, else start a new run there (the job scripts)")
    resilience.add_argument("--stop-file", metavar="PATH", default=None,
                            help="stop as on SIGTERM (checkpoint, then exit) when this file appears, but with exit "
                                 f"status 0 (global rank 0 looks about once a second); signals exit with status "
                                 f"{EXIT_STOPPED}. The job scripts use it so that torchrun sees a normal exit")
    resilience.add_argument("--collective-timeout", metavar="MINUTES", type=positive_float,
                            default=DEFAULT_COLLECTIVE_TIMEOUT_MIN,
                            help="DDP: how long a rank waits for the others in a collective (the per-step stop "
                                 "agreement, checkpoints; NCCL's gradient all-reduce gets "
                                 f"{NCCL_TIMEOUT_MARGIN_MIN:g} min more) before every rank stops with one line naming "
                                 "the ranks that stopped responding (a frozen node, a stuck file system). Waits for "
                                 "rank 0's downloads and image decoding are not bounded by it")
    resilience.add_argument("--check-sync-every", metavar="STEPS", type=non_negative_int, default=0,
                            help="DDP: check that all ranks hold identical parameters every this many optimizer "
                                 "steps (0 = once per epoch, before its checkpoint)")
    return parser


def parse_args(parser, check_recipe_arguments, argv=None):
    """Parse and check the command line of ``parser`` (build_parser's); the recipe's own
    checks and derived defaults come from ``check_recipe_arguments(args, error)``."""
    args = parser.parse_args(argv)
    check_recipe_arguments(args, parser.error)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.compile_mode is not None and not args.compile:
        parser.error("--compile-mode applies with --compile")
    if args.compile and args.eval_only:
        parser.error("--compile applies to training; --eval-only evaluates the model uncompiled")
    if args.eval_only and args.weights:
        from engine.weights import read_weights  # --weights only
        adopt_trained_settings(args, given_flags(parser, argv, args), read_weights(args.weights, mmap=True),
                               parser.error)
    check_data_arguments(args, parser.error)
    # A folder the run writes into, or creates for a file it writes, among the images: the next scan
    # meets it as a class folder without any. (A file in a folder already there is ignored, or a Note.)
    if args.dataset == FOLDER and args.data_dir:
        files = {"--metrics-file": args.metrics_file, "--save-weights": None if args.eval_only else args.save_weights}
        written = [(flag, path, path, "") for flag, path in (("--checkpoint-dir", args.checkpoint_dir),
                                                           ("--tensorboard", args.tensorboard),
                                                           ("--profile-dir", args.profile_dir)) if path]
        written += [(flag, path, created, f", in a folder it would create ({created})")
                    for flag, path in files.items() if path and (created := new_folder(path))]
        for flag, path, folder, where in written:
            if among_images(folder, args.data_dir):
                parser.error(f"{flag} {path} is inside --data-dir {args.data_dir}{where}: the next run, its --resume "
                             "too, would scan it with the images (a class folder without any); put it beside the "
                             "images, not among them")
    if args.target_accuracy is None:  # the guide's early stop on the guide's data; your own runs to --epochs
        args.target_accuracy = GUIDE_TARGET_ACCURACY if args.dataset in DATASETS else TARGET_OFF
    args.target_accuracy = None if args.target_accuracy == TARGET_OFF else args.target_accuracy
    if args.synthetic and args.dataset not in DATASETS:
        parser.error(f"--synthetic makes random data of a built-in data set's shape: {', '.join(DATASETS)}")
    if not args.profile_dir:
        for flag in ("profile_skip", "profile_steps"):
            if getattr(args, flag) != parser.get_default(flag):
                parser.error(f"--{flag.replace('_', '-')} applies with --profile-dir DIR")
    if args.tensorboard:
        from engine.tensorboard_log import tensorboard_missing
        if why := tensorboard_missing():  # not a usage mistake: no "see --help"
            raise UserError(why)
    if args.eval_only and not args.weights:
        parser.error("--eval-only needs --weights PATH (a state_dict or a checkpoint file); without it the "
                     "model would be random")
    if args.finetune and (args.weights or args.eval_only):
        parser.error("--finetune starts training from weights with a new head; --weights (and --eval-only) load a "
                     "model whole: give one of them")
    if args.freeze_backbone and not args.finetune:
        parser.error("--freeze-backbone needs --finetune PATH: it freezes the layers loaded from there")
    if args.resume and not args.eval_only and "epochs" not in given_flags(parser, argv, args):
        args.epochs = None  # the run's own, from its checkpoint (checkpoints.check_newest_flags), not 100
    return args


def given_flags(parser, argv, args):
    """The dest names of the flags the command line gives (``args`` is its parse): parsed again
    onto a namespace that already holds a marker for every flag, which argparse then keeps
    for the flags not given."""
    unset = object()
    again = parser.parse_args(argv, argparse.Namespace(**{dest: unset for dest in vars(args)}))
    return {dest for dest, value in vars(again).items() if value is not unset}


TRAINED_SETTINGS = {"image_size": "image size", "augment": "augmentation"}  # adopt_trained_settings' words


def adopt_trained_settings(args, given, saved, error):
    """--eval-only --weights W: the settings W records of its training (engine/task.py's
    weights metadata) for the flags not given: --model, --dataset, --data-dir, --image-size
    and --augment (how images are stored and cropped), and the validation split (--val-fraction,
    --seed) when evaluating on the folder it was held out of. A given flag that contradicts W
    is one line: it would evaluate other images, or these otherwise than validation did."""
    trained, path = saved.metadata, args.weights
    classes = trained.get("classes")
    if classes is not None and len(classes) < 2:  # trained to 100% on a task of one answer
        raise UserError(f"--weights {path} were trained on {len(classes)} class ({', '.join(map(str, classes))}): a "
                        "classifier needs at least two; train again on a folder of class folders (did --data-dir "
                        "name the folder that holds them?)")
    if "model" not in given and trained.get("model"):
        from engine.weights import recorded_model
        args.model = recorded_model(trained, path)
    dataset = trained.get("dataset")
    if "dataset" not in given and dataset:
        if dataset not in DATASETS and dataset != FOLDER:
            error(f"--weights {path} were trained on --dataset {dataset}: give --dataset FILE.py:NAME (and "
                  "--data-dir) to evaluate them")
        args.dataset = dataset
    if classes is not None and args.dataset in DATASETS and len(classes) != DATASETS[args.dataset].num_classes:
        # Known without the data: before a download, or a read, of a data set they cannot be evaluated on.
        error(f"--weights {path} were trained on other classes ({len(classes)} classes there, "
              f"{DATASETS[args.dataset].num_classes} in --dataset {args.dataset}): their outputs would be read as the "
              "wrong labels; use the data set they were trained on")
    same_folder = "data_dir" not in given or (trained.get("data_dir") and os.path.realpath(
        os.path.expanduser(args.data_dir)) == trained["data_dir"])
    if "data_dir" not in given and trained.get("data_dir") and args.dataset == dataset:  # not another data set's
        args.data_dir = trained["data_dir"]
    recorded = {"augment": trained.get("augment")}
    if args.dataset == FOLDER and trained.get("image_size"):
        recorded["image_size"] = tuple(trained["image_size"])
    if same_folder and trained.get("split"):
        recorded.update(val_fraction=trained["split"]["fraction"], seed=trained["split"]["seed"])
    elif same_folder and args.dataset == dataset and "val_fraction" in given and args.val_fraction:
        where = f" of {args.data_dir}" if args.data_dir else ""
        error(f"--val-fraction {args.val_fraction:g}: --weights {path} were trained on all the training images{where} "
              "(no --val-fraction), so none is held out: these would score images the weights trained on; leave it "
              "out to evaluate the test images, or classify images never trained on with predict.py --labelled")
    for name, value in recorded.items():
        if value is None:
            continue
        if name in given and getattr(args, name) != value:
            flag = f"--{name.replace('_', '-')}"
            setting = TRAINED_SETTINGS.get(name, flag)  # the size and augmentation may have been chosen, not given
            error(f"{flag} {flag_value(getattr(args, name))} contradicts --weights {path}, whose training's {setting} "
                  f"was {flag_value(value)}: leave it out, the weights say how their images were prepared"
                  + (" and which were held out" if name in ("val_fraction", "seed") else ""))
        setattr(args, name, value)


def per_process_batch(global_batch, world_size, accumulate=1):
    """Images per process per step; refuses to silently drop part of the global batch, or to
    split it into unequal micro-batches (--accumulate)."""
    if global_batch % world_size:
        lower, upper = global_batch // world_size * world_size, -(-global_batch // world_size) * world_size
        examples = f"{lower} or {upper}" if lower else str(upper)
        raise UserError(f"--batch-size {global_batch} does not split evenly over {world_size} processes; "
                        f"use a multiple of {world_size} (e.g. {examples})")
    batch = global_batch // world_size
    if batch % accumulate:
        raise UserError(f"--accumulate {accumulate} does not split the {batch} images per process (--batch-size "
                        f"{global_batch} over {world_size}) into equal micro-batches; use a divisor of {batch}")
    return batch


def group_flags(parser, title):
    """The dest names of the flags in ``parser``'s argument group ``title`` (argparse lists a
    group's actions in no public attribute)."""
    group = next(g for g in parser._action_groups if g.title == title)
    return tuple(action.dest for action in group._group_actions)


def run_defining_flags(parser, recipe_group):
    """The flags a resumed run must keep (the dest names): the recipe's group and
    RUN_DEFINING_FLAGS. --epochs is not among them: a larger one extends the run."""
    return (*group_flags(parser, recipe_group), *RUN_DEFINING_FLAGS)
