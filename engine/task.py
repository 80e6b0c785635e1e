"""Where the engine meets the model and the data, as pytorch/examples' ``load_train_objs`` and
torchtitan's TrainSpec do: a ``Task`` is what train_utils.fit trains, and the loop,
checkpoints and logging use nothing else of the model or the data. train_utils.build_task
makes one from --model and --dataset.
"""

import hashlib
from dataclasses import dataclass

import numpy as np
import torch.nn as nn

from engine.weights import MODEL_FILE


@dataclass(frozen=True)
class DataInfo:
    """What the engine knows of the data: names and numbers for the log, checkpoints and
    saved weights."""
    key: str               # the --dataset it was built from, as recorded in checkpoints
    title: str             # for people: CIFAR-100, image folder DIR, my_data.py:make
    source: str            # where the images come from, for the start-up block
    classes: tuple         # label i is classes[i]
    prep: object           # engine.preprocessing.Preprocessing: image shape, normalization, augmentation
    fingerprint: dict      # identifies images and labels: a resume on other data is refused
    expected_sizes: dict = None  # official images per split, for a warning when a copy differs
    notes: tuple = ()      # how the data was prepared, for the start-up block
    read_sizes: dict = None  # images per split as read, before --val-fraction held any out
    split: dict = None     # --val-fraction: which training images the test loader serves (held_out_record)
    data_dir: str = None   # an image folder's absolute path
    skipped: tuple = ()    # training images left out as unreadable, paths within data_dir

    @property
    def held_out(self):
        """The test loader serves training images held out (--val-fraction)."""
        return self.split is not None

    def weights_metadata(self):
        """What saved weights carry beside the tensors, so an evaluation or predict.py maps labels
        and prepares images the same way (images are scaled to cover ``stored_size`` (H, W),
        centre-cropped to it, then to ``image_size``, and normalized with ``mean`` and ``std``),
        and finds the images validation held out (``split``, ``data_dir``)."""
        height, width, channels = self.prep.image_shape
        optional = {"split": self.split, "data_dir": self.data_dir}
        return {"dataset": self.key, "classes": list(self.classes), "image_size": [height, width],
                "stored_size": list(self.prep.stored), "in_channels": channels, "mean": list(self.prep.mean),
                "std": list(self.prep.std), "augment": self.prep.augment,
                **{key: value for key, value in optional.items() if value is not None}}


@dataclass(frozen=True)
class Task:
    """What train_utils.fit trains. train_ddp.py replaces ``model`` by its DDP wrapper."""
    model: nn.Module       # on this rank's device, the same initial weights on every rank
    model_name: str        # as built, for people: WideResNet(num_classes=100, in_channels=3)
    model_key: str         # --model as recorded in checkpoints: a resume with another is refused
    train_loader: object   # this rank's batches of (float32 images (B, C, H, W), int64 labels (B,))
    test_loader: object
    data: DataInfo
    loader: str            # device, torchvision or dali, as chosen
    loader_reason: str     # why, for the start-up block
    weights_note: str = ""  # where the initial weights come from, when not --weights or random (--finetune)
    model_file: str = None  # --model FILE.py:NAME's file, absolute (None for module:NAME)

    def weights_metadata(self):
        """What weights files and checkpoints record beside the tensors: the model (its key and
        file) and the data's DataInfo.weights_metadata."""
        own = {MODEL_FILE: self.model_file} if self.model_file else {}
        return {"model": self.model_key, **own, **self.data.weights_metadata()}


def data_fingerprint(key, synthetic, train_labels, test_size, classes=None, image_shape=None):
    """Identifies the data in a checkpoint, so that a resume on other data is refused."""
    labels = np.asarray(train_labels, dtype=np.int64)
    fingerprint = {"dataset": key, "synthetic": synthetic, "train_images": len(labels), "test_images": test_size,
                   "train_labels_sha256": hashlib.sha256(labels.tobytes()).hexdigest()}
    if classes is not None:
        fingerprint.update(classes=list(classes), image_shape=list(image_shape))
    return fingerprint


