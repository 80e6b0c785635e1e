"""--loader dali: NVIDIA DALI reads an image folder's files and decodes, crops, flips and
normalizes them (recipe.dali_images says how), on the GPU ("mixed": nvJPEG, the hardware JPEG
decoder where there is one) or, without one, on CPU threads. No decoded copy on disk.

The project, not DALI, decides the order and the shards: each epoch's files of this rank come
from a DistributedSampler seeded by (seed, epoch), the same as the other loaders' order, cut to
whole batches (every rank takes the same number of steps); validation takes images rank,
rank + world_size, ... (each counted once). Each epoch builds its own pipeline, seeded by (seed,
epoch, rank), so an epoch's batches depend on nothing before it: a run resumed at an epoch
boundary repeats the uninterrupted one. A stop mid-epoch keeps each rank's DALI checkpoint (its
reader's place, its generators' states) in the project's checkpoint, and the resumed run goes
on from there without decoding the batches already trained on. The draws depend on the rank:
resumed on another number of processes, the epoch's batches already trained on are drawn again
and skipped, and the crops differ from the uninterrupted run's (the other loaders' do not).
"""

import importlib.util

import torch
from torch.utils.data.distributed import DistributedSampler

from engine.memory import DEVICE_DATA_FRACTION
from engine.errors import UserError, size_text
from engine.seeds import derived_seed

DALI_STREAM = 2**31 - 5  # (seed, epoch, rank, DALI_STREAM): the pipeline's seed, apart from the other streams
PREFETCH = 2  # batches DALI prepares ahead of the one trained on


def dali_installed():
    """Whether nvidia.dali can be imported (without importing it: that takes a second)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:  # no nvidia namespace at all
        return False


def dali_package(cuda_version=torch.version.cuda):
    """The pip package of DALI for this PyTorch's CUDA (12 or 13; 13 for a CPU-only build)."""
    major = int(cuda_version.split(".")[0]) if cuda_version else 13
    return f"nvidia-dali-cuda{120 if major < 13 else 130}"


def check_dali():
    """UserError in one line when DALI is not installed."""
    if not dali_installed():
        raise UserError(f"--loader dali needs NVIDIA DALI, which is not installed: pip install {dali_package()} "
                        "(NVIDIA's PyTorch containers have it), or use --loader auto")


def epoch_rows(size, rank, world_size, seed, epoch, batch_size):
    """This rank's rows (indices into the training files) of ``epoch``: DistributedSampler's
    shuffle by (seed, epoch), sharded by rank, cut to whole batches of ``batch_size``."""
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    sampler.set_epoch(epoch)
    rows = list(sampler)
    return rows[:len(rows) // batch_size * batch_size]


class DaliLoader:
    """Batches of (images float32 (B, C, H, W), labels int64 (B,)) on ``device`` from image files
    ``files`` with ``labels``, prepared by ``graph`` (recipe.dali_images) for ``dataset.prep``.
    Training (``augmented``): each epoch's shuffled rows (epoch_rows), whole batches only.
    Evaluation: this rank's share, in order, the last batch partial. ``threads``: DALI's CPU
    threads (reading, and decoding without a GPU)."""

    num_workers = 0  # for the start-up block: DALI's threads, not worker processes

    def __init__(self, dataset, batch_size, graph, device, augmented, *, rank=0, world_size=1, seed=0, threads=1):
        self.dataset, self.batch_size, self.graph, self.device = dataset, batch_size, graph, device
        self.augmented, self.rank, self.world_size, self.seed, self.threads = augmented, rank, world_size, seed, threads
        self.epoch, self.batches, self.restore = 0, None, None  # the epoch's DALI iterator; a checkpoint to resume

    def set_epoch(self, epoch):
        self.epoch = epoch

    def position(self):
        """Where the epoch in progress is, after the batches handed out so far: DALI's checkpoint
        (its reader's place and its generators' states: about 500 bytes), or None."""
        return None if self.batches is None else {"epoch": self.epoch, "dali": self.batches.checkpoints()[0]}

    def resume(self, position):
        """Make the next iteration go on from ``position`` (position() of this epoch, rank and number
        of ranks): True, or False when there is none for this epoch (then skip the batches)."""
        usable = bool(position) and position.get("epoch") == self.epoch
        self.restore = position["dali"] if usable else None
        return usable

    def rows(self):
        """The rows of the data set this rank serves in this epoch, in order."""
        if self.augmented:
            return epoch_rows(len(self.dataset), self.rank, self.world_size, self.seed, self.epoch, self.batch_size)
        return list(range(self.rank, len(self.dataset), self.world_size))

    def __len__(self):
        full, rest = divmod(len(self.rows()), self.batch_size)
        return full + (rest > 0)

    def __iter__(self):
        rows = self.rows()
        # The previous pipeline goes before the next is built (its loop has dropped its generator by
        # now): its buffers return to DALI's memory pool for the new one, instead of both being held.
        self.batches = None
        if not rows:
            return
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy  # installed: check_dali
        checkpoint, self.restore = self.restore, None
        pipe = self.pipeline([self.dataset.files[i] for i in rows], [int(self.dataset.labels[i]) for i in rows],
                             checkpoint)
        # Restored from a checkpoint, the iterator hands out the rest of the epoch only.
        batches = self.batches = DALIGenericIterator(pipe, ["images", "labels"], reader_name="reader", auto_reset=False,
                                                     last_batch_policy=LastBatchPolicy.PARTIAL)
        channels = self.dataset.prep.image_shape[2]
        try:
            for out in batches:
                # Copied by the iterator into torch tensors on DALI's device (GPU to GPU: no host copy):
                # images (B, H, W, C) float32, labels (B, 1) int32. The permute is a view: (B, C, H, W)
                # channels-last in memory, the model's layout on the GPU, as the device loader's batches.
                images = out[0]["images"]
                if images.dim() != 4 or images.shape[3] != channels:  # the shape: no sync
                    raise UserError(f"recipe.dali_images returned images of shape {tuple(images.shape[1:])}, not "
                                    f"(H, W, {channels}): end it with output_layout=\"HWC\"")
                yield images.permute(0, 3, 1, 2), out[0]["labels"].view(-1).long()
        finally:  # the epoch or evaluation is over (its loop dropped this generator): nothing to checkpoint
            if self.batches is batches:
                self.batches = None

    def pipeline(self, files, labels, checkpoint=None):
        """The pipeline of one epoch: these files in this order, seeded by (seed, epoch, rank), from
        the start or from ``checkpoint`` (position()'s)."""
        from nvidia.dali import fn, pipeline_def
        gpu = self.device.type == "cuda"

        @pipeline_def(enable_checkpointing=True)
        def images_and_labels():
            # pad_last_batch: a partial last batch is filled with its last file, which the iterator drops.
            # dont_use_mmap: plain reads, DALI's advice for network file systems (Lustre), where mapping
            # each file costs more than it saves.
            encoded, label = fn.readers.file(files=files, labels=labels, random_shuffle=False, pad_last_batch=True,
                                             dont_use_mmap=True, name="reader")
            return self.graph(encoded, self.dataset.prep, self.augmented, gpu), label.gpu() if gpu else label

        seed = derived_seed(self.seed, self.epoch, self.rank, DALI_STREAM) % 2**31
        device_id = (torch.cuda.current_device() if self.device.index is None else self.device.index) if gpu else None
        return images_and_labels(batch_size=self.batch_size, num_threads=self.threads, seed=seed, device_id=device_id,
                                 prefetch_queue_depth=PREFETCH, checkpoint=checkpoint)


def choose_dali(decoded_bytes, memory_bytes):
    """(use DALI, why) for --loader auto on a GPU with DALI installed: DALI when an image folder
    decoded (``decoded_bytes``, as the cache would hold it) would not fit in DEVICE_DATA_FRACTION
    of the GPU's ``memory_bytes``: no cache on disk, and every image decoded on the GPU."""
    fits = decoded_bytes <= DEVICE_DATA_FRACTION * memory_bytes
    why = (f"auto: the image folder decoded ({size_text(decoded_bytes)}) {'fits' if fits else 'does not fit'} in "
           f"{DEVICE_DATA_FRACTION:.0%} of the GPU's {size_text(memory_bytes)}")
    return not fits, why if fits else f"{why}: DALI decodes the files on the GPU every epoch"
