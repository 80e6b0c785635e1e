"""The two loaders: order and sharding exactly as DistributedSampler, augmentation with the
guide's distribution and pixels in each (the device loader's batched operations, torchvision's
transforms in the DataLoader), and augmentation that a restarted run repeats exactly."""

import pickle

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

import dataset_utils as du
import recipe

CPU = torch.device("cpu")
CIFAR = du.spec_preprocessing(du.CIFAR100)
MEAN = torch.tensor(CIFAR.mean).view(1, 3, 1, 1)
STD = torch.tensor(CIFAR.std).view(1, 3, 1, 1)


def indexed_sets(n_train, n_test=10, images=None, prep=CIFAR):
    """Data sets whose label is the image's index, so a batch's labels say which images it holds."""
    if images is None:
        images = np.random.default_rng(0).integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8)
    test = du.InMemoryImages(images[:n_test], np.arange(n_test), prep)
    return du.InMemoryImages(images, np.arange(n_train), prep), test


def loader_of(kind, train_set, batch_size, rank=0, world_size=1, seed=0):
    return du.build_loaders(train_set, train_set, batch_size, loader=kind, device=CPU, rank=rank,
                            world_size=world_size, seed=seed)[0]


def epoch_labels(loader, epoch):
    du.set_loader_epoch(loader, epoch)
    return [labels.tolist() for _, labels in loader]


def to_uint8(images):
    """Undo the normalization: float (B, 3, H, W) -> the uint8 pixels (B, H, W, 3) they came from."""
    return ((images * STD + MEAN) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


def randoms_for(top, left, flip, padding):
    """flip-crop's random numbers (ops, RANDOM_PER_OP) that give exactly this flip and crop offset."""
    rand = torch.full((2, recipe.RANDOM_PER_OP), 0.5, dtype=torch.float64)
    rand[0, 0] = 0.25 if flip else 0.75  # recipe.flip: mirrored when below 1/2
    rand[1, :2] = (torch.tensor([top, left], dtype=torch.float64) + 0.5) / (2 * padding + 1)  # recipe.pad_crop
    return rand


@pytest.mark.parametrize("world_size", [1, 3])
def test_device_loader_orders_and_shards_exactly_like_distributed_sampler(world_size):
    train_set, _ = indexed_sets(50)
    for epoch in (0, 1):
        shards = []
        for rank in range(world_size):
            loader = loader_of("device", train_set, 4, rank, world_size, seed=7)
            sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=7, drop_last=True)
            sampler.set_epoch(epoch)
            expected = list(sampler)[:len(loader) * 4]  # full batches only, as drop_last
            assert len(loader) == len(sampler) // 4
            batches = epoch_labels(loader, epoch)
            assert [i for batch in batches for i in batch] == expected and all(len(b) == 4 for b in batches)
            shards.append(expected)
        every = [i for shard in shards for i in shard]
        assert len(every) == len(set(every))  # no image twice in an epoch, across all ranks


def test_device_loader_order_depends_on_seed_and_epoch_only():
    train_set, _ = indexed_sets(48)
    first = epoch_labels(loader_of("device", train_set, 8, seed=1), 0)
    assert epoch_labels(loader_of("device", train_set, 8, seed=1), 0) == first
    assert epoch_labels(loader_of("device", train_set, 8, seed=1), 1) != first
    assert epoch_labels(loader_of("device", train_set, 8, seed=2), 0) != first
    assert sorted(i for batch in first for i in batch) == list(range(48))


def test_both_loaders_serve_the_same_images_in_the_same_order(cifar_dir):
    (device_train, device_test), (tv_train, tv_test) = (
        du.load_cifar100(8, data_dir=cifar_dir, loader=kind, device=CPU, rank=1, world_size=2, seed=4)
        for kind in ("device", "torchvision"))
    assert epoch_labels(device_train, 2) == epoch_labels(tv_train, 2)
    for (x, y), (x_ref, y_ref) in zip(device_test, tv_test, strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)  # evaluation: bit for bit


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_leaves_the_trained_batches_out_and_serves_the_rest_alike(workers):
    """skip_batches (a mid-epoch resume): the loader's next iteration begins at batch k without
    serving the k before it, and serves what the whole epoch served from there, augmentation
    and per-image seeds included; the iteration after it is a whole epoch again."""
    train_set, _ = indexed_sets(56)
    for kind in ("device", "torchvision"):
        loader = du.build_loaders(train_set, train_set, 8, loader=kind, device=CPU, rank=1, world_size=2, seed=3,
                                  num_workers=workers if kind == "torchvision" else 0)[0]
        du.set_loader_epoch(loader, 2)
        whole = list(loader)
        assert len(whole) == 3  # 28 images of this rank, batches of 8, the last one dropped
        assert du.skip_batches(loader, 2)
        rest = list(loader)
        assert len(rest) == 1 and torch.equal(rest[0][0], whole[2][0]) and torch.equal(rest[0][1], whole[2][1]), kind
        assert [y.tolist() for _, y in loader] == [y.tolist() for _, y in whole]
        du.skip_batches(loader, 3)  # asked, never drawn (islice(loader, 0): 0 workers start nothing) ...
        du.set_loader_epoch(loader, 2)  # ... so the next epoch is whole
        assert [y.tolist() for _, y in loader] == [y.tolist() for _, y in whole], kind
    assert not du.skip_batches([(torch.zeros(1), torch.zeros(1))], 1)  # any other loader: drawn by the caller


@pytest.mark.parametrize("augment", sorted(recipe.AUGMENTATIONS))
def test_each_loader_augments_as_asked_and_repeats_itself(augment):
    """Each loader changes the images unless --augment none, and a fresh loader (a restarted run,
    on either rank) serves epoch 1 exactly as the first did."""
    prep = du.preprocessing((32, 32, 3), CIFAR.mean, CIFAR.std, augment)
    train_set, _ = indexed_sets(48, prep=prep)
    plain = torch.from_numpy(train_set.images)
    for kind in ("device", "torchvision"):
        for rank in (0, 1):
            served = []
            for _ in range(2):
                loader = loader_of(kind, train_set, 8, rank=rank, world_size=2, seed=3)
                du.set_loader_epoch(loader, 1)
                served.append(list(loader))
            assert all(torch.equal(x, x_ref) and torch.equal(y, y_ref)
                       for (x, y), (x_ref, y_ref) in zip(*served, strict=True))
            images, order = torch.cat([x for x, _ in served[0]]), torch.cat([y for _, y in served[0]])
            assert torch.equal(to_uint8(images), plain[order]) == (augment == "none"), kind  # the others change them


def test_crop_and_flip_equal_the_guides_transforms_pixel_for_pixel():
    image = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    pil = Image.fromarray(image)
    combos = [(top, left, flip) for top in range(9) for left in range(9) for flip in (False, True)]
    rand = torch.stack([randoms_for(top, left, flip, CIFAR.padding) for top, left, flip in combos])
    batch = torch.from_numpy(image).expand(len(combos), -1, -1, -1)
    scale_shift = du.normalization(CIFAR.mean, CIFAR.std, torch.uint8)
    on_device = du.normalize(du.augment(batch, rand, CIFAR.ops, CIFAR), *scale_shift)
    references = []
    for k, (top, left, flip) in enumerate(combos):
        # The guide: RandomHorizontalFlip, then RandomCrop(32, padding=4) = pad, crop at (top, left).
        cropped = TF.crop(TF.pad(TF.hflip(pil) if flip else pil, CIFAR.padding), top, left, 32, 32)
        references.append(TF.normalize(TF.to_tensor(cropped), CIFAR.mean, CIFAR.std))
        # The same pixels (one grey level apart is 0.014 here), normalized within float32 rounding.
        torch.testing.assert_close(on_device[k], references[k], rtol=0, atol=1e-6, msg=str((top, left, flip)))
    # The DataLoader's items (torchvision's transforms, seeded per image) are among the same 162.
    dataset = du.InMemoryImages(image[None], np.zeros(1), CIFAR).with_transform(recipe.loader_transforms(CIFAR))
    for seed in range(40):
        item = dataset[(0, seed)][0]
        assert any(torch.allclose(item, reference, rtol=0, atol=1e-6) for reference in references), seed


@pytest.mark.parametrize("kind", ["device", "torchvision"])
def test_each_loaders_augmentation_has_the_guides_distribution(kind):
    """The crops' statistics: each loader's offsets uniform within the padding, half flipped, zeros
    where the crop shows padding; the two loaders draw alike, not the same crops."""
    # Pixel (r, c) holds (r + 1, c + 1, 0): every output pixel says where it came from, 0 = padding.
    n, size = 5_000, 32
    rows, cols = np.meshgrid(np.arange(1, size + 1), np.arange(1, size + 1), indexing="ij")
    image = np.stack([rows, cols, np.zeros_like(rows)], axis=-1).astype(np.uint8)
    train_set, _ = indexed_sets(n, images=np.tile(image, (n, 1, 1, 1)))
    out = torch.cat([to_uint8(x) for x, _ in loader_of(kind, train_set, 500, seed=5)]).long()  # (n, 32, 32, 3)
    assert len(out) == n
    # The centre pixel always comes from the image: it gives the crop offset in the padded image.
    src_row, src_col = out[:, 16, 16, 0] - 1, out[:, 16, 16, 1] - 1
    flipped = out[:, 16, 17, 1] < out[:, 16, 16, 1]
    top = src_row - 16 + CIFAR.padding
    # Flipped: output column j shows source column (31 - (left - PADDING) - j).
    left = torch.where(flipped, 31 - 16 + CIFAR.padding - src_col, src_col - 16 + CIFAR.padding)
    for offset in (top, left):
        counts = torch.bincount(offset, minlength=9).double()
        assert len(counts) == 9  # nothing outside 0..8
        chi2 = ((counts - n / 9) ** 2 / (n / 9)).sum().item()
        assert chi2 < 37.0  # uniform over 0..8 (8 degrees of freedom, p = 1e-5)
    assert abs(flipped.double().mean().item() - 0.5) < 5 * 0.5 / n**0.5  # 5 standard deviations
    # Zero padding: a crop offset by d rows from the centre shows |d| rows of zeros.
    zero_rows = (out[..., 0] == 0).all(dim=2).sum(dim=1)
    assert torch.equal(zero_rows, (top - CIFAR.padding).abs())


def test_device_augmentation_is_a_function_of_seed_and_epoch():
    """What makes a mid-epoch resume exact: a fresh loader (a restarted run) serves epoch 2
    exactly as a loader that has already served epochs 0 and 1."""
    train_set, _ = indexed_sets(40)
    used = loader_of("device", train_set, 8, seed=9)
    for epoch in (0, 1):
        epoch_labels(used, epoch)
    du.set_loader_epoch(used, 2)
    fresh = loader_of("device", train_set, 8, seed=9)
    du.set_loader_epoch(fresh, 2)
    for (x, y), (x_ref, y_ref) in zip(used, fresh, strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    du.set_loader_epoch(fresh, 1)
    other_epoch = torch.cat([x for x, _ in fresh])
    assert not torch.equal(torch.cat([x for x, _ in used]), other_epoch)


def test_torchvision_augmentation_does_not_depend_on_workers_or_restarts(cifar_dir):
    def epoch_batches(workers, skip_epochs):
        train_loader, _ = du.load_cifar100(8, workers, data_dir=cifar_dir, seed=2)
        for epoch in skip_epochs:  # persistent workers live through these epochs
            epoch_labels(train_loader, epoch)
        du.set_loader_epoch(train_loader, 2)
        return [x for x, _ in train_loader]

    rng_before = torch.get_rng_state()
    reference = epoch_batches(0, [])
    assert torch.equal(torch.get_rng_state(), rng_before)  # the dropout RNG is not consumed
    for batches in (epoch_batches(0, [0, 1]), epoch_batches(2, [0, 1])):
        assert all(torch.equal(x, x_ref) for x, x_ref in zip(batches, reference, strict=True))

    def keys(epoch):
        sampler = du.AugmentSampler(range(64), 64, 2)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert keys(1) == keys(1) != keys(2)  # each epoch augments anew
    assert [index for index, _ in keys(1)] == list(range(64)) and len({seed for _, seed in keys(1)}) == 64


def test_a_memory_mapped_cache_goes_to_a_worker_by_its_file_not_as_a_copy(tmp_path):
    """Under forkserver (Python 3.14's default start method) and spawn, the DataLoader pickles
    its data set for each worker: an image folder's memory-mapped cache (engine/image_cache.py
    maps it copy-on-write) was copied whole into every worker of both loaders."""
    images = np.random.default_rng(0).integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    path = tmp_path / "train_images.npy"
    np.save(path, images)
    train = du.InMemoryImages(np.load(path, mmap_mode="c"), np.arange(64) % 4, CIFAR).with_transform(
        recipe.loader_transforms(CIFAR))
    for dataset in (train, train.subset([3, 5, 60])):
        pickled = pickle.dumps(dataset)
        assert len(pickled) < images.nbytes / 20, len(pickled)
        received = pickle.loads(pickled)
        for key in (0, (2, 7)):  # a test image, and a training image with its seed
            assert torch.equal(received[key][0], dataset[key][0]) and received[key][1] == dataset[key][1]
        assert isinstance(received.source, np.memmap) and received.source.mode == "c"
    # Real workers of a forkserver: the same images as in this process, in the sampler's order.
    test = du.InMemoryImages(np.load(path, mmap_mode="c"), np.arange(64), CIFAR)
    served = torch.utils.data.DataLoader(test, batch_size=16, num_workers=2, multiprocessing_context="forkserver")
    assert torch.equal(torch.cat([x for x, _ in served]), torch.stack([test[i][0] for i in range(64)]))
    assert len(pickle.dumps(du.InMemoryImages(images, np.arange(64), CIFAR))) > images.nbytes  # in memory: whole
    # The cache rebuilt meanwhile (renamed into place by another run): a worker started now gets the images this
    # process maps, and one sent the file before is refused in one line, never reading other images.
    sent = pickle.loads(pickle.dumps(train))
    np.save(tmp_path / "rebuilt.npy", images[::-1])
    (tmp_path / "rebuilt.npy").replace(path)
    pickled = pickle.dumps(train)
    assert len(pickled) > images.nbytes and torch.equal(pickle.loads(pickled)[5][0], train[5][0])
    with pytest.raises(du.DatasetError, match=f"^{path} was removed or replaced while training read it"):
        sent[0]
