"""Seeds: every random stream is a function of (--seed, epoch, rank, stream), never of what
ran before, so a resumed run repeats the uninterrupted one.
"""

import numpy as np
import torch

def derived_seed(*values):
    """A 63-bit seed from integers such as (seed, epoch, rank): statistically independent
    streams for different tuples (numpy's SeedSequence), the same on every machine."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, dtype=np.uint64)[0] >> 1)


def epoch_seed(seed, epoch, rank):
    """Seed of the global RNG (dropout) for one epoch on one rank, so a run resumed at an epoch
    boundary repeats the uninterrupted one exactly. The loaders seed their augmentation
    themselves, also from (seed, epoch, ...)."""
    return derived_seed(seed, epoch, rank)


def rng_snapshot(loader=None):
    """This rank's random states for a mid-epoch checkpoint, and where ``loader`` is in its epoch
    when it can say (a DALI loader's position(): its own generators and reader)."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "loader": loader.position() if hasattr(loader, "position") else None}


def resumed_steps(loader, snapshot, steps):
    """Resuming after ``steps`` steps of an epoch: ``steps`` when ``loader`` goes on from the
    position in this rank's ``snapshot`` itself, else 0 (the loop draws those batches and skips
    them; a snapshot of another number of ranks is None)."""
    position = (snapshot or {}).get("loader")
    return steps if steps and hasattr(loader, "resume") and loader.resume(position) else 0


def restore_rng(snapshot):
    torch.set_rng_state(snapshot["cpu"].cpu())
    if snapshot["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(snapshot["cuda"].cpu())


