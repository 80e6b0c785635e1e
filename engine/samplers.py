"""The samplers of the DataLoader path: AugmentSampler hands each training image's seed for
the epoch to the workers with its index; ShardSampler shards the test set so that an
evaluation summed over ranks counts each image once.
"""

from torch.utils.data import Sampler

from engine.preprocessing import augmentation_seeds


class AugmentSampler(Sampler):
    """The indices of ``sampler``, as (index, seed) keys for engine.data_sets.InMemoryImages: the
    seed of the image's per-image transforms in this epoch (augmentation_seeds, a function of
    (seed, epoch, index) alone), drawn at the start of the epoch in one call, so persistent
    workers, which never see ``set_epoch``, need no RNG of their own and a resumed run, with any
    number of workers, draws what the uninterrupted one drew."""

    def __init__(self, sampler, size, seed):
        self.sampler, self.size, self.seed, self.epoch = sampler, size, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        seeds = augmentation_seeds(self.size, self.seed, self.epoch).tolist()
        return ((index, seeds[index]) for index in self.sampler)

    def __len__(self):
        return len(self.sampler)


class ShardSampler(Sampler):
    """Indices rank, rank + world_size, ...: across all ranks every index exactly once.

    Unlike DistributedSampler it never pads the shards with repeated samples, so an
    evaluation summed over ranks counts each test image once. Shards may differ in length
    by one: evaluation only all-reduces sums, so that is fine.
    """

    def __init__(self, length, rank=0, world_size=1):
        self.indices = range(rank, length, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)
