"""The GPU tier: the paths that only CUDA and NCCL run. Skipped without a CUDA GPU. On a
machine with one, with its preinstalled PyTorch (nothing to install, no data to download):

    python -m pytest tests/test_gpu.py

Covered: training steps in every --precision, with and without channels_last, and hooks
that see the layout and dtype a step really computes in; no host sync inside a step (sync
debug mode); the device loader on CUDA against the CPU's, pixel for pixel, and the
torchvision loader with workers and pinned memory; checkpoints written on one device type
and resumed on the other, in each layout and with each side's default (re-strided momentum);
fp16 with a skipped (overflowing) first step and the fused SGD kernel; --loader dali decoding
on the GPU; --device cpu; train_ddp.py under
torchrun on NCCL with its gloo control group, the replica check, a stop and a resume; DDP on
2 GPUs (when there are 2); --compile, also with DDP; evaluation under autocast of a model that
learned; peak memory at batch 256 and 1024; NVML's power and utilization, TensorBoard and a
GPU profile; check_network.py on NCCL.
"""

import gzip
import json
import math
import os
import re
import signal
from itertools import islice

import numpy as np
import pytest
import torch

import dataset_utils as du
import recipe
import train_utils as tu
from device_utils import Precision, single_process_context
from engine.dali_loader import DaliLoader, dali_installed
from dataset_utils import FileImages, Preprocessing, batch_temporaries
from engine.memory import StepShape, device_memory, free_device_memory, training_bytes
from engine.out_of_memory import held_outside_torch
from engine import monitor, optimization, tensorboard_log
from conftest import PLAIN_MODEL, REPO, SMALL_MODEL, clean_env, python_cmd, read_metrics, start, torchrun_cmd, wait_for
from conftest import write_cifar100
from conftest import run as run_with_timeout
from test_check_network import TABLE_ROW, stop_rank_during_check
from test_resilience import _rank_pid
from tools import gpu_report
from tools.demo_data import write_photo_folder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the GPU tier needs one")

SHORT = ("--synthetic", "--epochs", "2", "--limit-batches", "3", "--batch-size", "64", "--num-workers", "0")
CPU_ONLY = clean_env(CUDA_VISIBLE_DEVICES="")  # train.py then runs on the CPU
# A few steps take well under a minute with CUDA's start-up: a hang costs --report's budget this
# long, not conftest's 300 s. The cold compiles at the end get their own.
RUN_S = 120
COLD_COMPILE_S = 600


# A GPU in an exclusive compute mode takes one process: this one, once a test here used CUDA.
EXCLUSIVE = torch.cuda.is_available() and gpu_report.compute_mode() in gpu_report.EXCLUSIVE_MODES


def needs_another_process():
    if EXCLUSIVE:
        pytest.skip(f"GPU 0 is in {gpu_report.compute_mode()} compute mode: this test starts another process on it")


def run(cmd, cwd, env=None, timeout=RUN_S):
    needs_another_process()
    return run_with_timeout(cmd, cwd, env, timeout)


def finite_run(result, metrics):
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(metrics)
    assert records and all(math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"]) for r in records)
    return records


# ---------------------------------------------------------------------------------------------
# First what is most likely to break (it has never run on a GPU), fastest first: tools/benchmark.py
# --report runs this file with the time it has left.

def _prepared_run(*flag_list):
    args = tu.parse_args("x", ["--synthetic", "--batch-size", "64", "--num-workers", "0", "--log-interval", "0",
                               *flag_list])
    ctx = single_process_context()
    task = tu.build_task(args, ctx)
    run_, state, _ = tu.prepare_run(task, args, ctx)
    return run_, iter(task.train_loader), state


@pytest.mark.parametrize("precision, layout, dtype, channels_last", [
    ("auto", "--channels-last", torch.bfloat16, True), ("fp16", "--channels-last", torch.float16, True),
    ("fp32", "--no-channels-last", torch.float32, False)])
def test_a_training_step_runs_in_the_layout_and_precision_it_reports(precision, layout, dtype, channels_last):
    """Hooks on every convolution: its input's memory layout and its output's dtype. A run
    that printed channels_last and bf16 but silently computed NCHW fp32 (in any layer) would
    pass the end-to-end tests below; it fails here."""
    run_, batches, state = _prepared_run("--precision", precision, layout)
    convs = [m for m in run_.module.modules() if isinstance(m, torch.nn.Conv2d)]
    seen = []
    for conv in convs:
        conv.register_forward_hook(lambda module, inputs, output: seen.append(
            (inputs[0].is_contiguous(memory_format=torch.channels_last), output.dtype)))
    tu.train_steps(run_, [next(batches)], state)
    assert len(convs) > 10 and seen == [(channels_last, dtype)] * len(convs)


def _sync_warnings(work):
    """The synchronizing CUDA calls that ``work()`` makes (sync debug mode)."""
    import warnings
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # Not the notice that the mode is a prototype (torch 2.11 gives it at its first use).
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


def test_no_host_sync_inside_a_training_step():
    """20 steps wait for the GPU exactly as often as 2 do, once: when the epoch's sums are read
    at the end (LossBooks.totals: the loss and image sums and the first non-finite step, in one
    read), never per step; no host-to-device copy of a Python number either."""
    run_, batches, state = _prepared_run()
    tu.train_steps(run_, [next(batches) for _ in range(3)], state)  # warm-up: autotuning, first allocations
    few = _sync_warnings(lambda: tu.train_steps(run_, [next(batches) for _ in range(2)], state))
    many = _sync_warnings(lambda: tu.train_steps(run_, [next(batches) for _ in range(20)], state))
    assert len(many) == len(few) == 1, many


def test_an_evaluation_waits_for_the_gpu_once():
    """The correct count, loss and images stay on the GPU until the end of an evaluation."""
    run_, _, _ = _prepared_run()
    batches = [(x.cuda(), y.cuda()) for x, y in islice(run_.task.test_loader, 6)]
    tu.evaluate(run_, run_.module, batches[:1])  # warm-up
    few, many = (_sync_warnings(lambda: tu.evaluate(run_, run_.module, batches[:n])) for n in (2, 6))
    assert len(many) == len(few) == 1, many


def test_loader_auto_counts_the_device_loaders_batch_and_free_memory():
    """--loader auto's figures on a real GPU: the device loader's temporaries for 256 photos at
    224 px (stored 256 px, resized crop) exceed one float32 copy of the batch (the resized crop's
    intermediates are several), and the free memory is at most the total."""
    cuda = torch.device("cuda", 0)
    prep = Preprocessing(image_shape=(224, 224, 3), mean=(0.5,) * 3, std=(0.25,) * 3, augment="resized-crop",
                         ops=recipe.AUGMENTATIONS["resized-crop"], stored_size=(256, 256), per_op=recipe.RANDOM_PER_OP)
    temporaries = batch_temporaries(prep, 256, torch.uint8, cuda)
    assert 256 * 224 * 224 * 3 * 4 < temporaries < 4 * 2**30
    assert 0 < free_device_memory(cuda) <= device_memory(cuda)


def test_cudnn_autotuning_and_the_current_device_are_set():
    ctx = single_process_context()
    assert ctx.device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    assert torch.backends.cudnn.benchmark is True


def _step(model, optimizer, scaler, factor=1.0):
    x = torch.randn(8, 3, 32, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().square().mean() * factor
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def test_fp16_with_a_skipped_first_step_trains_on_zero_momentum_not_garbage(monkeypatch):
    # Both models must run the same convolution algorithms: no autotuning (an earlier test of
    # this process may have switched it on), deterministic kernels.
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)

    def model():
        torch.manual_seed(0)
        layers = (torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 30 * 30, 10))
        return torch.nn.Sequential(*layers).cuda()
    args, cuda = tu.parse_args("x", ["--precision", "fp16"]), torch.device("cuda")
    ours = model()
    optimizer = recipe.make_optimizer(ours, args, cuda)
    assert optimizer.param_groups[0]["fused"] is True  # the kernel that returns early on a skipped step
    optimization.prefill_momentum(optimizer)  # what train_utils.prepare_run does
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    _step(ours, optimizer, scaler, factor=math.inf)  # overflow: GradScaler skips the step
    _step(ours, optimizer, scaler)
    reference = model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    _step(reference, plain, torch.amp.GradScaler("cuda", init_scale=2.0**15))  # SGD's own first step
    for a, b in zip(ours.parameters(), reference.parameters()):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_device_loader_on_cuda_serves_the_cpu_loaders_batches(tmp_path):
    data = write_cifar100(tmp_path / "data", n_train=64, n_test=40)
    loaders = {device: du.load_cifar100(16, data_dir=data, loader="device", device=device, seed=3)
               for device in ("cpu", "cuda")}
    for epoch in (0, 1):
        for device in loaders:
            du.set_loader_epoch(loaders[device][0], epoch)
        for split in (0, 1):  # training (augmented) and test batches
            batches = list(zip(loaders["cpu"][split], loaders["cuda"][split], strict=True))
            assert batches
            for (x_cpu, y_cpu), (x_gpu, y_gpu) in batches:
                # The same pixels (a grey level apart is 0.014), normalized within float32 rounding.
                assert x_gpu.is_cuda and torch.equal(y_cpu, y_gpu.cpu())
                torch.testing.assert_close(x_cpu, x_gpu.cpu(), rtol=0, atol=1e-6)


def test_network_check_on_nccl(tmp_path):
    """check_network.py on NCCL: CUDA events time it, NCCL's own log (NCCL_DEBUG=INFO into a
    temporary file) names the network it chose, and the version is the loaded library's.
    Blocking wait is in effect (PyTorch's own INFO line): NCCL's errors raise in the host's
    wait, and no watchdog aborts the process."""
    gpus = min(torch.cuda.device_count(), 2)
    (tmp_path / "tmp").mkdir()
    result = run(torchrun_cmd(gpus, "check_network.py", "--max-size", "4M", "--iters", "5"), cwd=tmp_path,
                 env=clean_env(TMPDIR=tmp_path / "tmp", TORCH_CPP_LOG_LEVEL="INFO"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created" in result.stderr
    out = result.stdout
    version = ".".join(map(str, torch.cuda.nccl.version()))  # the library this process loads
    assert f"Backend: nccl, world size {gpus}" in out and f"NCCL version: {version}" in out
    assert "Network (NCCL): not used between the GPUs of one node (NVLink/P2P); between nodes NCCL would use" in out
    assert "unknown (" not in out  # the log was written and read
    assert re.search(r"Network check passed: 13 sizes x \(5\+5\) all-reduces exact", out)
    rows = [TABLE_ROW.match(line) for line in out.splitlines() if TABLE_ROW.match(line)]
    assert len(rows) == 13 and all(float(row[4]) > 0 for row in rows)  # the time (us) of every size
    assert not list((tmp_path / "tmp").glob("check_network_*"))  # its NCCL logs are gone (torchrun's stay)


def test_a_network_nccl_cannot_open_is_one_line_naming_nccl_net(tmp_path):
    """NCCL_NET naming a network NCCL does not have (multinode_job.sh's "AWS Libfabric" without
    the plugin): NCCL refuses at start-up, and the check ends in the one line that names the
    setting, before any all-reduce, instead of NCCL's error in a traceback."""
    result = run(python_cmd("tools/torchrun.py", "--standalone", "--nproc_per_node=1", REPO / "check_network.py",
                            "--max-size", "4M", "--iters", "5"),
                 cwd=tmp_path, env=clean_env(NCCL_NET="No Such Network"))
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if "error: " in line]
    assert lines and lines[0].startswith("error: NCCL_NET=No Such Network: NCCL cannot open this network on "), lines
    assert "Network check passed" not in result.stdout


def test_network_check_on_nccl_names_a_killed_rank(tmp_path):
    """A peer lost mid-check on NCCL: with TORCH_NCCL_BLOCKING_WAIT=1 the survivor's wait
    raises NCCL's error, which is one line naming rank 1, where NCCL's watchdog would abort
    the process (SIGABRT) before any line. Needs 2 GPUs: NCCL refuses two ranks on one."""
    if torch.cuda.device_count() < 2:
        pytest.skip("a lost NCCL peer needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    log = stop_rank_during_check(tmp_path, "killed", env=clean_env())  # the check's line: it caught the error
    assert "Backend: nccl" in log and "Signal 6 (SIGABRT)" not in log


@pytest.mark.parametrize("stop", ["stop file", "SIGUSR1"])
def test_train_ddp_on_nccl_stops_and_resumes(tmp_path, stop):
    """NCCL for the gradients, the gloo control group for the per-step stop agreement, the
    replica check after every step, a stop (the job scripts' stop file, or a signal to the
    rank) with its checkpoint, then a resume to the end."""
    whole_epochs = ("--limit-batches", "100000")  # seconds per epoch: a signal lands inside epoch 2
    args = (*SHORT, *(whole_epochs if stop == "SIGUSR1" else ()), "--checkpoint-dir", tmp_path / "ck",
            "--metrics-file", tmp_path / "m.jsonl", "--check-sync-every", "1")
    if stop == "stop file":
        (tmp_path / "STOP").touch()
        stopped = run(torchrun_cmd(1, "train_ddp.py", *args, "--stop-file", tmp_path / "STOP"), cwd=tmp_path)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        log = stopped.stdout
        # Seen before step 1 ends; agreed during step 2 (asynchronously, on the gloo group).
        assert "Stopped after step 2 of epoch 1 (--stop-file" in log
    else:
        needs_another_process()
        process = start(torchrun_cmd(1, "train_ddp.py", *args), tmp_path, tmp_path / "log")
        wait_for(tmp_path / "log", "Epoch 1/2:", process)
        os.kill(_rank_pid(process.pid, 0), signal.SIGUSR1)
        assert process.wait(timeout=120) != 0  # torchrun reports the worker's 75 as a failure
        log = (tmp_path / "log").read_text()
        assert re.search(r"Stopped after step \d+ of epoch 2 \(SIGUSR1\)", log)
    assert re.search(r"NCCL version: \d+\.\d+\.\d+", log)
    resumed = run(torchrun_cmd(1, "train_ddp.py", *args, "--resume"), cwd=tmp_path)
    records = finite_run(resumed, tmp_path / "m.jsonl")
    assert [r["epoch"] for r in records] == [1, 2] and "Traceback" not in resumed.stdout + resumed.stderr


def test_nvml_reads_this_processes_gpu():
    pynvml = monitor.import_pynvml()
    if pynvml is None:
        pytest.skip("NVML sampling needs nvidia-ml-py (the NGC container has it)")
    pynvml.nvmlInit()
    for index in range(torch.cuda.device_count()):  # the same GPU as torch's, also where NVML numbers differ
        uuid = pynvml.nvmlDeviceGetUUID(monitor.nvml_handle(pynvml, torch.device("cuda", index)))
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        assert uuid.split("-", 1)[1] == str(torch.cuda.get_device_properties(index).uuid)  # GPU-... or MIG-...
    read, why_not = monitor.nvml_reader(torch.device("cuda", 0))
    assert why_not is None
    utilization, power = read()
    assert 0 <= utilization <= 100 and power > 10  # watts: an H100/GH200 idles at 60-100 W


def test_gpu_power_a_gpu_profile_and_tensorboard(tmp_path):
    """Whole epochs (195 steps of 256, 2-3 s of training on an H100), long enough for NVML's
    samples once a second: utilization and power in the metrics; a profile of GPU time with the
    convolution kernels in the trace; TensorBoard's GPU scalars where tensorboard is installed."""
    nvml, tensorboard = monitor.import_pynvml() is not None, tensorboard_log.tensorboard_missing() is None
    metrics = tmp_path / "m.jsonl"
    result = run(python_cmd("train.py", "--synthetic", "--epochs", "2", "--num-workers", "0", "--metrics-file",
                            metrics, "--profile-dir", tmp_path / "prof",
                            *(["--tensorboard", tmp_path / "tb"] if tensorboard else [])), cwd=tmp_path)
    records = finite_run(result, metrics)
    assert "Profile of 5 training steps from step 11 of epoch 1 (GPU time of rank 0)" in result.stdout
    table = result.stdout.split("(GPU time of rank 0)", 1)[1]
    assert re.search(r"(conv|cudnn)", table) and "ms of computation on the GPU" in table
    (trace,) = (tmp_path / "prof").iterdir()
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUPTI recorded the GPU's kernels
    last = records[-1]
    if nvml:
        assert "sampled every 1 s by NVML" in result.stdout
        assert last["gpu_util_percent"] is not None and last["gpu_power_w"] is not None, (
            f"no NVML sample in epoch 2's {last['epoch_time_s']:.1f} s of training")
        assert 0 < last["gpu_util_percent"] <= 100 and last["gpu_power_w"] > 10
    else:
        assert "not recorded: pynvml is not installed (pip install nvidia-ml-py)" in result.stdout
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(next((tmp_path / "tb").iterdir())))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert "gpu/peak_memory_gib" in tags and (not nvml or {"gpu/utilization_percent", "gpu/power_w"} <= tags)


# ---------------------------------------------------------------------------------------------
# The rest of what users run on GPUs.

def test_evaluation_under_autocast_agrees_with_fp32(tmp_path):
    """A model that learned (learnable images, not random labels at ~1%): its accuracy and loss
    under bf16 and fp16 autocast are fp32's, within rounding."""
    data = write_cifar100(tmp_path / "data", n_train=512, n_test=256, classes=10, learnable=True)
    common = ("--data-dir", data, "--batch-size", "32", "--num-workers", "0")
    trained = run(python_cmd("train.py", *common, "--epochs", "3", "--warmup-epochs", "1", "--save-weights",
                             tmp_path / "w.pt"), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    results = {}
    for precision in ("bf16", "fp16", "fp32"):
        metrics = tmp_path / f"{precision}.jsonl"
        result = run(python_cmd("train.py", *common, "--eval-only", "--weights", tmp_path / "w.pt",
                                "--precision", precision, "--metrics-file", metrics), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        [results[precision]] = read_metrics(metrics)
    assert results["fp32"]["val_accuracy"] > 0.5  # learned: a disagreement would show
    ties = _near_ties(tmp_path / "w.pt", data)
    for precision in ("bf16", "fp16"):
        assert results[precision]["val_samples"] == 256
        assert results[precision]["val_loss"] == pytest.approx(results["fp32"]["val_loss"], rel=0.05, abs=0.01)
        # Only images whose two best classes are near a tie may change their prediction.
        assert abs(results[precision]["val_accuracy"] - results["fp32"]["val_accuracy"]) <= max(ties, 2) / 256


def _near_ties(weights, data_dir):
    """How many test images the fp32 model gives two best logits closer than 2% of the best's
    size (bf16 keeps 8 bits of mantissa, 0.4%, and a network adds its roundings up): those
    whose prediction bf16 or fp16 may flip."""
    args = tu.parse_args("x", ["--data-dir", str(data_dir), "--eval-only", "--weights", str(weights),
                               "--precision", "fp32", "--batch-size", "64", "--num-workers", "0"])
    ctx = single_process_context()
    task = tu.build_task(args, ctx)
    model, ties = task.model.eval(), 0
    with torch.no_grad():
        for x, _ in task.test_loader:
            best, second = model(x.to(ctx.device)).float().topk(2, dim=1).values.unbind(1)  # (B,) each
            ties += int((best - second < 0.02 * best.abs() + 1e-3).sum())
    return ties


@pytest.mark.parametrize("first, then, layout, optimizer", [
    *[(first, then, layout, "sgd") for layout in ("default", "--channels-last", "--no-channels-last")
      for first, then in (("cpu", "cuda"), ("cuda", "cpu"))],
    ("cpu", "cuda", "default", "adamw")])
def test_a_checkpoint_resumes_on_the_other_device_type(tmp_path, first, then, layout, optimizer):
    """A stop file that is there from the start stops training after its first step, with a
    checkpoint (optimizer state and all); the other device type finishes the run. "default":
    NCHW on the CPU, channels_last on CUDA, so the momentum buffers are re-strided for the
    fused SGD kernel (fit_optimizer_to_params), which fails on mismatched strides; AdamW's step
    count, on the CPU in the checkpoint, must be on the GPU for its fused kernel. A small
    convolutional net: the CPU evaluates the whole synthetic test set (the Wide ResNet took
    minutes there)."""
    envs = {"cpu": CPU_ONLY, "cuda": clean_env()}
    args = (*SMALL_MODEL, "--synthetic", "--epochs", "2", "--limit-batches", "2", "--batch-size", "16",
            "--num-workers", "0", *([] if layout == "default" else [layout]), "--checkpoint-dir", tmp_path / "ck",
            "--metrics-file", tmp_path / "m.jsonl", "--optimizer", optimizer)
    (tmp_path / "STOP").touch()
    stopped = run(python_cmd("train.py", *args, "--stop-file", tmp_path / "STOP"), cwd=tmp_path, env=envs[first])
    assert stopped.returncode == 0 and "Stopped after step 1 of epoch 1" in stopped.stdout, stopped.stderr
    resumed = run(python_cmd("train.py", *args, "--resume"), cwd=tmp_path, env=envs[then])
    records = finite_run(resumed, tmp_path / "m.jsonl")
    assert [r["epoch"] for r in records] == [1, 2]
    assert f"Device: {'cuda:0' if then == 'cuda' else 'cpu'} " in resumed.stdout


def test_torchvision_loader_on_cuda(tmp_path):
    """Worker processes and pinned memory feeding the GPU."""
    data = write_cifar100(tmp_path / "data", n_train=256, n_test=64)
    metrics = tmp_path / "m.jsonl"
    result = run(python_cmd("train.py", "--data-dir", data, "--loader", "torchvision", "--num-workers", "2",
                            "--batch-size", "32", "--epochs", "2", "--metrics-file", metrics), cwd=tmp_path)
    records = finite_run(result, metrics)
    assert {r["loader"] for r in records} == {"torchvision"}


@pytest.mark.skipif(not dali_installed(), reason="NVIDIA DALI is not installed")
def test_dali_decodes_on_the_gpu_into_cuda_tensors_the_cpus_images(tmp_path):
    """--loader dali on CUDA: the "mixed" decoder (nvJPEG) and the crops on the GPU, batches handed
    over as CUDA tensors (no host copy); validation images those of the CPU pipeline, up to the
    two JPEG decoders' rounding; train.py trains with it."""
    photos = write_photo_folder(tmp_path / "photos", per_class=8)
    files = sorted(str(p) for p in photos.glob("*/*") if p.suffix.lower() in (".png", ".jpg"))
    prep = du.preprocessing((64, 64, 3), (0.5,) * 3, (0.25,) * 3, "resized-crop", stored_size=(73, 73))
    images = FileImages(files, np.arange(len(files)), prep)
    torch.zeros(1, device="cuda")
    before = held_outside_torch(torch.device("cuda"))  # the CUDA context
    served = {}
    for device in ("cpu", "cuda"):
        loader = DaliLoader(images, 8, recipe.dali_images, torch.device(device), False)
        served[device] = [(x, y) for x, y in loader]
        assert all(x.device.type == device and y.device.type == device for x, y in served[device])
    for (x_cpu, y_cpu), (x_gpu, y_gpu) in zip(served["cpu"], served["cuda"], strict=True):
        assert torch.equal(y_cpu, y_gpu.cpu())
        assert (x_cpu - x_gpu.cpu()).abs().mean() * 0.25 * 255 < 1.0  # below a grey level on average
    assert held_outside_torch(torch.device("cuda")) > before  # DALI's pool: named in an out-of-memory line
    training = DaliLoader(images, 8, recipe.dali_images, torch.device("cuda"), True)
    x, y = next(iter(training))
    assert x.is_cuda and x.shape == (8, 3, 64, 64) and y.dtype == torch.int64
    metrics = tmp_path / "m.jsonl"
    result = run(python_cmd("train.py", "--dataset", "folder", "--data-dir", photos, "--val-fraction", "0.25",
                            "--image-size", "64", "--loader", "dali", "--batch-size", "8", "--epochs", "2",
                            "--metrics-file", metrics), cwd=tmp_path)
    assert "Loader: NVIDIA DALI (decoding and augmentation on the GPU" in result.stdout, result.stdout
    assert {r["loader"] for r in finite_run(result, metrics)} == {"dali"}


def test_device_cpu_trains_on_the_cpu_of_a_gpu_node(tmp_path):
    """--device cpu (the tutorial's --no-cuda): the CPU although a GPU is there."""
    metrics = tmp_path / "m.jsonl"
    result = run(python_cmd("train.py", *SHORT, "--device", "cpu", "--metrics-file", metrics), cwd=tmp_path)
    assert re.search(r"^Device: cpu \(CPU", result.stdout, re.M), result.stdout
    assert {r["peak_memory_gib"] for r in finite_run(result, metrics)} == {None}  # nothing on the GPU


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2-GPU DDP needs 2 GPUs")
def test_ddp_on_two_gpus(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = run(torchrun_cmd(2, "train_ddp.py", *SHORT, "--check-sync-every", "1", "--metrics-file", metrics),
                 cwd=tmp_path)
    records = finite_run(result, metrics)
    assert {r["world_size"] for r in records} == {2} and "x 2 GPUs" in result.stdout


def test_peak_memory_grows_with_the_batch_and_fits(tmp_path):
    peaks = {}
    for batch in (256, 1024):
        metrics = tmp_path / f"b{batch}.jsonl"
        result = run(python_cmd("train.py", "--synthetic", "--epochs", "1", "--limit-batches", "3", "--batch-size",
                                str(batch), "--num-workers", "0", "--metrics-file", metrics), cwd=tmp_path)
        peaks[batch] = finite_run(result, metrics)[-1]["peak_memory_gib"]
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"peak memory: batch 256 {peaks[256]:.2f} GiB, batch 1024 {peaks[1024]:.2f} GiB of {total:.0f}")
    assert 0 < peaks[256] < peaks[1024] < total


def test_loader_auto_measures_training_before_the_data_set_goes_on_the_gpu(tmp_path, monkeypatch):
    device = torch.device("cuda")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)  # as training runs: autotuning must not count
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(64 * 32 * 32, 10)).to(device)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def measured(batch, accumulate=1):
        return training_bytes(model, StepShape(batch, accumulate, (32, 32, 3)), Precision("fp32"), device,
                              torch.contiguous_format)
    small, large, accumulated = measured(8), measured(256), measured(256, 32)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # BatchNorm's statistics untouched
    # Real steps of 256 images with AdamW, the second one measured (its state exists, cuDNN has tuned).
    optimizer = torch.optim.AdamW(model.parameters())
    images, labels = torch.randn(256, 3, 32, 32, device=device), torch.randint(0, 10, (256,), device=device)
    for _ in range(2):
        torch.cuda.reset_peak_memory_stats(device)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    real = torch.cuda.max_memory_allocated(device)
    activation = 64 * 32 * 32 * 4  # bytes of one image's convolution output, kept for the backward pass
    print(f"training bytes: batch 8 {small / 2**20:.0f} MiB, 256 {large / 2**20:.0f} MiB (a real step: "
          f"{real / 2**20:.0f} MiB), 256 in 32 micro-batches {accumulated / 2**20:.0f} MiB")
    assert 0.9 * real <= large <= 2 * real
    assert small < accumulated < large and large - small >= (256 - 8) * activation
    result = run(python_cmd("train.py", *SHORT), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"Loader: .*; auto: the data set \(.+\), training \(.+, measured\) and the device loader's batch "
                     r"\(.+\) fit together in 85% of the device's free ", result.stdout), result.stdout


@pytest.mark.parametrize("layout", ["--channels-last", "--no-channels-last"])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32", "fp32"])  # auto: in the hooks' test
def test_training_steps_in_every_precision_and_layout(tmp_path, precision, layout):
    metrics = tmp_path / "m.jsonl"
    result = run(python_cmd("train.py", *SHORT, "--precision", precision, layout, "--metrics-file", metrics),
                 cwd=tmp_path)
    records = finite_run(result, metrics)
    assert {r["precision"] for r in records} == {precision}
    assert f"Device: cuda:0 ({torch.cuda.get_device_name(0)}" in result.stdout
    assert all(r["device"].startswith(torch.cuda.get_device_name(0)) and r["peak_memory_gib"] > 0 for r in records)
    assert ("channels_last" in result.stdout) == (layout == "--channels-last")


# ---------------------------------------------------------------------------------------------
# Last: the cold compiles, in one xdist worker (the later ones reuse the first's inductor cache),
# so that a --report cut short by its time budget has run every cheaper test first. A small
# net: the Wide ResNet's compile took the rest of the first report's tier (tools/benchmark.py
# times its compile).

@pytest.mark.xdist_group("compile")
def test_compiled_training(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = run(python_cmd("train.py", *SHORT, *PLAIN_MODEL, "--compile", "--metrics-file", metrics), cwd=tmp_path,
                 timeout=COLD_COMPILE_S)
    finite_run(result, metrics)
    assert ("torch.compile mode reduce-overhead (auto on CUDA: forward and backward replayed as CUDA graphs)"
            in result.stdout)
    assert "torch.compile: the first step took" in result.stdout
    assert "without CUDA graphs" not in result.stdout  # every compiled graph replayed as a CUDA graph


@pytest.mark.xdist_group("compile")
def test_a_compiled_run_on_cuda_graphs_stops_and_resumes_like_one_that_did_not_stop(tmp_path):
    """--compile's CUDA graphs: stopped by --stop-file after the first step of epoch 1 and resumed
    in a new process (its graphs recorded again), the run ends where one that did not stop ends,
    within bf16 rounding: cuDNN's autotuning may pick other kernels in a new process, so not bit
    for bit as on the CPU (tests/test_resilience.py)."""
    common = (*SHORT, *PLAIN_MODEL, "--compile")
    whole = run(python_cmd("train.py", *common, "--metrics-file", tmp_path / "whole.jsonl"), cwd=tmp_path,
                timeout=COLD_COMPILE_S)
    expected = finite_run(whole, tmp_path / "whole.jsonl")
    (tmp_path / "STOP").touch()
    split = (*common, "--checkpoint-dir", tmp_path / "ck", "--metrics-file", tmp_path / "split.jsonl")
    stopped = run(python_cmd("train.py", *split, "--stop-file", tmp_path / "STOP"), cwd=tmp_path,
                  timeout=COLD_COMPILE_S)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert re.search(r"Stopped after step [12] of epoch 1 \(--stop-file", stopped.stdout), stopped.stdout  # mid-epoch
    resumed = run(python_cmd("train.py", *split, "--resume"), cwd=tmp_path, timeout=COLD_COMPILE_S)
    records = finite_run(resumed, tmp_path / "split.jsonl")
    assert [r["epoch"] for r in records] == [1, 2]
    for got, want in zip(records, expected, strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-2)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-2)
    for log in (whole.stdout, stopped.stdout, resumed.stdout):
        assert "torch.compile mode reduce-overhead" in log and "without CUDA graphs" not in log


@pytest.mark.xdist_group("compile")
def test_compiled_training_with_accumulation_runs_without_cuda_graphs(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = run(python_cmd("train.py", *SHORT, *PLAIN_MODEL, "--compile", "--accumulate", "2", "--metrics-file",
                            metrics), cwd=tmp_path, timeout=COLD_COMPILE_S)
    finite_run(result, metrics)
    assert "torch.compile mode default (auto with --accumulate" in result.stdout


@pytest.mark.xdist_group("compile")
@pytest.mark.parametrize("mode", ["auto", "reduce-overhead"])
def test_compile_with_ddp(tmp_path, mode):
    """auto: the default mode under DDP; reduce-overhead asked for: CUDA graphs tried, and a
    graph PyTorch skips (DDP with BatchNorm, pytorch/pytorch#139207) said with its cause."""
    metrics = tmp_path / "m.jsonl"
    gpus = min(torch.cuda.device_count(), 2)
    result = run(torchrun_cmd(gpus, "train_ddp.py", *SHORT, *PLAIN_MODEL, "--compile", "--compile-mode", mode,
                              "--metrics-file", metrics), cwd=tmp_path, timeout=COLD_COMPILE_S)
    finite_run(result, metrics)
    assert ("torch.compile mode default (auto under DDP" if mode == "auto"
            else "torch.compile mode reduce-overhead (--compile-mode)") in result.stdout
    assert "torch.compile: the first step took" in result.stdout
    skips = [line for line in result.stdout.splitlines() if "without CUDA graphs" in line]
    assert all("DDP and BatchNorm (pytorch/pytorch#139207)" in line for line in skips)  # Net has BatchNorm
