"""dataset_utils.py and engine/data_formats.py on CIFAR-100: reading its format, transforms, errors,
download, sharding. The other data sets: test_datasets.py."""

import io
import pickle
import tarfile
import urllib.error
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
import torchvision

import dataset_utils as du
import recipe
from engine import data_formats, errors
from conftest import run_main, write_cifar100


def test_reader_matches_torchvision(cifar_dir, monkeypatch):
    # torchvision checks the official md5 sums, which a tiny data set cannot match.
    monkeypatch.setattr(torchvision.datasets.CIFAR100, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: True)
    for split in ("train", "test"):
        images, labels = data_formats.read_split(cifar_dir, split, du.CIFAR100)
        reference = torchvision.datasets.CIFAR100(str(cifar_dir), train=split == "train", download=False)
        assert images.dtype == np.uint8 and images.shape == reference.data.shape
        np.testing.assert_array_equal(images, reference.data)
        assert labels.tolist() == reference.targets


def test_evaluation_images_are_only_normalized(cifar_dir):
    _, test_set = du.build_datasets(cifar_dir)
    images, _ = data_formats.read_split(cifar_dir, "test", du.CIFAR100)
    mean, std = torch.tensor(du.CIFAR100.mean)[:, None, None], torch.tensor(du.CIFAR100.std)[:, None, None]
    for index in (0, 7):
        expected = (torch.from_numpy(images[index]).permute(2, 0, 1).float() / 255 - mean) / std
        first, second = test_set[index][0], test_set[index][0]
        torch.testing.assert_close(first, expected)
        assert torch.equal(first, second)


def test_training_images_are_flipped_and_padded_crops(cifar_dir):
    train_set, _ = du.build_datasets(cifar_dir)
    images = data_formats.read_split(cifar_dir, "train", du.CIFAR100)[0]
    image = torch.from_numpy(images[3]).permute(2, 0, 1).float() / 255
    padded = torch.nn.functional.pad(image, (4, 4, 4, 4))  # zero padding, as RandomCrop(padding=4)
    candidates = [(dy, dx, flip) for dy in range(9) for dx in range(9) for flip in (False, True)]
    mean, std = torch.tensor(du.CIFAR100.mean)[:, None, None], torch.tensor(du.CIFAR100.std)[:, None, None]
    train_set = train_set.with_transform(recipe.loader_transforms(train_set.prep))  # what the DataLoader serves
    sampler = du.AugmentSampler([3], len(train_set), 0)  # what the training loader asks for
    seen = set()
    for epoch in range(40):
        sampler.set_epoch(epoch)
        [key] = list(sampler)
        sample = train_set[key][0] * std + mean
        matches = [c for c in candidates
                   if torch.allclose(sample, _crop(padded, *c), atol=1e-5)]
        assert matches, "a training image is not a flipped/cropped version of the original"
        seen.add(matches[0])
    assert len(seen) > 10  # it really is random


def _crop(padded, dy, dx, flip):
    crop = padded[:, dy:dy + 32, dx:dx + 32]
    return crop.flip(-1) if flip else crop


def test_truncated_file_is_named(cifar_dir):
    path = cifar_dir / "cifar-100-python" / "train"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(errors.DatasetError, match="train is truncated or corrupted") as info:
        data_formats.read_split(cifar_dir, "train", du.CIFAR100)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_wrongly_shaped_data_is_reported(tmp_path):
    root = write_cifar100(tmp_path)
    path = root / "cifar-100-python" / "test"
    entry = pickle.loads(path.read_bytes(), encoding="latin1")
    entry["data"] = entry["data"][:, :1000]
    path.write_bytes(pickle.dumps(entry, protocol=2))
    with pytest.raises(errors.DatasetError, match=r"corrupted: expected uint8 data of shape \(N, 3072\)"):
        data_formats.read_split(root, "test", du.CIFAR100)


def test_missing_data_without_download_says_what_to_run(tmp_path):
    with pytest.raises(errors.DatasetError) as info:
        data_formats.prepare(tmp_path / "nothing", du.CIFAR100, download=False)
    assert f"python dataset_utils.py --dataset cifar100 --data-dir {tmp_path / 'nothing'}" in str(info.value)
    assert not (tmp_path / "nothing").exists()  # nothing created for a failed run


def test_failed_download_is_one_clear_line_and_leaves_nothing_behind(tmp_path, monkeypatch):
    def offline(url, root, filename, md5):
        (du.Path(root) / filename).write_bytes(b"the first bytes")  # a partial archive
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torchvision.datasets.utils, "download_url", offline)
    with pytest.raises(errors.DatasetError) as info:
        data_formats.prepare(tmp_path / "new" / "datasets", du.CIFAR100, download=True)
    message = str(info.value)
    assert message.startswith(f"CIFAR-100 not found in {tmp_path / 'new' / 'datasets' / 'cifar-100-python'} and "
                              "downloading it failed")
    assert "name resolution" in message and "login node" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []  # no empty datasets/ folder, no partial archive
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(errors.DatasetError):
        data_formats.prepare(tmp_path / "mine", du.CIFAR100, download=True)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]  # what was there stays


def test_a_missing_file_is_named(cifar_dir):
    (cifar_dir / "cifar-100-python" / "meta").unlink()
    folder = cifar_dir / "cifar-100-python"
    with pytest.raises(errors.DatasetError, match=f"^CIFAR-100 in {folder} is incomplete: "
                                                        "meta missing; fetch it first with: python dataset_utils.py"):
        data_formats.prepare(cifar_dir, du.CIFAR100, download=False)


def _fake_archive(tmp_path):
    """The official archive's layout, built from a tiny data set."""
    source = write_cifar100(tmp_path / "source", n_train=16, n_test=8)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.add(source / "cifar-100-python", arcname="cifar-100-python")
    return buffer.getvalue()


def test_download_unpacks_into_place_and_keeps_existing_files(tmp_path, monkeypatch):
    archive = _fake_archive(tmp_path)
    calls = []

    def fake_download(url, root, filename, md5):
        calls.append(url)
        (du.Path(root) / filename).write_bytes(archive)
    monkeypatch.setattr(torchvision.datasets.utils, "download_url", fake_download)
    root = tmp_path / "datasets"
    (root / "cifar-100-python").mkdir(parents=True)
    ours = pickle.dumps({"fine_label_names": [f"ours_{i}" for i in range(100)]}, protocol=2)
    (root / "cifar-100-python" / "meta").write_bytes(ours)
    data_formats.prepare(root, du.CIFAR100, download=True)
    assert calls == [torchvision.datasets.CIFAR100.url]
    assert (root / "cifar-100-python" / "meta").read_bytes() == ours
    assert [len(data_formats.read_split(root, split, du.CIFAR100)[1]) for split in ("train", "test")] == [16, 8]
    assert sorted(p.name for p in root.iterdir()) == ["cifar-100-python"]  # no archive, no temporary folder
    data_formats.prepare(root, du.CIFAR100, download=True)
    assert len(calls) == 1  # present: not downloaded again


def test_only_global_rank_0_fetches_and_the_data_set_is_built_once(cifar_dir, monkeypatch):
    prepared, reads = [], Counter()
    real_prepare, real_read = data_formats.prepare, data_formats.read_split
    # dataset_utils imports them from engine/data_formats.py where a run reads files: patched there.
    monkeypatch.setattr(data_formats, "prepare", lambda *a: prepared.append(a) or real_prepare(*a))
    monkeypatch.setattr(data_formats, "read_split",
                        lambda root, split, spec: reads.update([split]) or real_read(root, split, spec))
    du.load_cifar100(8, data_dir=cifar_dir, rank=1, world_size=2)
    assert prepared == [] and reads == Counter(train=1, test=1)
    du.load_cifar100(8, data_dir=cifar_dir, rank=0, world_size=2)
    assert len(prepared) == 1 and reads == Counter(train=2, test=2)


@pytest.mark.parametrize("length", [40, 41])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_sampler_covers_every_index_once(length, world_size):
    shards = [list(du.ShardSampler(length, rank, world_size)) for rank in range(world_size)]
    assert sorted(i for shard in shards for i in shard) == list(range(length))
    assert sum(len(du.ShardSampler(length, r, world_size)) for r in range(world_size)) == length


def test_every_test_image_is_evaluated_once_across_ranks(tmp_path):
    root = write_cifar100(tmp_path, n_train=64, n_test=41)
    seen = []
    for rank in range(2):
        _, test_loader = du.load_cifar100(8, data_dir=root, rank=rank, world_size=2)
        seen += [label for _, labels in test_loader for label in labels.tolist()]
    # 41: no image dropped or repeated
    assert sorted(seen) == sorted(data_formats.read_split(root, "test", du.CIFAR100)[1].tolist())


def _epoch_indices(loader, epoch):
    du.set_loader_epoch(loader, epoch)
    return [key[0] for key in loader.sampler]  # keys are (index, top, left, flip)


def test_training_shards_are_disjoint_and_reshuffled_each_epoch(cifar_dir):
    loaders = [du.load_cifar100(8, data_dir=cifar_dir, rank=r, world_size=2, seed=5)[0] for r in range(2)]
    epoch0 = [_epoch_indices(loader, 0) for loader in loaders]
    assert sorted(epoch0[0] + epoch0[1]) == list(range(64))
    assert [len(loader) for loader in loaders] == [4, 4]  # same number of steps on every rank
    epoch1 = [_epoch_indices(loader, 1) for loader in loaders]
    assert epoch1 != epoch0
    again = du.load_cifar100(8, data_dir=cifar_dir, rank=0, world_size=2, seed=5)[0]
    assert _epoch_indices(again, 0) == epoch0[0]  # same seed and epoch: same order
    other = du.load_cifar100(8, data_dir=cifar_dir, rank=0, world_size=2, seed=6)[0]
    assert _epoch_indices(other, 0) != epoch0[0]


def test_guide_call_still_works(cifar_dir):
    train_loader, test_loader = du.load_cifar100(batch_size=16, num_workers=0, data_dir=cifar_dir)
    images, labels = next(iter(train_loader))
    assert images.shape == (16, 3, 32, 32) and images.dtype == torch.float32 and labels.shape == (16,)
    assert sum(len(labels) for _, labels in test_loader) == 40


def test_synthetic_data_has_cifar_shape_and_is_reproducible():
    images, labels = du.synthetic_split("train", seed=3)
    assert images.shape == (50_000, 32, 32, 3) and images.dtype == np.uint8
    assert labels.shape == (50_000,) and 0 <= labels.min() and labels.max() < 100
    np.testing.assert_array_equal(du.synthetic_split("test", seed=3)[0], du.synthetic_split("test", seed=3)[0])
    assert not np.array_equal(du.synthetic_split("test", seed=3)[0], du.synthetic_split("test", seed=4)[0])
    # Drawn as 64-bit words: every byte of a word takes every value (a sign bit left out would
    # keep each 8th byte under 128), and a shape of a size no multiple of 8 bytes comes whole.
    pixels = images.reshape(-1)
    assert [int(pixels[k::8].max()) for k in range(8)] == [255] * 8 and abs(pixels.mean() - 127.5) < 0.5
    odd = replace(du.CIFAR100, image_shape=(5, 5, 1), split_sizes={"train": 3, "test": 2})
    assert du.synthetic_split("train", spec=odd)[0].shape == (3, 5, 5, 1)


def test_fetch_command_checks_present_data(cifar_dir, capsys):
    assert run_main("dataset_utils.py", "--data-dir", cifar_dir) == 0
    assert "64 training and 40 test images" in capsys.readouterr().out
    (cifar_dir / "cifar-100-python" / "test").write_bytes(b"\x80\x02}q")  # truncated pickle
    assert run_main("dataset_utils.py", "--data-dir", cifar_dir) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "test is truncated or corrupted" in err

