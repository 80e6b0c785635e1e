"""Out of memory and --accumulate: micro-batches give the weights of the whole batch (no
BatchNorm, within rounding) on 1 and 2 processes, a resume may change N, and running out of
memory anywhere is one line with what to change and the command that continues."""

import math
import re
import shutil

import pytest
import torch
from PIL import Image

from conftest import REPO, clean_env, error_lines, python_cmd, run, torchrun_cmd, write_cifar10
from tools.demo_data import write_image_folder
from engine import image_cache
from dataset_utils import choose_loader
from engine.errors import UserError
from engine.errors import OutOfMemory
from engine.memory import Measured, StepShape, host_memory, is_out_of_memory, probe_step, training_bytes
from engine.out_of_memory import suggested_accumulate
from device_utils import Precision

OOM_MODEL = ("--model", f"{REPO / 'tests' / 'oom_net.py'}:Net")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_cifar10(tmp_path_factory.mktemp("data"), n_train=80, n_test=20)


def train_args(data, *extra):
    return ("--dataset", "cifar10", "--data-dir", str(data), "--no-download", *OOM_MODEL, "--batch-size", "16",
            "--epochs", "1", "--precision", "fp32", "--augment", "none", "--label-smoothing", "0", *extra)


@pytest.fixture(scope="module")
def accumulated(data, tmp_path_factory):
    """The folder of four 2-epoch runs of the same recipe, their weights in NAME.pt: whole (one
    step of 16 images, checkpoints in ck/), micro (two micro-batches of 8), ddp (2 processes,
    two micro-batches of 4 each), and resumed (the whole run's checkpoint of epoch 1 continued
    with micro-batches of 4)."""
    folder = tmp_path_factory.mktemp("accumulate")
    runs = {"whole": python_cmd("train.py", *train_args(data, "--checkpoint-dir", "ck", "--checkpoint-interval", "0")),
            "micro": python_cmd("train.py", *train_args(data, "--accumulate", "2")),
            "ddp": torchrun_cmd(2, "train_ddp.py", *train_args(data, "--accumulate", "2"))}
    for name, command in runs.items():
        result = run([*command, "--epochs", "2", "--save-weights", f"{name}.pt"], cwd=folder)
        assert result.returncode == 0, f"{name}: {result.stderr}"
    assert "Batch Size: 16 (4 per micro-batch x 2 accumulated x 2 CPU processes" in result.stdout
    checkpoints = sorted((folder / "ck").glob("checkpoint_*.pt"))
    (folder / "after-epoch-1").mkdir()
    shutil.copy(checkpoints[0], folder / "after-epoch-1")
    resumed = run(python_cmd("train.py", *train_args(data, "--checkpoint-dir", "after-epoch-1", "--resume", "--epochs",
                                                     "2", "--accumulate", "4", "--save-weights", "resumed.pt")),
                  cwd=folder)
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming from after-epoch-1/{checkpoints[0].name}" in resumed.stdout and "Epoch 2/2" in resumed.stdout
    return folder


@pytest.mark.oldest_torch
@pytest.mark.parametrize("name, micro_batch", [("micro", 8), ("ddp", 4), ("resumed", 4)])
def test_accumulated_micro_batches_give_the_weights_of_the_whole_batch(accumulated, name, micro_batch):
    """Each run trained on its micro-batches (the model saw batches of that size), and ends in
    the weights of the whole batch's run, within rounding: one process, two processes, and a
    resume that changed --accumulate."""
    whole, other = (torch.load(accumulated / f"{run_name}.pt", weights_only=True) for run_name in ("whole", name))
    assert (int(whole.pop("last_batch")), int(other.pop("last_batch"))) == (16, micro_batch)
    assert whole.keys() == other.keys() and all(torch.allclose(whole[k], other[k], atol=1e-5) for k in whole), name


def test_micro_batches_must_split_the_batch_evenly(data, tmp_path):
    result = run(python_cmd("train.py", *train_args(data, "--accumulate", "3")), cwd=tmp_path)
    assert result.returncode == 2 and error_lines(result.stderr) == [
        "error: --accumulate 3 does not split the 16 images per process (--batch-size 16 over 1) into equal "
        "micro-batches; use a divisor of 16"]


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_out_of_memory_in_a_later_step_is_one_line_and_its_command_continues(data, tmp_path, kind):
    args = train_args(data, "--checkpoint-dir", "ck", "--checkpoint-interval", "0", "--epochs", "3")
    env = clean_env(OOM_AT="train:7", OOM_KIND=kind)  # 5 steps per epoch: step 2 of epoch 2
    result = run(python_cmd("train.py", *args), cwd=tmp_path, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert re.fullmatch(
        r"error: out of memory at step 2 of epoch 2 \(training\) on cpu \(\d+\.\d GiB, this process's peak \d+\.\d "
        r"GiB\) with micro-batches of 16 images of 32x32; try, in this order: --accumulate 2 \(micro-batches of 8; "
        r"the recipe is unchanged\); then a smaller --model\. The last checkpoint, "
        r"ck/checkpoint_000000005\.pt, continues with: python train\.py .* --accumulate 2 --resume", line), line
    command = line.split("continues with: ")[1].split()
    resumed = run(python_cmd(*command[1:]), cwd=tmp_path)  # without OOM_AT: memory is back
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming from ck/checkpoint_000000005.pt" in resumed.stdout and "Epoch 3/3" in resumed.stdout


def test_out_of_memory_in_the_first_step_and_in_evaluation(data, tmp_path):
    first = run(python_cmd("train.py", *train_args(data)), cwd=tmp_path, env=clean_env(OOM_AT="train:1"))
    assert first.returncode == 1
    (line,) = error_lines(first.stderr)
    assert "out of memory at step 1 of epoch 1 (training)" in line and "--accumulate 2" in line
    assert line.endswith("Nothing was saved (no --checkpoint-dir)")
    evaluation = run(python_cmd("train.py", *train_args(data)), cwd=tmp_path, env=clean_env(OOM_AT="eval:1"))
    assert evaluation.returncode == 1
    (line,) = error_lines(evaluation.stderr)
    assert "out of memory at batch 1 of evaluation after epoch 1 on cpu" in line


@pytest.mark.oldest_torch
def test_out_of_memory_on_every_rank_is_one_line_for_the_job(data, tmp_path):
    result = run(torchrun_cmd(2, "train_ddp.py", *train_args(data, "--checkpoint-dir", "ck")), cwd=tmp_path,
                 env=clean_env(OOM_AT="train:2"))
    assert result.returncode == 1
    lines = error_lines(result.stdout + result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: out of memory at step 2 of epoch 1 (training)")


@pytest.mark.oldest_torch
def test_an_error_on_one_rank_is_its_line_alone(data, tmp_path):
    """Rank 1 alone runs out of memory and exits with its line; rank 0, which loses it in the
    gradient all-reduce, sees on this node that rank 1 exited by itself and adds nothing."""
    result = run(torchrun_cmd(2, "train_ddp.py", *train_args(data, "--checkpoint-dir", "ck")), cwd=tmp_path,
                 env=clean_env(OOM_AT="train:2", OOM_RANK="1"))
    assert result.returncode == 1
    lines = error_lines(result.stdout + result.stderr)
    assert len(lines) == 1 and lines[0].startswith("[rank 1] error: out of memory at step 2 of epoch 1 (training)")


def test_the_suggested_accumulate_is_estimated_from_the_peak():
    gib = 2**30
    assert suggested_accumulate(1, 256, peak=30 * gib, total=80 * gib, steps_done=True) == 2
    assert suggested_accumulate(1, 256, peak=150 * gib, total=80 * gib, steps_done=True) == 4  # 2.2 -> a divisor
    assert suggested_accumulate(2, 128, peak=0, total=80 * gib, steps_done=False) == 4  # nothing measured: double
    assert suggested_accumulate(1, 3, peak=500 * gib, total=80 * gib, steps_done=True) == 3  # at most the batch


def _raised_from(cause, error):
    try:
        raise error from cause
    except Exception as err:
        return err


@pytest.mark.parametrize("error, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (MemoryError(), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), True),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    # torch.compile's BackendCompilerFailed (a RuntimeError) with the allocator's message inside
    (RuntimeError("backend='inductor' raised:\nOutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB"),
     True),
    (_raised_from(torch.OutOfMemoryError("CUDA out of memory."), ValueError("the step failed")), True),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), False),
    (ValueError("can't allocate memory"), False),  # not an error a library raises for memory
])
def test_every_form_of_out_of_memory_is_recognised(error, expected):
    assert is_out_of_memory(error) is expected


def test_an_error_raised_while_handling_an_out_of_memory_is_its_own():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except torch.OutOfMemoryError:
            raise KeyError("a bug in the handler")
    except KeyError as err:
        assert not is_out_of_memory(err)


def test_out_of_memory_in_predict_is_one_line(tmp_path):
    write_image_folder(tmp_path / "images", classes=2, n_train=8, n_test=4, sizes=((16, 16),))
    trained = run(python_cmd("train.py", "--dataset", "folder", "--data-dir", "images", "--cache-dir", "cache",
                             *OOM_MODEL, "--batch-size", "8", "--epochs", "1", "--save-weights", "w.pt"), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    result = run(python_cmd("predict.py", "--weights", "w.pt", *OOM_MODEL, "images/test", "--output", "p.csv"),
                 cwd=tmp_path, env=clean_env(OOM_AT="eval:1"))
    assert result.returncode == 1 and not (tmp_path / "p.csv").exists()
    assert error_lines(result.stderr) == ["error: out of memory classifying 8 images of [16, 16] pixels on cpu; use a "
                                          "smaller --batch-size (now 64)"]


def test_loader_auto_counts_training_and_the_loaders_batch_in_the_free_memory():
    gb = 1e9  # 85% of 80 GB is 68 GB
    alone = Measured(training=50 * gb, free=80 * gb, total=80 * gb)
    assert choose_loader("auto", 10 * gb, 80 * gb, alone, 1 * gb) == (
        "device", "auto: the data set (10 GB), training (50 GB, measured) and the device loader's batch (1.00 GB) "
                  "fit together in 85% of the device's free 80 GB (of 80 GB)")
    # The same on a GPU where another process holds 10 GB: the free memory decides, not the total.
    shared = alone._replace(free=70 * gb)
    assert choose_loader("auto", 10 * gb, 80 * gb, shared, 1 * gb) == (
        "torchvision", "auto: the data set (10 GB), training (50 GB, measured) and the device loader's batch "
                       "(1.00 GB) do not fit together in 85% of the device's free 70 GB (of 80 GB)")
    # The loader's own batch tips it: 10 + 50 + 8 fits in 68, 10 + 50 + 8.5 does not.
    assert choose_loader("auto", 10 * gb, 80 * gb, alone, 8 * gb)[0] == "device"
    assert choose_loader("auto", 10 * gb, 80 * gb, alone, 8.5 * gb)[0] == "torchvision"
    # The data set alone would fit in a quarter of the memory, not beside training:
    assert choose_loader("auto", 10 * gb, 80 * gb, alone._replace(training=60 * gb))[0] == "torchvision"
    assert "training (out of memory on its own) and the device loader's batch (0.0 kB) do not fit" in choose_loader(
        "auto", 1, 80 * gb, alone._replace(training=math.inf))[1]
    assert training_bytes(torch.nn.Linear(2, 2), StepShape(4, 1, (2, 2, 1)), Precision("fp32"), torch.device("cpu"),
                          torch.contiguous_format) is None  # the CPU: nothing to measure, a quarter of RAM
    # Per-image transforms need the DataLoader's workers, however much fits.
    per_image = "recipe.py's per-image TrivialAugmentWide"
    assert choose_loader("auto", 1, 80 * gb, alone, 0, per_image) == (
        "torchvision", "auto: recipe.py's per-image TrivialAugmentWide transforms each image, in the DataLoader's "
                       "workers")
    assert choose_loader("torchvision", 1, 80 * gb, alone, 0, per_image) == ("torchvision", "--loader torchvision")
    with pytest.raises(UserError, match="^recipe.py's per-image TrivialAugmentWide transforms each image on its own, "
                                        "in the DataLoader's workers: --loader device transforms whole batches; "
                                        "use --loader torchvision"):
        choose_loader("device", 1, 80 * gb, alone, 0, per_image)


class Probed(torch.nn.Module):
    """BatchNorm's running statistics, dropout's random numbers: what a probe must leave as it was."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.drop = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.norm(self.conv(x))).flatten(1)


def test_the_probe_step_leaves_no_trace():
    model, images = Probed().eval(), torch.randn(8, 3, 6, 6)
    before = ({k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state())
    probe_step(model, images, Precision("fp32"), torch.device("cpu"))
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())  # BatchNorm statistics
    assert torch.equal(torch.get_rng_state(), before[1])
    model.train()
    probe_step(model, images, Precision("bf16", torch.bfloat16), torch.device("cpu"))
    assert model.training and model.norm.num_batches_tracked.item() == 0


# Out of memory while the folder cache is decoded: a sitecustomize (loaded by every process
# whose PYTHONPATH names its folder) makes Pillow's convert() fail as it does when the node's
# memory runs out, for the one image of 61x47 pixels.
SITECUSTOMIZE = """
from PIL import Image
convert = Image.Image.convert
def failing(self, *args, **kwargs):
    if self.size == (61, 47):
        raise MemoryError()
    return convert(self, *args, **kwargs)
Image.Image.convert = failing
"""


def photos_with_a_huge_one(root):
    write_image_folder(root, classes=2, n_train=8, n_test=4, sizes=((16, 16),))
    Image.new("RGB", (61, 47)).save(root / "train" / "class_1" / "huge.png")
    return root


def test_out_of_memory_in_the_cache_build_keeps_the_earlier_cache(tmp_path, monkeypatch):
    images = photos_with_a_huge_one(tmp_path / "images")
    earlier = image_cache.prepare_folder(images, tmp_path / "cache", (16, 16), log=lambda _: None)
    namespace = {}
    exec(SITECUSTOMIZE, namespace)
    try:
        with pytest.raises(OutOfMemory) as raised:
            image_cache.prepare_folder(images, tmp_path / "cache", (24, 24), log=lambda _: None, workers=3)
    finally:
        Image.Image.convert = namespace["convert"]
    assert re.fullmatch(
        rf"out of memory decoding 25 images into the image cache in {re.escape(str(earlier.parent))} on \S+ \([\d.]+ "
        r"GiB, this process's peak [\d.]+ GiB; 3 threads each decode one image at full size, the largest 61x47 pixels"
        r"\): ask Slurm for more memory \(--mem\) or fewer cores \(--cpus-per-task: one decoding thread per core\)\. "
        r"Nothing was trained; the unfinished cache was removed and earlier ones are kept", str(raised.value))
    assert [path.name for path in earlier.parent.iterdir()] == [earlier.name]  # no half-built cache left
    assert image_cache.why_damaged(earlier) is None


@pytest.mark.parametrize("processes", [1, 2])
def test_out_of_memory_in_the_cache_build_is_one_line_for_the_job(tmp_path, processes):
    photos_with_a_huge_one(tmp_path / "images")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    args = ("--dataset", "folder", "--data-dir", "images", "--cache-dir", "cache", *OOM_MODEL, "--batch-size", "8",
            "--epochs", "1")
    command = (python_cmd("train.py", *args) if processes == 1 else  # torchrun as the job scripts run it
               python_cmd("tools/torchrun.py", "--standalone", "--nproc_per_node=2", REPO / "train_ddp.py", *args))
    result = run(command, cwd=tmp_path, env=clean_env(PYTHONPATH=tmp_path / "site"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith("error: out of memory decoding 25 images into the image cache in ") and "61x47" in line
    assert "Training" not in result.stdout and not list((tmp_path / "cache").glob("*/*"))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_host_memory_is_the_jobs_cgroup_limit(tmp_path, version):
    """Slurm's --mem is a cgroup limit on the job, often on a folder above the step's own."""
    gib = 2**30
    if version == "v2":
        (tmp_path / "proc").write_text("0::/slurm/job_7/step_0\n")
        folders = {"slurm": "max", "slurm/job_7": str(6 * gib), "slurm/job_7/step_0": "max"}
        name = "memory.max"
    else:
        (tmp_path / "proc").write_text("4:memory:/slurm/job_7/step_0\n3:cpuset:/\n")
        folders = {"memory/slurm": str(2**63 - 4096), "memory/slurm/job_7": str(6 * gib),
                   "memory/slurm/job_7/step_0": str(2**63 - 4096)}
        name = "memory.limit_in_bytes"
    for folder, value in folders.items():
        (tmp_path / "cg" / folder).mkdir(parents=True)
        (tmp_path / "cg" / folder / name).write_text(value + "\n")
    assert host_memory(tmp_path / "proc", tmp_path / "cg") == min(6 * gib, host_memory(tmp_path / "none"))
