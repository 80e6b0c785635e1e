"""How the model is trained: the optimizer, the loss, the learning-rate schedule and the
training augmentations. This is the file to edit for a recipe of your own; the loop
(train_utils.py) calls its ``make_*`` functions (optimizer, loss, scheduler, batch transform,
model EMA), ``lr_factor``, the augmentations and the ``describe_*``/``ema_*`` lines below: how
the model is trained is decided here and nowhere else.

    python train.py --optimizer adamw --base-lr 0.001 --weight-decay 0.05
    python train.py --augment crop --label-smoothing 0 --lr-schedule constant
    torchrun --standalone --nproc_per_node=4 train_ddp.py --optimizer adamw --epochs 30
    sbatch --account=nnXXXXk multigpu_job.sh --optimizer adamw

Each knob is a flag, defined once in ``add_arguments`` with its default; a checkpoint
records them, and a resume with other values (or another optimizer class) is refused.
Your own optimizer: one function ``(model, args, device) -> torch.optim.Optimizer`` and a
line in OPTIMIZERS. Any torch.optim optimizer trains, checkpoints and resumes exactly.
Your own augmentation: one function ``(images, rand, prep) -> images`` and a line in
AUGMENTATIONS. The device loader applies it to whole batches on the GPU; the DataLoader's
workers apply torchvision's transform that does the same where ``library_transform`` names
one, else your function to one image at a time; --loader dali runs the DALI operators
``dali_images`` lists for it (add yours there and in DALI_OPS). Per-image torchvision v2 transforms of your own
go in ``image_transforms``.
"""

import argparse
import math
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel

from engine.errors import UserError
from engine.flags import below_one, non_negative_float, positive_float, positive_int

RECIPE_GROUP = "recipe (identical for train.py and train_ddp.py)"  # a resume must keep every flag in it
DEFAULT_WARMUP_EPOCHS = 2.0
DEFAULT_EMA_STEPS = 32  # --model-ema: optimizer steps between updates of the average, the references'
EMA_UPDATES = 100  # a run shorter than this many x DEFAULT_EMA_STEPS steps updates the average more often
EMA_HALF_LIFE = 0.05  # --model-ema's default decay: the average's half-life is this fraction of the run's steps


# ---------------------------------------------------------------------------------------------
# The optimizer.

def sgd(model, args, device):
    """The guide's optimizer: SGD with (Nesterov) momentum and L2 weight decay on every
    parameter that trains (--freeze-backbone freezes some); one fused kernel for all on CUDA."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(trained, lr=args.base_lr, momentum=args.momentum, nesterov=args.nesterov,
                           weight_decay=args.weight_decay, fused=True if device.type == "cuda" else None)


def adamw(model, args, device):
    """AdamW with decoupled weight decay on the weights only: biases and normalization
    parameters (tensors of one dimension) get none, as timm and nanoGPT do."""
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trained if p.ndim > 1]},
              {"params": [p for p in trained if p.ndim <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.base_lr, betas=(0.9, 0.999), weight_decay=args.weight_decay,
                             fused=True if device.type == "cuda" else None)


class OptimizerChoice(NamedTuple):
    build: Callable       # (model, args, device) -> torch.optim.Optimizer
    base_lr: float        # the default of --base-lr with this optimizer
    weight_decay: float   # the default of --weight-decay


OPTIMIZERS = {
    "sgd": OptimizerChoice(sgd, base_lr=0.01, weight_decay=5e-4),
    "adamw": OptimizerChoice(adamw, base_lr=1e-3, weight_decay=0.05),
}


def make_optimizer(model, args, device):
    return OPTIMIZERS[args.optimizer].build(model, args, device)


# ---------------------------------------------------------------------------------------------
# The loss: logits (B, classes) and labels (B,) -> a scalar.

def make_loss(args):
    """Cross-entropy with label smoothing (the reported validation loss is plain cross-entropy)."""
    return nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)


# ---------------------------------------------------------------------------------------------
# Per image, in the DataLoader's workers (--loader torchvision): torchvision.transforms.v2, as
# torchvision's presets.py lists them. They run after --augment's operations below, on each
# uint8 image (C, H, W), before normalization; each image's draws are seeded by (--seed, epoch,
# index), so a resumed run repeats them. The device loader works on whole batches and refuses
# them in one line; --loader auto then takes the DataLoader.

AUTO_AUGMENT = {"ta_wide": "TrivialAugmentWide", "ra": "RandAugment", "augmix": "AugMix"}  # torchvision's names


def image_transforms(args):
    """The per-image transforms of a training image (a v2.Compose), or None for none. Add any
    v2 transform to the list, e.g. v2.ColorJitter(0.4, 0.4, 0.4) (docs/recipe.md): the DataLoader
    applies it, and the loaders that cannot (device, dali) refuse it in one line naming it."""
    if args.eval_only:  # test images are never augmented
        return None
    # Here, not at the top: a training run pays torchvision's import (about 2 s per process, once),
    # --eval-only, predict.py and the tools do not.
    from torchvision.transforms import v2
    transforms = [
        # v2.ColorJitter(0.4, 0.4, 0.4),  # yours here
    ]
    if args.auto_augment:
        transforms.append(getattr(v2, AUTO_AUGMENT[args.auto_augment])())
    return v2.Compose(transforms) if transforms else None


# ---------------------------------------------------------------------------------------------
# On the whole batch, on its device, after normalization (torchvision's references'
# --random-erase, --mixup-alpha, --cutmix-alpha; --clip-grad-norm is the loop's): MixUp and
# CutMix make soft labels (B, classes) for the loss above.

def make_batch_transform(args, num_classes):
    """What happens to each training batch (x float (B, C, H, W), labels int64 (B,)) before the
    forward pass: --random-erase, then torchvision's v2.MixUp and/or v2.CutMix (one of the two
    per batch when both are on, v2.RandomChoice, as the references do) -> (x, soft labels float
    (B, classes)); None when none is on. Their draws come from torch's generators, which the
    loop seeds per epoch and rank and keeps in a mid-epoch checkpoint: a resume repeats them."""
    mix = None
    if args.mixup_alpha or args.cutmix_alpha:
        # Here, not at the top: importing torchvision costs 2 s per process, paid only when asked for.
        from torchvision.transforms import v2
        mixes = ([v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes)] if args.mixup_alpha else []) + (
            [v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes)] if args.cutmix_alpha else [])
        mix = mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)
    if not (mix or args.random_erase):
        return None

    def transform(x, labels):
        x = random_erase(x, args.random_erase) if args.random_erase else x
        return mix(x, labels) if mix else (x, labels)
    return transform


class EmaSchedule(NamedTuple):
    """How --model-ema averages: the decay per update, the optimizer steps between updates, and
    the half-life that follows (optimizer steps after which an update's weight has halved)."""
    decay: float
    every: int
    half_life: float


def ema_schedule(args, total_steps):
    """The EmaSchedule of --model-ema in a run of ``total_steps`` optimizer steps, None without
    it. --model-ema-decay and --model-ema-steps as given; by default an update every
    DEFAULT_EMA_STEPS steps (more often in a short run, so that it gets EMA_UPDATES of them)
    and the decay whose half-life is EMA_HALF_LIFE of the run: the average follows the run's
    length, as the references' decay adjustment does, instead of remembering the first epochs
    of a short run (a fixed 0.99 every 32 steps is 110 epochs of a folder of 800 photos)."""
    if not args.model_ema:
        return None
    every = args.model_ema_steps or max(1, min(DEFAULT_EMA_STEPS, total_steps // EMA_UPDATES))
    if total_steps < every:
        raise UserError(f"--model-ema-steps {every} is more than this run's {total_steps} optimizer steps: the "
                        "average would keep the initial weights; give fewer --model-ema-steps")
    decay = args.model_ema_decay
    if decay is None:
        decay = 0.5 ** (every / max(EMA_HALF_LIFE * total_steps, every))
    return EmaSchedule(decay, every, math.log(0.5) / math.log(decay) * every)


def make_model_ema(model, schedule):
    """--model-ema: torch.optim.swa_utils.AveragedModel, an exponential moving average of the
    weights and buffers of ``model`` (the plain module, not its DDP wrapper) with the decay of
    ``schedule`` (ema_schedule's), which the loop updates with update_model_ema; None without.
    Each epoch validates both the model and the average; --save-weights keeps the better."""
    if schedule is None:
        return None
    from engine.model_ema import ema_of_floats
    return AveragedModel(model, multi_avg_fn=ema_of_floats(schedule.decay), use_buffers=True)


# Named in the start-up block and in the metrics when on:
BATCH_SETTINGS = ("auto_augment", "random_erase", "mixup_alpha", "cutmix_alpha", "clip_grad_norm")


def describe_regularization(args, steps_per_epoch, ema=None):
    """The start-up block's words for the batch-level settings that are on ('' for none), with
    the model EMA's schedule ``ema`` (ema_schedule's) and its half-life in steps and epochs."""
    parts = [f"--{name.replace('_', '-')} {value if isinstance(value, str) else f'{value:g}'}"
             for name, value in batch_settings(args).items()]
    if ema:
        run = ema.half_life / (steps_per_epoch * args.epochs)  # EMA_HALF_LIFE, or more in a very short run
        chosen = ""
        if args.model_ema_decay is None:  # ema_schedule's: at least one update's worth in a very short run
            raised = ("" if run < EMA_HALF_LIFE * 1.01 else
                      f" {EMA_HALF_LIFE:.0%}, raised to one update in a run this short")
            chosen = f", {run:.0%} of the run (the default{raised})"
        parts.append(f"model EMA (decay {ema.decay:.6g} every {count_steps(ema.every)}: half-life "
                     f"{count_steps(round(ema.half_life))}{chosen}, {ema.half_life / steps_per_epoch:.1f} epochs; "
                     "each epoch validates the model and the average, --save-weights keeps the better)")
    return ", ".join(parts)


def ema_warning(args, ema, total_steps, warmup_steps=0):
    """[one warning line] when the average's half-life is longer than the run (``total_steps``
    optimizer steps): it would hold mostly the weights of the run's start; or when the LR
    warm-up (``warmup_steps``), during which the average restarts from the model at each update
    (engine/model_ema.py), lasts the whole run: it would be the model itself. Else []."""
    if ema and warmup_steps >= total_steps:
        return [f"WARNING: the model EMA restarts from the model at each update of the LR warm-up "
                f"({count_steps(warmup_steps)}), which lasts this whole run of {count_steps(total_steps)}: the "
                "average is the model itself; lower --warmup-epochs or train longer"]
    if not ema or ema.half_life <= total_steps:
        return []
    return [f"WARNING: the model EMA's half-life ({count_steps(round(ema.half_life))}) is longer than this run's "
            f"{count_steps(total_steps)}: the average would be mostly the early weights; lower --model-ema-decay "
            f"(now {ema.decay:g}) or --model-ema-steps (now {ema.every}), or leave both out for a half-life of "
            f"{EMA_HALF_LIFE:.0%} of the run"]


def count_steps(n):
    return f"{n:,} step" if n == 1 else f"{n:,} steps"


def batch_settings(args, ema=None):
    """{flag: value} of the batch-level settings that are on, with the model EMA's decay and
    steps of ``ema`` (ema_schedule's): the start-up block's "Regularization" line and a field of
    every metrics record."""
    settings = {name: getattr(args, name) for name in BATCH_SETTINGS if getattr(args, name)}
    if ema:
        settings.update(model_ema_decay=ema.decay, model_ema_steps=ema.every)
    return settings


# ---------------------------------------------------------------------------------------------
# The learning-rate schedule, stepped once per optimizer step.

def lr_factor(step, total_steps, warmup_steps, schedule):
    """Multiplier of --base-lr for optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps`` (reaching 1 at the last warm-up step), then constant or cosine to 0 at
    ``total_steps``. A pure function of the step, so a resume needs no state to follow it."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer, args, total_steps):
    """Your own learning-rate schedule, if you want one: any torch.optim.lr_scheduler scheduler
    of ``optimizer`` but ReduceLROnPlateau (it steps on a metric; refused in one line), stepped
    after each of the run's ``total_steps`` optimizer steps, e.g.
    ``OneCycleLR(optimizer, max_lr=args.base_lr, total_steps=total_steps)`` (docs/recipe.md).
    None, as here: lr_factor's shape (--warmup-epochs, then --lr-schedule), which a resume with
    a larger --epochs extends by a warm restart; a run of your own keeps its --epochs."""
    return None


# ---------------------------------------------------------------------------------------------
# Training augmentations: batched operations on images (B, H, W, C), uint8 or float, on any
# device (the device loader's). ``rand`` (B, RANDOM_PER_OP) float64 holds uniform numbers in
# [0, 1), drawn for each image of the data set from (--seed, epoch) alone: the same image gets
# the same numbers on every rank and after a resume. ``prep`` is the data set's
# dataset_utils.Preprocessing (image shape, padding). The DataLoader's workers apply
# torchvision's own transform of each where there is one (library_transform), seeded per
# image from (--seed, epoch, index): the same distribution, other draws. Test images are never
# augmented.

RANDOM_PER_OP = 4  # uniform numbers each operation gets per image


def flip(images, rand, prep):
    """Mirror each image left-right with probability 1/2 (RandomHorizontalFlip)."""
    mirrored = rand[:, 0] < 0.5  # (B,) bool
    return torch.where(mirrored[:, None, None, None], images.flip(2), images)


def pad_crop(images, rand, prep):
    """A crop of the image's own size from the image zero-padded by prep.padding pixels on each
    side, its offsets uniform over 0..2*padding (the guide's RandomCrop(size, padding)): one
    gather for the whole batch, no loop over images, no host sync."""
    b, h, w, _ = images.shape
    p = prep.padding
    offsets = (rand[:, :2] * (2 * p + 1)).long()  # (B, 2): top, left in the padded image
    padded = F.pad(images, (0, 0, p, p, p, p))  # (B, H + 2p, W + 2p, C), zeros around
    rows = offsets[:, :1] + torch.arange(h, device=images.device)  # (B, H)
    cols = offsets[:, 1:] + torch.arange(w, device=images.device)  # (B, W)
    batch = torch.arange(b, device=images.device)[:, None, None]
    return padded[batch, rows[:, :, None], cols[:, None, :]]


def resized_crop(images, rand, prep):
    """torchvision's RandomResizedCrop(prep.image_shape[:2], RESIZED_CROP_SCALE, RESIZED_CROP_RATIO)
    of each image: a box drawn as torchvision draws it (a fraction of the area and an aspect
    ratio, uniform in log, that fit the image), resized bilinearly to the model's input size."""
    _, height, width, _ = images.shape
    top, left, box_h, box_w = random_boxes(rand, height, width, RESIZED_CROP_SCALE, RESIZED_CROP_RATIO)
    return crop_resize(images, top, left, box_h, box_w, prep.image_shape[:2])


def library_transform(op, prep):
    """What the DataLoader's workers apply for the batched ``op`` to each training image (C, H, W):
    torchvision's transform that does the same, from the same ranges, else ``op`` on a batch of one."""
    from torchvision.transforms import v2  # seconds to import: paid by the DataLoader path alone
    size = list(prep.image_shape[:2])
    if op is flip:
        return v2.RandomHorizontalFlip()
    if op is pad_crop:
        return v2.RandomCrop(size, padding=prep.padding)  # zero padding, as pad_crop's
    if op is resized_crop:  # antialiased, where the batched one is not: 8/7 down at most, nearly the same
        return v2.RandomResizedCrop(size, scale=RESIZED_CROP_SCALE, ratio=RESIZED_CROP_RATIO, antialias=True)
    return partial(on_one_image, op=op, prep=prep)


def on_one_image(image, op, prep):
    """Batched ``op`` on one image (C, H, W), its numbers drawn from torch's generator, which
    the DataLoader seeds for each image from (--seed, epoch, index)."""
    rand = torch.rand((1, prep.per_op), dtype=torch.float64)
    return op(image.permute(1, 2, 0)[None], rand, prep)[0].permute(2, 0, 1)


def loader_transforms(prep):
    """The DataLoader's per-image pipeline for a training image (C, H, W) of ``prep`` (an
    dataset_utils.Preprocessing): its operations as library_transform gives them, then
    image_transforms'; a v2.Compose, or None when there is nothing to do."""
    steps = [library_transform(op, prep) for op in prep.ops] + list(getattr(prep.per_image, "transforms", ()))
    if not steps:
        return None
    from torchvision.transforms import v2
    return v2.Compose(steps)


DALI_OPS = (resized_crop, pad_crop, flip)  # the operations dali_images runs: add yours to both


def dali_lacks(ops):
    """The names of the operations of ``ops`` (an AUGMENTATIONS entry) not in DALI_OPS."""
    return [op.__name__ for op in ops if op not in DALI_OPS]


def check_dali_ops(ops):
    """One line for dali_lacks(ops): asked before any data is read, and where the pipeline is built."""
    unknown = dali_lacks(ops)
    if unknown:
        raise UserError(f"--loader dali has no DALI operator for recipe.py's {', '.join(unknown)}: add one to "
                        "recipe.dali_images and DALI_OPS, or use --loader torchvision")


def dali_images(encoded, prep, training, gpu):
    """--loader dali's images from the encoded files (DALI DataNodes, nvidia.dali.fn operators):
    decoded on the GPU ("mixed") or the CPU; training as ``prep.ops`` say (a resized crop of the
    whole photo, as torchvision's references crop it; a pad-crop of the image resized to cover the
    input size; a flip), evaluation resized to cover ``prep.stored`` and centre-cropped as
    predict.py does; normalized -> float32 (H, W, C), which the loader hands out as a (C, H, W)
    view, channels-last in memory. Add your own DALI operators here."""
    from nvidia.dali import fn, types  # imported by --loader dali alone
    ops, (height, width) = (prep.ops if training else ()), prep.image_shape[:2]
    decoder = dict(device="mixed" if gpu else "cpu", output_type=types.GRAY if prep.image_shape[2] == 1 else types.RGB)
    check_dali_ops(ops)
    if resized_crop in ops:
        images = fn.decoders.image_random_crop(encoded, **decoder, random_area=RESIZED_CROP_SCALE,
                                               random_aspect_ratio=RESIZED_CROP_RATIO, num_attempts=10)
        images = fn.resize(images, resize_x=width, resize_y=height)
    else:
        stored = prep.stored if not ops else (height, width)
        images = fn.resize(fn.decoders.image(encoded, **decoder), resize_x=stored[1], resize_y=stored[0],
                           mode="not_smaller")  # covers it, the aspect ratio kept
        images = fn.crop(images, crop=stored)  # its centre, as the cache stores it
        if stored != (height, width):  # then the input's centre, offsets rounded as centre_crop rounds them
            top, left = (round((side - crop) / 2) / (side - crop) for side, crop in zip(stored, (height, width)))
            images = fn.crop(images, crop=(height, width), crop_pos_y=top, crop_pos_x=left)
    if pad_crop in ops:
        p = prep.padding
        positions = [k / (2 * p) for k in range(2 * p + 1)]  # offsets 0..2p pixels, uniform, as pad_crop's
        padded = fn.crop(images, crop=(height + 2 * p, width + 2 * p), out_of_bounds_policy="pad")  # zeros around
        images = fn.crop(padded, crop=(height, width), crop_pos_x=fn.random.uniform(values=positions),
                         crop_pos_y=fn.random.uniform(values=positions))
    mirror = fn.random.coin_flip() if flip in ops else 0
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="HWC", mirror=mirror,
                                    mean=[255 * m for m in prep.mean], std=[255 * s for s in prep.std])


AUGMENTATIONS = {  # --augment NAME: the operations, applied in this order
    "flip-crop": (flip, pad_crop),
    "crop": (pad_crop,),
    "flip": (flip,),
    "resized-crop": (resized_crop, flip),
    "none": (),
}
RESIZED_CROP_SCALE = (0.25, 1.0)  # fraction of the image's area in a resized crop
RESIZED_CROP_RATIO = (3 / 4, 4 / 3)  # its aspect ratio, width / height
# resized-crop trains on crops of images stored at 8/7 of the training size and tests on their
# centre: the usual resize to 256, centre crop 224 of torchvision's and timm's references.
STORED_RATIO = 8 / 7
PHOTO_PIXELS = 64  # --augment auto: images whose median shorter side is larger are photos (resized-crop)
AUGMENT_AUTO = ("resized-crop", "flip-crop")  # --augment auto's choice for photos, and for small images


def augmentation_ops(name):
    """AUGMENTATIONS[name], checked: one line for an entry that is not a tuple of operations."""
    ops = AUGMENTATIONS[name]
    if not isinstance(ops, (tuple, list)) or not all(callable(op) for op in ops):
        raise UserError(f"recipe.AUGMENTATIONS[{name!r}] is {type(ops).__name__}: it takes a tuple of operations, "
                        "applied in order, e.g. (flip, cutout) or (cutout,)")
    return tuple(ops)


def auto_augment(short_side):
    """--augment auto for your own images whose (median) shorter side is ``short_side`` pixels:
    resized-crop for photos, flip-crop for small CIFAR-like images. The images' own size
    decides, not --image-size: photos trained small are still photos."""
    photos, small = AUGMENT_AUTO
    return photos if short_side > PHOTO_PIXELS else small


def stored_size(augment, size):
    """(H, W) to store images at for training at ``size`` with ``augment``: larger for resized-crop."""
    return tuple(round(side * STORED_RATIO) for side in size) if augment == "resized-crop" else tuple(size)


def training_size(augment, stored):
    """The inverse: the training size (H, W) of images stored at ``stored``."""
    return tuple(round(side / STORED_RATIO) for side in stored) if augment == "resized-crop" else tuple(stored)


# ---------------------------------------------------------------------------------------------
# The geometry behind resized_crop and --random-erase: boxes in a whole batch at once, on any
# device, no loop over images, no host sync. Each box is drawn as torchvision's
# RandomResizedCrop or RandomErasing draws one for one image, and resized as its resized_crop
# (without antialiasing) resizes one (tests/test_photos.py compares them).

RESIZED_CROP_TRIES = 10  # RandomResizedCrop draws up to 10 boxes for one that fits, then takes the centre
ASPECT_GRID = 1024  # points of the aspect ratio's distribution: a box shape's error below 0.1%


def random_boxes(rand, height, width, scale, ratio):
    """(top, left, box height, box width), float64 (B,) in pixels, of a RandomResizedCrop(scale,
    ratio) box in each of B images of ``height`` x ``width``, from 4 uniform numbers per image
    ``rand`` (B, >= 4). torchvision draws (area fraction, log aspect) uniformly in (scale, log
    ratio) until the box fits the image, at most RESIZED_CROP_TRIES times, else takes the
    centre at the nearest allowed aspect. The same distribution here, without a loop: with the
    chance that all RESIZED_CROP_TRIES draws miss, the centre; else the aspect by the inverse
    of the distribution of the aspects that fit (on ASPECT_GRID points), then the fraction
    uniform among those that fit it."""
    device, (low, high) = rand.device, scale
    log_ratio = torch.linspace(math.log(ratio[0]), math.log(ratio[1]), ASPECT_GRID, dtype=torch.float64,
                               device=device)

    def largest_fraction(t):  # the largest fraction of the area whose box of aspect e^t fits: (B,) or (ASPECT_GRID,)
        return torch.exp(-(t - math.log(width / height)).abs()).clamp(max=high)

    fits = (largest_fraction(log_ratio) - low).clamp(min=0)  # (ASPECT_GRID,) the fitting fractions' length per aspect
    cells = (fits[1:] + fits[:-1]) / 2  # (ASPECT_GRID - 1,) trapezoids
    missed = (1 - cells.mean() / (high - low)) ** RESIZED_CROP_TRIES  # the chance that every draw misses
    centred = rand[:, 0] < missed  # (B,)
    u_fraction = ((rand[:, 0] - missed) / (1 - missed)).clamp(0, 1)  # uniform again, given a fitting draw
    cdf = cells.cumsum(0) / cells.sum()  # (ASPECT_GRID - 1,)
    cell = torch.searchsorted(cdf, rand[:, 1].contiguous()).clamp(max=ASPECT_GRID - 2)  # (B,)
    start = torch.where(cell > 0, cdf[(cell - 1).clamp(min=0)], torch.zeros_like(rand[:, 1]))
    within = ((rand[:, 1] - start) / (cdf[cell] - start)).clamp(0, 1).nan_to_num(0.5)
    t = log_ratio[cell] + within * (log_ratio[1] - log_ratio[0])
    fraction = low + (largest_fraction(t) - low).clamp(min=0) * u_fraction
    box_h = (height * width * fraction / t.exp()).sqrt().clamp(max=height)
    box_w = (height * width * fraction * t.exp()).sqrt().clamp(max=width)
    # The centre, as torchvision's: the whole image cut to the nearest allowed aspect.
    centre_h, centre_w = ((width / ratio[0], width) if width / height < ratio[0] else
                          (height, height * ratio[1]) if width / height > ratio[1] else (height, width))
    box_h, box_w = torch.where(centred, centre_h, box_h), torch.where(centred, centre_w, box_w)
    top = torch.where(centred, (height - box_h) / 2, rand[:, 3] * (height - box_h))
    left = torch.where(centred, (width - box_w) / 2, rand[:, 2] * (width - box_w))
    return top, left, box_h, box_w


def crop_resize(images, top, left, height, width, size):
    """The part [top, top + height) x [left, left + width) of each image (B, H, W, C) (box
    edges (B,) float64, in pixels), resized bilinearly to ``size`` (h, w) as torchvision's
    resized_crop without antialiasing: pixel centres at +0.5, edges clamped to the part.
    Batched: one gather per axis, no loop over images, no host sync; uint8 in, uint8 out.
    Not torchvision.ops.roi_align(aligned=True), the batched library op closest to it: that
    samples half a pixel outside a box smaller than ``size``, where resized_crop (and the
    DataLoader's v2.RandomResizedCrop) clamp to it (tests/test_photos.py compares both)."""
    batch = torch.arange(len(images), device=images.device)[:, None]
    first_row, next_row, down = bilinear_taps(top, height, size[0], images.shape[1])  # (B, h)
    first_col, next_col, across = bilinear_taps(left, width, size[1], images.shape[2])  # (B, w)
    upper, lower = images[batch, first_row].float(), images[batch, next_row].float()  # (B, h, W, C)
    rows = (upper + (lower - upper) * down[:, :, None, None]).transpose(1, 2)  # (B, W, h, C)
    left_px, right_px = rows[batch, first_col], rows[batch, next_col]  # (B, w, h, C)
    out = (left_px + (right_px - left_px) * across[:, :, None, None]).transpose(1, 2)  # (B, h, w, C)
    return out.round().clamp(0, 255).to(torch.uint8) if images.dtype == torch.uint8 else out.to(images.dtype)


def bilinear_taps(start, length, out, size):
    """For ``out`` output pixels spread over [start, start + length) of an axis of ``size``
    pixels: the two source pixels of each, (B, out) int64, and the weight of the second,
    (B, out) float32."""
    steps = torch.arange(out, dtype=torch.float64, device=start.device) + 0.5
    centres = start[:, None] + steps * (length / out)[:, None] - 0.5  # (B, out), in source pixels
    centres = torch.minimum(torch.maximum(centres, start[:, None]), (start + length - 1)[:, None]).clamp(0, size - 1)
    first = centres.floor()
    return first.long(), (first + 1).clamp(max=size - 1).long(), (centres - first).float()


ERASE_SCALE = (0.02, 0.33)  # the erased box's share of the image's area (RandomErasing's defaults)
ERASE_RATIO = (0.3, 3.3)    # its aspect ratio, height / width, uniform in log


def random_erase(images, p):
    """torchvision's RandomErasing(p, scale=ERASE_SCALE, ratio=ERASE_RATIO, value=0) on a batch
    of normalized images (B, C, H, W), a box of its own for each image. Where torchvision tries
    up to 10 boxes for one that fits, this tries one: a box taller or wider than the image
    erases nothing. Its numbers come from the device's generator: no host sync, and a
    mid-epoch checkpoint keeps them."""
    batch, _, height, width = images.shape
    u = torch.rand(batch, 5, device=images.device)  # (B, 5): erase?, area, aspect, top, left
    area = height * width * (ERASE_SCALE[0] + (ERASE_SCALE[1] - ERASE_SCALE[0]) * u[:, 1])
    aspect = ERASE_RATIO[0] * (ERASE_RATIO[1] / ERASE_RATIO[0]) ** u[:, 2]
    box_h, box_w = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()  # (B,) pixels
    erased = (u[:, 0] < p) & (box_h < height) & (box_w < width)
    top, left = (u[:, 3] * (height - box_h + 1)).floor(), (u[:, 4] * (width - box_w + 1)).floor()
    rows = torch.arange(height, device=images.device)[None]  # (1, H)
    cols = torch.arange(width, device=images.device)[None]  # (1, W)
    in_rows = (rows >= top[:, None]) & (rows < (top + box_h)[:, None])  # (B, H)
    in_cols = (cols >= left[:, None]) & (cols < (left + box_w)[:, None])  # (B, W)
    box = in_rows[:, :, None] & in_cols[:, None, :] & erased[:, None, None]  # (B, H, W)
    return images.masked_fill(box[:, None], 0.0)


# ---------------------------------------------------------------------------------------------
# The recipe's flags: one definition each, with units; train.py, train_ddp.py and tools/benchmark.py
# share them.

def add_arguments(parser):
    recipe = parser.add_argument_group(RECIPE_GROUP)
    recipe.add_argument("--batch-size", metavar="IMAGES", type=positive_int, default=256,
                        help="global batch in images per optimizer step, split evenly over all processes")
    recipe.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="sgd = SGD with Nesterov momentum (the guide's); adamw = AdamW, no weight decay on "
                             "biases and normalization parameters. Add your own in recipe.py's OPTIMIZERS")
    recipe.add_argument("--base-lr", metavar="LR", type=positive_float, default=None,
                        help="peak learning rate, used as given (not scaled with batch size or GPU count); default: "
                             + ", ".join(f"{name} {choice.base_lr:g}" for name, choice in OPTIMIZERS.items()))
    recipe.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                        help="after warm-up: cosine decay to 0 at the last step of --epochs, or constant")
    recipe.add_argument("--warmup-epochs", metavar="EPOCHS", type=non_negative_float, default=None,
                        help="epochs (may be fractional) of linear learning-rate warm-up up to --base-lr (default: "
                             f"{DEFAULT_WARMUP_EPOCHS:g}; given explicitly, at most --epochs)")
    recipe.add_argument("--momentum", metavar="COEFF", type=below_one, default=None,
                        help="--optimizer sgd: momentum coefficient (0 = plain SGD; default 0.9)")
    recipe.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=None,
                        help="--optimizer sgd: Nesterov momentum (default: on when --momentum > 0)")
    recipe.add_argument("--weight-decay", metavar="COEFF", type=non_negative_float, default=None,
                        help="weight-decay coefficient: L2 on every parameter for sgd, decoupled on the weights for "
                             "adamw; default: " + ", ".join(f"{name} {choice.weight_decay:g}"
                                                            for name, choice in OPTIMIZERS.items()))
    recipe.add_argument("--label-smoothing", metavar="FRACTION", type=below_one, default=0.1,
                        help="label smoothing of the training loss (fraction of probability mass); "
                             "the reported validation loss is plain cross-entropy")
    add_augment_argument(recipe)
    recipe.add_argument("--auto-augment", choices=AUTO_AUGMENT, default=None,
                        help="automatic augmentation of each training image (torchvision's v2."
                             + ", v2.".join(f"{name} for {flag}" for flag, name in AUTO_AUGMENT.items())
                             + "), after --augment, in the DataLoader's workers (--loader torchvision)")
    recipe.add_argument("--random-erase", metavar="P", type=below_one, default=0.0,
                        help="erase a random box of each training image with probability P (torchvision's "
                             "RandomErasing: 2%%-33%% of the area, aspect 0.3-3.3, set to 0 after normalization), on "
                             "the batch's device; 0 = off")
    recipe.add_argument("--mixup-alpha", metavar="ALPHA", type=non_negative_float, default=0.0,
                        help="MixUp: each training batch blended with itself shifted by one image, the weight drawn "
                             "from Beta(ALPHA, ALPHA) per batch, labels blended alike (torchvision's v2.MixUp; the "
                             "references use 0.2); 0 = off")
    recipe.add_argument("--cutmix-alpha", metavar="ALPHA", type=non_negative_float, default=0.0,
                        help="CutMix: a box of each training image replaced by the next image's, its area fraction "
                             "from Beta(ALPHA, ALPHA) per batch, labels mixed by area (v2.CutMix; the references use "
                             "1.0); with --mixup-alpha, one of the two per batch; 0 = off")
    recipe.add_argument("--clip-grad-norm", metavar="NORM", type=positive_float, default=None,
                        help="clip the gradients' total L2 norm over all parameters to NORM before each optimizer "
                             "step (after unscaling under --precision fp16); default: no clipping")
    recipe.add_argument("--model-ema", action="store_true",
                        help="keep an exponential moving average of the weights (torch.optim.swa_utils."
                             "AveragedModel, as the references): each epoch validates the model and the average, "
                             "--save-weights keeps the better of the two")
    recipe.add_argument("--model-ema-decay", metavar="DECAY", type=below_one, default=None,
                        help=f"--model-ema: the average keeps DECAY of itself at each update (default: the decay "
                             f"whose half-life is {EMA_HALF_LIFE:.0%}% of the run's optimizer steps; the start-up "
                             "block gives it, and the half-life in steps and epochs)")
    recipe.add_argument("--model-ema-steps", metavar="STEPS", type=positive_int, default=None,
                        help=f"--model-ema: optimizer steps between updates of the average (default "
                             f"{DEFAULT_EMA_STEPS}, the references', or fewer so that a short run gets {EMA_UPDATES} "
                             "updates; each update waits for the GPU once: AveragedModel reads its count)")


def add_augment_argument(group):
    """--augment, in the recipe's group; dataset_utils.py's pre-decoding takes it too (it sets
    the size a folder's images are stored at)."""
    group.add_argument("--augment", choices=("auto", *AUGMENTATIONS), default="auto",
                       help="training augmentation (recipe.py's AUGMENTATIONS): flip-crop = random horizontal flip "
                            "and a crop of the zero-padded image (padding 1/8 of the image side); crop = no flips; "
                            "flip = no crop; resized-crop = a random 1/4 to all of the image's area, aspect 3/4 to "
                            "4/3, resized to --image-size, and a flip (photos; images stored at 8/7 of the size, "
                            "tested on the centre crop); none; auto = the data set's own (CIFAR and Fashion-MNIST "
                            "flip-crop, MNIST crop; your own images resized-crop when photos, their median shorter "
                            f"side larger than {PHOTO_PIXELS} pixels, else flip-crop)")


def check_arguments(args, error):
    """Resolve the defaults that depend on other flags (derived once, here) and refuse
    combinations that cannot work: ``error(message)`` exits with one line."""
    choice = OPTIMIZERS[args.optimizer]
    if args.optimizer == "sgd":
        args.momentum = 0.9 if args.momentum is None else args.momentum
        if args.nesterov and args.momentum == 0:
            error("--nesterov needs --momentum > 0; for plain SGD add --no-nesterov")
        args.nesterov = args.momentum > 0 if args.nesterov is None else args.nesterov
    else:
        for flag in ("momentum", "nesterov"):
            if getattr(args, flag) is not None:
                error(f"--{flag} applies to --optimizer sgd, not {args.optimizer}")
    args.base_lr = choice.base_lr if args.base_lr is None else args.base_lr
    args.weight_decay = choice.weight_decay if args.weight_decay is None else args.weight_decay
    if args.model_ema:  # the defaults follow the run's length: ema_schedule derives them
        if args.model_ema_decay == 0:
            error("--model-ema-decay 0 keeps nothing of the average: give a decay between 0 and 1, or drop --model-ema")
    else:
        for flag in ("model_ema_decay", "model_ema_steps"):
            if getattr(args, flag) is not None:
                error(f"--{flag.replace('_', '-')} applies to --model-ema, which is not given")
    if args.warmup_epochs is None:  # the default: a shorter run (a smoke test) warms up part of the way
        args.warmup_epochs = DEFAULT_WARMUP_EPOCHS
    elif args.warmup_epochs > args.epochs:
        error(f"--warmup-epochs {args.warmup_epochs:g} is longer than the run (--epochs {args.epochs}): the "
              "learning rate would never reach --base-lr; use fewer warm-up epochs")
