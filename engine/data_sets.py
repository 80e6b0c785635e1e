"""The data sets the loaders serve: InMemoryImages, images in memory (or memory-mapped from the
image cache), each item prepared as engine/preprocessing.py says (the device loader and the
DataLoader); FileImages, image files that DALI reads and decodes itself (--loader dali).
"""

import numpy as np
import torch
from torch.utils.data import Dataset

from engine.preprocessing import centre_crop, normalization, normalize, transformed


class InMemoryImages(Dataset):
    """Images (N, H, W, C), uint8 or float32, in memory (or memory-mapped), and labels (N,);
    items are (float32 tensor (C, H, W), int), prepared as ``prep`` (a Preprocessing) says.

    A key is an index (no augmentation: test images, the guide's plain use) or, from
    AugmentSampler, (index, seed): ``transform`` (recipe.loader_transforms) with the image's
    draws seeded by ``seed``. No worker process draws random numbers of its own.
    """

    def __init__(self, images, labels, prep, rows=None, transform=None):
        self.source, self.source_labels, self.prep, self.transform = images, labels, prep, transform
        self.rows = rows  # None, or the indices into ``images`` of a subset (a held-out split)
        self.labels = labels if rows is None else np.asarray(labels)[rows]
        stored = torch.uint8 if images.dtype == np.uint8 else torch.float32
        self.scale_shift = normalization(prep.mean, prep.std, stored)  # float32 (C,) each

    @property
    def images(self):
        """The images (N, H, W, C): the array itself, or a copy of a subset's rows."""
        return self.source if self.rows is None else self.source[self.rows]

    @property
    def nbytes(self):
        return len(self) * self.source[0].nbytes

    def with_prep(self, prep):
        """The same images, prepared as ``prep`` says (no copy)."""
        return InMemoryImages(self.source, self.source_labels, prep, self.rows)

    def with_transform(self, transform):
        """The same images, training keys (index, seed) transformed by ``transform`` (no copy)."""
        return InMemoryImages(self.source, self.source_labels, self.prep, self.rows, transform)

    def subset(self, rows):
        """The images at ``rows`` (indices into this set) of a held-out split, without a copy."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows if self.rows is None else self.rows[rows]
        return InMemoryImages(self.source, self.source_labels, self.prep, rows)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, None)
        row = index if self.rows is None else self.rows[index]
        image = torch.from_numpy(np.array(self.source[row])).permute(2, 0, 1)  # (C, H, W): a copy, out of the map
        if seed is not None and self.transform is not None:  # a training image
            image = transformed(image, self.transform, seed)
        image = centre_crop(image.permute(1, 2, 0)[None], self.prep.image_shape[:2])  # (1, h, w, C); test images
        return normalize(image, *self.scale_shift)[0].contiguous(), int(self.labels[index])


class FileImages:
    """Image files (absolute paths) and int64 labels (N,), prepared as ``prep`` (a Preprocessing)
    says: what engine.data_sets.InMemoryImages is to the other loaders, for --loader dali, which reads
    and decodes the files itself."""

    def __init__(self, files, labels, prep):
        self.files, self.labels, self.prep = [str(f) for f in files], np.asarray(labels, dtype=np.int64), prep

    @property
    def nbytes(self):
        """What the images would take decoded at their stored size (uint8): what the cache would hold."""
        return len(self) * int(np.prod(self.prep.stored)) * self.prep.image_shape[2]

    def with_prep(self, prep):
        return FileImages(self.files, self.labels, prep)

    def subset(self, rows):
        """The images at ``rows`` (indices into this set) of a held-out split."""
        return FileImages([self.files[i] for i in rows], self.labels[np.asarray(rows, dtype=np.int64)], self.prep)

    def __len__(self):
        return len(self.labels)
