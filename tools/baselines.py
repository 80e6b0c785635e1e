"""What tools/benchmark.py measures the project against: the guide's part 1 as it wrote it (its
DataLoader of PIL transforms and its own training loop), and torchvision's RandomResizedCrop
as its references write it. Kept as written; the project's own recipe is recipe.py's.
"""

import sys
import time
from itertools import islice
from typing import NamedTuple

if __name__ == "__main__":  # imported by tools/benchmark.py, whose folder is the project's
    sys.exit("baselines.py: error: it holds what tools/benchmark.py measures against; run python "
             "tools/benchmark.py --help")

import torch
import torchvision.transforms as transforms
from torch.utils.data import DataLoader, Dataset

from dataset_utils import to_pil
from device_utils import set_tf32
from engine.processes import synchronize
from recipe import RESIZED_CROP_RATIO, RESIZED_CROP_SCALE


class StepTiming(NamedTuple):
    images_per_sec: float  # of the timed steps, over all ranks
    warmup_s: float        # wall time of the untimed warm-up steps (cuDNN autotuning, compilation)
    precision: str         # as resolved for this device


# The guide's fp32 on each device: PyTorch lets cuDNN use TF32 for convolutions by default.
GUIDE_PRECISION = {"cuda": "fp32, TF32 convolutions", "cpu": "fp32"}


class GuideImages(Dataset):
    """The guide's training set as its dataset_utils.py builds it: PIL images through
    RandomCrop(size, padding), RandomHorizontalFlip, ToTensor and Normalize, one image at a
    time in the loading process. The baseline measured against, kept as the guide wrote it;
    the project's own augmentation is recipe.py's."""

    def __init__(self, train_set):
        prep = train_set.prep
        self.images, self.labels = train_set.images, train_set.labels
        self.transform = transforms.Compose([transforms.RandomCrop(prep.image_shape[:2], padding=prep.padding),
                                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                             transforms.Normalize(prep.mean, prep.std)])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.transform(to_pil(self.images[index])), int(self.labels[index])


class TorchvisionResizedCrops(Dataset):
    """resized-crop as torchvision's references write it: PIL images through
    RandomResizedCrop(size, scale, ratio), RandomHorizontalFlip, ToTensor and Normalize, one
    image at a time in DataLoader workers. What the device loader's batched resized-crop
    (recipe.py) is measured against."""

    def __init__(self, train_set):
        prep = train_set.prep
        self.images, self.labels = train_set.images, train_set.labels
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(prep.image_shape[:2], scale=RESIZED_CROP_SCALE, ratio=RESIZED_CROP_RATIO),
            transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize(prep.mean, prep.std)])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.transform(to_pil(self.images[index])), int(self.labels[index])


def guide_loader(train_set, batch_size, device):
    """The guide's training DataLoader, as written in its dataset_utils.py."""
    return DataLoader(GuideImages(train_set), batch_size=batch_size, shuffle=True, drop_last=True, num_workers=0,
                      pin_memory=device.type == "cuda")


def guide_training_steps(task, args, ctx, batches, warmup_steps, steps):
    """The guide's part 1 loop as it wrote it (its train_utils.train): plain SGD with --base-lr
    alone, CrossEntropyLoss, fp32 with PyTorch's default TF32 convolutions, cuDNN without
    autotuning, NCHW, zero_grad after the forward pass, no loss read back per batch. The
    ``batches`` come from the guide's own DataLoader. ``warmup_steps`` untimed, then ``steps``
    timed, the device synchronized before each clock reading."""
    model, device = task.model.train(), ctx.device
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    autotune = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # PyTorch's default, which the guide keeps
    set_tf32(matmuls=False, convolutions=True)  # PyTorch's defaults: the guide's "fp32" convolutions are TF32

    def train(n):
        for images, labels in islice(batches, n):
            images, labels = images.to(device), labels.to(device)
            outputs = model(images)
            loss = loss_fn(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        synchronize(device)
    try:
        start = time.perf_counter()
        train(warmup_steps)
        warmup_s = time.perf_counter() - start
        start = time.perf_counter()
        train(steps)
        seconds = time.perf_counter() - start
    finally:
        torch.backends.cudnn.benchmark = autotune
    return StepTiming(steps * args.batch_size / seconds, warmup_s, GUIDE_PRECISION[device.type])
