"""What a new user's walk broke: outputs that cannot be written, downloads that never answer,
--data-dir naming the data set's own folder, Ctrl-C before training. Each case is one line
and a non-zero exit, before any training, with nothing half-written left behind."""

import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from pathlib import Path

import pytest
import torch

from engine import checkpoints, data_formats, errors, files, task
from engine.processes import DistContext
from engine import weights as weights_file
from conftest import (FAST, REPO, TINY_MODEL, error_lines, python_cmd, run, run_main, start, torchrun_cmd, clean_env,
                      unavailable, write_cifar100)

# What is kept and refused does not depend on the model: the tiny one, seconds sooner than the Wide ResNet.
SMOKE = ("--synthetic", "--epochs", "1", "--limit-batches", "1", "--batch-size", "8", *FAST, *TINY_MODEL)


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only mount (tmpfs) holding one file, old.jsonl: root may write anywhere else."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", folder], capture_output=True).returncode != 0:
        unavailable("MOUNT_TESTS", "needs mount (root) to make a read-only file system")
    try:
        (folder / "old.jsonl").write_text('{"epoch": 1}\n')
        subprocess.run(["mount", "-o", "remount,ro", folder], check=True)
        yield folder
    finally:
        subprocess.run(["umount", folder], check=True)


def test_an_earlier_hangs_dumps_that_cannot_be_moved_are_a_warning(tmp_path):
    """A folder whose file system refuses the move (read-only here; a teammate's dumps in a
    sticky folder): the run starts, says the dumps stay, and leaves them as they are."""
    folder = tmp_path / "ck"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", folder], capture_output=True).returncode != 0:
        unavailable("MOUNT_TESTS", "needs mount (root) to make a read-only file system")
    try:
        (folder / "nccl_trace_rank_0").write_bytes(b"hang")
        subprocess.run(["mount", "-o", "remount,ro", folder], check=True)
        warnings = []
        checkpoints.Checkpointer(folder, 0, DistContext(device=torch.device("cpu")), {}, warn=warnings.append)
        assert warnings == [f"WARNING: the NCCL flight-recorder dumps of an earlier hang stay in {folder} (Read-only "
                            "file system): a hang of this run would overwrite them"]
        assert sorted(path.name for path in folder.iterdir()) == ["nccl_trace_rank_0"]
    finally:
        subprocess.run(["umount", folder], check=True)


@pytest.mark.parametrize("flag, name", [("--save-weights", "w.pt"), ("--save-weights", "sub/w.pt"),
                                        ("--metrics-file", "old.jsonl"), ("--metrics-file", "m.jsonl"),
                                        ("--checkpoint-dir", "ck")])
def test_an_output_on_a_read_only_file_system_is_refused_before_training(read_only_dir, capsys, flag, name):
    assert run_main("train.py", *SMOKE, flag, read_only_dir / name) == 2
    out, err = capsys.readouterr()
    [line] = error_lines(err)
    assert line.startswith(f"error: {flag} {read_only_dir / name}: cannot ") and "Read-only file system" in line
    assert "Training" not in out  # refused before the data and the model are built
    assert sorted(p.name for p in read_only_dir.iterdir()) == ["old.jsonl"]


def test_a_read_only_checkpoint_folder_stops_every_rank_at_start(read_only_dir, tmp_path):
    result = run(torchrun_cmd(2, "train_ddp.py", *SMOKE, "--checkpoint-dir", read_only_dir), cwd=tmp_path)
    assert result.returncode != 0
    [line] = error_lines(result.stderr)  # rank 0's verdict, printed once
    ro = read_only_dir
    assert line == f"error: --checkpoint-dir {ro}: cannot write in it ({ro}: Read-only file system)"
    assert "Training" not in result.stdout
    assert "train_ddp.py\", line" not in result.stderr  # torchrun reports the exit status; no rank's traceback


class SilentProxy:
    """A proxy that accepts connections and never answers, as a compute node's network that
    drops packets does: every read waits forever. It counts the connections it accepted."""

    def __init__(self):
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections, self.connected = [], threading.Event()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                self.connections.append(self.server.accept()[0])  # kept open, never answered
            except OSError:  # closed at the end of the test
                return
            self.connected.set()

    def close(self):
        self.server.close()
        for connection in self.connections:
            connection.close()


@pytest.fixture
def silent_proxy(monkeypatch):
    """(the SilentProxy, the variables that make every download go through it)."""
    proxy = SilentProxy()
    env = {"https_proxy": proxy.url, "http_proxy": proxy.url, "HTTPS_PROXY": proxy.url, "HTTP_PROXY": proxy.url,
           "no_proxy": ""}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen keeps the proxies of its first call
    yield proxy, env
    proxy.close()


@pytest.mark.parametrize("name", ["cifar100", "fashion-mnist"])  # one archive; 4 files from 2 mirrors each
def test_a_download_that_never_answers_fails_with_one_line(silent_proxy, tmp_path, monkeypatch, name):
    proxy, _ = silent_proxy
    monkeypatch.setattr(data_formats, "DOWNLOAD_STALL_S", 1.5)
    with pytest.raises(errors.DatasetError) as caught:
        data_formats.prepare(tmp_path / "datasets", task.DATASETS[name])
    assert len(proxy.connections) == 1  # one stall, not one per mirror and file
    message = str(caught.value)
    assert "downloading it failed (no answer from the network for 1.5 s); on a machine with internet" in message
    assert f"python dataset_utils.py --dataset {name} --data-dir {tmp_path / 'datasets'}" in message
    assert list(tmp_path.iterdir()) == []  # no empty data folder, no partial archive


@pytest.mark.parametrize("script", ["dataset_utils.py", "train.py"])
def test_ctrl_c_during_a_stalled_download_leaves_nothing_and_no_traceback(silent_proxy, tmp_path, script):
    proxy, proxy_env = silent_proxy
    data = tmp_path / "datasets"
    args = ("--data-dir", data) + (("--epochs", "1", *FAST) if script == "train.py" else ())
    process = start(python_cmd(script, *args), tmp_path, tmp_path / "log", env=clean_env(**proxy_env))
    assert proxy.connected.wait(timeout=60), (tmp_path / "log").read_text()  # the download is waiting for an answer
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 130
    log = (tmp_path / "log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    last = log.strip().splitlines()[-1]
    assert last == ("Interrupted (Ctrl-C): no partial files were kept" if script == "dataset_utils.py"
                    else "Interrupted (Ctrl-C)")  # no talk of checkpoints: there are none
    assert not data.exists()


@pytest.mark.parametrize("given, root", [("x/cifar-100-python", "x"), ("x/FashionMNIST", "x"),
                                         ("x/FashionMNIST/raw", "x"), ("x/MNIST/raw", "x"), ("x", "x"),
                                         ("cifar-100-python", ".")])
def test_data_dir_naming_the_data_sets_own_folder_means_its_parent(given, root):
    name = "fashion-mnist" if "FashionMNIST" in given else "mnist" if "MNIST" in given else "cifar100"
    assert data_formats.data_root(Path(given), task.DATASETS[name]) == Path(root)


def test_the_real_data_sets_folder_inside_one_of_that_name_is_kept(tmp_path):
    write_cifar100(tmp_path / "cifar-100-python")  # the files are in .../cifar-100-python/cifar-100-python
    folder = tmp_path / "cifar-100-python"
    assert data_formats.data_root(folder, task.DATASETS["cifar100"]) == folder


def test_train_py_accepts_the_data_sets_own_folder(tmp_path):
    write_cifar100(tmp_path / "data")
    result = run(python_cmd("train.py", "--data-dir", tmp_path / "data" / "cifar-100-python", "--epochs", "1",
                            "--batch-size", "8", "--limit-batches", "1", *FAST), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Training complete." in result.stdout
    assert not (tmp_path / "data" / "cifar-100-python" / "cifar-100-python").exists()


def test_a_missing_data_set_names_the_parent_folder_to_fetch_into(tmp_path, capsys):
    given = tmp_path / "data" / "cifar-100-python"
    assert run_main("train.py", "--data-dir", given, "--no-download", "--epochs", "1", *FAST) == 2
    [line] = error_lines(capsys.readouterr().err)
    fetch = f"python dataset_utils.py --dataset cifar100 --data-dir {tmp_path / 'data'}"
    assert line.endswith(f"fetch it first with: {fetch}")
    assert f"not found in {given}" in line
    assert not (tmp_path / "data").exists()


def test_save_weights_never_replaces_another_runs_file(tmp_path, capsys):
    """A second run with the same --save-weights is refused before training and the first
    run's file is unchanged; the run that wrote it may replace it when it continues (the
    file names its checkpoint folder), as may the job scripts' DIR/weights.pt, a file in the
    folder itself, written before files named their folder."""
    weights, ck = tmp_path / "w.pt", tmp_path / "ck"
    assert run_main("train.py", *SMOKE, "--save-weights", weights) == 0
    assert (f"Checkpoints: none: a stop before the end (Ctrl-C, scancel, a time limit) keeps nothing, not even "
            f"{weights}; --checkpoint-dir DIR keeps the run") in capsys.readouterr().out  # said before it matters
    first = weights.read_bytes()
    for again in ([], ["--checkpoint-dir", ck, "--resume=auto"]):  # a new run; a new run in the job scripts' way
        capsys.readouterr()
        assert run_main("train.py", *SMOKE, *again, "--save-weights", weights) == 2
        out, err = capsys.readouterr()
        assert error_lines(err) == [f"error: --save-weights {weights} exists already and is not this run's: choose "
                                    "a new file name, or move that file away first; nothing is overwritten"]
        assert "Epoch 1/" not in out and weights.read_bytes() == first
    assert not list(ck.glob("checkpoint_*.pt"))  # refused before its first checkpoint

    ours = tmp_path / "ours.pt"  # this run's own, outside its folder: continuing replaces it
    assert run_main("train.py", *SMOKE, "--checkpoint-dir", ck, "--save-weights", ours) == 0
    written = ours.read_bytes()
    assert run_main("train.py", *SMOKE[:2], "2", *SMOKE[3:], "--checkpoint-dir", ck, "--resume",
                    "--save-weights", ours) == 0
    assert ours.read_bytes() != written  # epoch 2's weights
    assert run_main("train.py", *SMOKE, "--checkpoint-dir", tmp_path / "ck2", "--resume=auto",
                    "--save-weights", ours) == 2  # another folder's run: not its file

    inside = ck / "weights.pt"
    inside.write_bytes(first)  # no folder named in it: an older file of the job scripts
    assert run_main("train.py", *SMOKE[:2], "3", *SMOKE[3:], "--checkpoint-dir", ck, "--resume=auto",
                    "--save-weights", inside) == 0
    assert inside.read_bytes() != first
    evaluated = inside.read_bytes()  # the job scripts add --save-weights to an evaluation too: it writes none
    capsys.readouterr()
    assert run_main("train.py", *SMOKE, "--eval-only", "--weights", inside, "--save-weights", inside) == 0
    assert inside.read_bytes() == evaluated
    assert f"\nNote: --save-weights {inside} is not written: --eval-only trains nothing\n" in capsys.readouterr().out

    best = ck / "model_best.pt"  # the folder's own names: refused at start, the best epoch's weights kept
    kept = best.read_bytes()
    for own in (best, ck / "checkpoint_000000001.pt"):
        capsys.readouterr()
        assert run_main("train.py", *SMOKE[:2], "3", *SMOKE[3:], "--checkpoint-dir", ck, "--resume=auto",
                        "--save-weights", own) == 2
        [line] = error_lines(capsys.readouterr().err)
        assert line.startswith(f"error: --save-weights {own}: --checkpoint-dir {ck} keeps ") and "weights.pt" in line
    assert best.read_bytes() == kept and not (ck / "checkpoint_000000001.pt").exists()


def test_weights_that_appear_during_a_run_are_kept(tmp_path):
    """A copied command started alongside: both passed the check at start, and the one that
    ends second writes beside the other's file, which is kept."""
    model = torch.nn.Linear(2, 3)
    theirs = tmp_path / "w.pt"
    theirs.write_bytes(b"the other run's weights")
    line = weights_file.save_trained_weights(model, theirs, {"model": "m"})
    written = Path(line.split("Model weights written to ", 1)[1].split(" (", 1)[0])
    assert written.parent == tmp_path and written.name.startswith("w-") and written.suffix == ".pt"
    assert line.endswith(f" ({theirs} appeared during this run, from another run, and is kept)")
    assert theirs.read_bytes() == b"the other run's weights"
    assert weights_file.read_weights(written).state.keys() == model.state_dict().keys()

    # Two runs that end at the same moment: the other's file appears after the look above (here
    # while the state_dict is taken), and is kept all the same; this run's goes beside it.
    class Racing(torch.nn.Linear):
        def state_dict(self, *args, **kwargs):
            if not raced.exists():
                raced.write_bytes(b"written alongside")
            return super().state_dict(*args, **kwargs)

    raced = tmp_path / "race.pt"
    line = weights_file.save_trained_weights(Racing(2, 3), raced, {"model": "m"})
    assert raced.read_bytes() == b"written alongside"
    assert line.endswith(f" ({raced} appeared during this run, from another run, and is kept)"), line
    assert len(list(tmp_path.glob("race-*.pt"))) == 1 and not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(files.NameTaken):
        files.atomic_save({"x": 1}, raced, new=True)
    assert raced.read_bytes() == b"written alongside" and not list(tmp_path.glob(".*tmp*"))

    ck = tmp_path / "ck"  # this run's own file (it names the run's folder): replaced in place
    ck.mkdir()
    ours = tmp_path / "ours.pt"
    assert weights_file.save_trained_weights(model, ours, {}, ck / "checkpoint_000000004.pt") == \
        f"Model weights written to {ours}"
    model.bias.data += 1
    assert weights_file.save_trained_weights(model, ours, {}, ck / "checkpoint_000000008.pt") == \
        f"Model weights written to {ours}, in place of this run's earlier ones"  # said, as the file was there
    assert torch.equal(weights_file.read_weights(ours).state["bias"], model.bias.data)


def test_two_outputs_on_one_file_or_a_metrics_file_under_the_folders_names_are_refused(tmp_path, capsys):
    """--metrics-file and --save-weights on one path: the weights went beside the run's own
    metrics file, said to be 'from another run'. --metrics-file DIR/model_best.pt appended JSON
    into the best weights, DIR/checkpoint_N.pt was replaced by a checkpoint. Both refused at
    start, the files as they were."""
    ck, shared = tmp_path / "ck", tmp_path / "out.x"
    assert run_main("train.py", *SMOKE, "--metrics-file", shared, "--save-weights", shared) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: --metrics-file and --save-weights name the same file, {shared}: give each its own"]
    for name in ("model_best.pt", "checkpoint_000000064.pt"):  # names the run would write there later
        assert run_main("train.py", *SMOKE, "--checkpoint-dir", ck, "--metrics-file", ck / name) == 2
        [line] = error_lines(capsys.readouterr().err)
        assert line.startswith(f"error: --metrics-file {ck / name}: --checkpoint-dir {ck} keeps "), line
    assert not shared.exists() and not ck.exists()


@pytest.mark.parametrize("script", ["train.py", "train_ddp.py", "predict.py", "check_network.py"])
def test_ctrl_c_while_torch_imports_ends_quietly(tmp_path, script):
    """Ctrl-C in the first seconds, while the entry point imports torch (seconds; more on a
    shared file system), ended in the traceback of an import (two new users' walks hit it).
    Now it ends the command as SIGINT ends one that does not catch it: no output at all."""
    process = subprocess.Popen([sys.executable, REPO / script, "--help"], cwd=tmp_path, env=clean_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    maps = Path(f"/proc/{process.pid}/maps")
    deadline = time.time() + 60
    while "libtorch" not in maps.read_text():  # torch's library is mapped: its import has begun
        assert process.poll() is None and time.time() < deadline, "torch was never imported"
        time.sleep(0.002)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGINT and err == "" and out == "", err
