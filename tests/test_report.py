"""tools/report.py on the metrics files of real 1-process and 2-process runs: tables that say what
the files say, the scaling efficiency as stated, the PNG, GPU logs, and bad input."""

import json
import re
import struct
import sys

import pytest

from tools import report
from conftest import FAST, SMALL_MODEL, python_cmd, read_metrics, run, torchrun_cmd, write_cifar100

# 2 epochs of 2 steps, 4 images per process: the same per-process batch at 1 and 2 processes.
COMMON = ("--epochs", "2", "--limit-batches", "2", "--warmup-epochs", "1", *FAST, *SMALL_MODEL)


@pytest.fixture(scope="module")
def metrics(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    data = write_cifar100(folder / "data", n_train=16, n_test=8)
    files = {1: folder / "one.jsonl", 2: folder / "two.jsonl"}
    commands = {1: python_cmd("train.py", "--data-dir", data, "--batch-size", "4", *COMMON, "--metrics-file", files[1]),
                2: torchrun_cmd(2, "train_ddp.py", "--data-dir", data, "--batch-size", "8", *COMMON,
                                "--metrics-file", files[2])}
    for command in commands.values():
        result = run(command, cwd=folder)
        assert result.returncode == 0, result.stdout + result.stderr
    return files


def _rows(text, title):
    """The Markdown table under ``## title``: a list of dicts by column name."""
    after_heading = text.split(f"## {title}", 1)[1].split("\n", 1)[1]
    block = after_heading.strip().split("\n\n", 1)[0].splitlines()
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in block if line.startswith("|")]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def _rate(records):
    return sum(r["train_images"] for r in records) / sum(r["epoch_time_s"] for r in records)


def test_tables_say_what_the_files_say(metrics, capsys):
    assert report.main([str(metrics[1]), str(metrics[2])]) == 0
    out = capsys.readouterr().out
    one, two = read_metrics(metrics[1]), read_metrics(metrics[2])
    rows = {row["Run"]: row for row in _rows(out, "Runs")}
    for name, records in (("one.jsonl", one), ("two.jsonl", two)):
        row = rows[name]
        assert row["Epochs"] == "2" and row["Processes"] == str(records[-1]["world_size"])
        assert row["Batch per process"] == "4" and row["Test images"] == "8"
        assert row["Final accuracy"] == f"{records[-1]['val_accuracy']:.4f}"
        assert row["Training s"] == f"{sum(r['epoch_time_s'] for r in records):,.1f}"
        assert row["Evaluation s"] == f"{sum(r['eval_time_s'] for r in records):,.1f}"
        assert row["img/s"] == f"{_rate(records):,.1f}"
        assert row["img/s after epoch 1"] == f"{_rate(records[1:]):,.1f}"  # epoch 1 left out

    # The guide's table: epoch 2 only, the same batch per process, against the 1-process run.
    scaling = _rows(out, "Scaling: cifar100, 4 images per process, fp32, device loader")
    assert [row["Processes"] for row in scaling] == ["1", "2"]
    speedup = _rate(two[1:]) / _rate(one[1:])
    assert scaling[0]["Speedup"] == "1.00x" and scaling[0]["Scaling efficiency"] == "100%"
    assert scaling[1]["Throughput (img/s)"] == f"{_rate(two[1:]):,.1f}"
    assert scaling[1]["Speedup"] == f"{speedup:.2f}x" and scaling[1]["Scaling efficiency"] == f"{speedup / 2:.0%}"
    assert "epoch 1, with cuDNN autotuning, compilation and loader start-up, is left out" in out
    assert "Scaling efficiency: speedup / (processes / 1)" in out and "the same batch per process (4 images)" in out


def test_runs_of_different_recipes_are_not_compared(metrics, tmp_path, capsys):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({**r, "per_process_batch": 8}) + "\n" for r in read_metrics(metrics[2])))
    assert report.main([str(metrics[1]), str(other)]) == 0
    out = capsys.readouterr().out
    assert "## Scaling" not in out and "No scaling table: that needs runs of one recipe" in out


def test_appended_runs_are_told_apart_and_cut_lines_skipped(metrics, tmp_path, capsys):
    both = tmp_path / "both.jsonl"
    both.write_text(metrics[1].read_text() + '{"epoch": 0, "val_accuracy": 0.5}\n'  # an --eval-only result
                    + metrics[2].read_text() + '{"epoch": 3, "train_lo')  # cut by a crash
    assert report.main([str(both)]) == 0
    captured = capsys.readouterr()
    run_ids = [read_metrics(path)[0]["run_id"] for path in (metrics[1], metrics[2])]
    assert [row["Run"] for row in _rows(captured.out, "Runs")] == [f"both.jsonl ({run_id})" for run_id in run_ids]
    assert "skipped 1 line(s) that are not epoch records" in captured.err
    assert "left out 1 --eval-only result(s) (epoch 0): the tables are of training epochs" in captured.err


def test_a_run_resumed_on_another_number_of_processes_says_so_and_is_not_a_scaling_point(metrics, tmp_path,
                                                                                          capsys):
    resumed = tmp_path / "resumed.jsonl"
    one, two = read_metrics(metrics[1]), read_metrics(metrics[2])
    # Epoch 1 on 1 process, epoch 2 on 2, with --batch-size kept: half of it on each.
    records = [one[0], {**two[1], "run_id": one[0]["run_id"], "per_process_batch": one[0]["per_process_batch"] // 2}]
    resumed.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.main([str(metrics[1]), str(resumed)]) == 0
    out = capsys.readouterr().out
    assert [row["Processes"] for row in _rows(out, "Runs")] == ["1", "1 then 2"]
    # Each epoch's share of the batch, as Processes: it showed the last epoch's alone.
    batches = [records[0]["per_process_batch"], records[1]["per_process_batch"]]
    assert [row["Batch per process"] for row in _rows(out, "Runs")] == [str(batches[0]),
                                                                       f"{batches[0]} then {batches[1]}"]
    assert f"Left out of scaling tables: {resumed.name}, resumed on another number of processes." in out
    assert "## Scaling" not in out


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


NVIDIA_SMI_CSV = """\
timestamp, index, name, utilization.gpu [%], utilization.memory [%], memory.total [MiB], memory.used [MiB]
2026/11/21 12:00:00.000, 0, NVIDIA GH200 480GB, 90 %, 40 %, 97871 MiB, 20000 MiB
2026/11/21 12:00:00.000, 1, NVIDIA GH200 480GB, 80 %, 40 %, 97871 MiB, 20000 MiB
2026/11/21 12:00:05.000, 0, NVIDIA GH200 480GB, 100 %, 40 %, 97871 MiB, 20000 MiB
2026/11/21 12:00:05.000, 1, NVIDIA GH200 480GB, [N/A], 40 %, 97871 MiB, 20000 MiB
timestamp, index, name, utilization.gpu [%], utilization.memory [%], memory.total [MiB], memory.used [MiB]
2026/11/21 12:01:00.000, 0, NVIDIA GH200 480GB, 95 %, 40 %, 97871 MiB, 20000 MiB
"""


def test_picture_and_gpu_log(metrics, tmp_path, capsys):
    gpu_log = tmp_path / "multigpu_7_gpu.csv"
    gpu_log.write_text(NVIDIA_SMI_CSV)  # the header repeats: a requeued job appended
    png = tmp_path / "runs.png"
    assert report.main([str(metrics[1]), str(metrics[2]), "--gpu-log", str(gpu_log), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert _png_size(png) == (1200, 800)
    gpus = _rows(out, "GPU utilization")
    assert [(row["GPU"], row["Samples"], row["Mean"]) for row in gpus] == [("0", "3", "95%"), ("1", "1", "80%")]
    assert gpus[0]["Minutes"] == "1.0"
    assert f"Picture written to {png}" in out and not list(tmp_path.glob(".runs.png.tmp*"))
    # Run again: its own picture is replaced; any other file, a metrics file among them, is kept.
    assert report.main([str(metrics[1]), "--plot", str(png)]) == 0 and _png_size(png) == (1200, 800)
    theirs = tmp_path / "theirs.png"
    theirs.write_bytes(png.read_bytes().replace(b"tools/report.py", b"somebody elses"))
    for kept in (metrics[1], theirs):
        before = kept.read_bytes()
        capsys.readouterr()
        assert report.main([str(metrics[1]), "--plot", str(kept)]) == 2
        assert capsys.readouterr().err == (f"report.py: error: --plot {kept} exists and is not a picture report.py "
                                           "wrote: choose a new file name, or move that file away first; nothing is "
                                           "overwritten\n")
        assert kept.read_bytes() == before
    jpeg = tmp_path / "runs.jpg"  # matplotlib would write a PNG under that name
    assert report.main([str(metrics[1]), "--plot", str(jpeg)]) == 2 and not jpeg.exists()
    assert capsys.readouterr().err == (f"report.py: error: --plot {jpeg}: report.py writes PNG pictures; give a name "
                                       "ending in .png, such as runs.png\n")


def test_without_matplotlib_the_tables_and_a_one_line_hint(metrics, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    png = tmp_path / "runs.png"
    assert report.main([str(metrics[1]), str(metrics[2]), "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert "## Runs" in captured.out and "## Scaling" in captured.out and not png.exists()
    assert captured.err.count("\n") == 1 and "matplotlib is not installed; get it with pip install matplotlib" \
        in captured.err


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "missing.jsonl", "missing.jsonl: No such file or directory"),
    (lambda d: (d / "w.jsonl").write_text('{"epoch": 0, "val_accuracy": 0.5}\n') and d / "w.jsonl",
     "w.jsonl holds --eval-only results only (1 evaluation(s), epoch 0), no training epochs to tabulate"),
    (lambda d: (d / "n.jsonl").write_text('{"loss": 0.5}\n') and d / "n.jsonl",
     "n.jsonl holds no epoch records (is it a --metrics-file"),
    (lambda d: (d / "w.pt").write_bytes(b"PK\x03\x04\x80\xff binary") and d / "w.pt",  # weights, not metrics
     "w.pt holds no epoch records"),
])
def test_bad_input_is_one_line(tmp_path, capsys, make, expected):
    assert report.main([str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(r"report\.py: error: .*" + re.escape(expected), err)


def test_a_bad_gpu_log_is_one_line(metrics, tmp_path, capsys):
    (tmp_path / "x.csv").write_text("not, a, gpu, log\n")
    assert report.main([str(metrics[1]), "--gpu-log", str(tmp_path / "x.csv")]) == 2
    assert "x.csv holds no samples with timestamp, index and utilization.gpu" in capsys.readouterr().err


def test_report_runs_as_a_script(metrics, tmp_path):
    result = run(python_cmd("tools/report.py", metrics[1]), cwd=tmp_path)
    assert result.returncode == 0 and "| one.jsonl | 2 | 1 |" in result.stdout, result.stderr


def test_gpu_utilization_and_power_from_the_metrics(metrics, tmp_path, capsys):
    """NVML's per-epoch means (train_utils via engine/monitor.py): weighted by training time, epoch 1
    left out, '-' for a run without them (the CPU)."""
    first, second = read_metrics(metrics[2])
    sampled = [{**first, "gpu_util_percent": 5.0, "gpu_power_w": 100.0},  # warm-up: left out
               {**second, "epoch_time_s": 1.0, "gpu_util_percent": 90.0, "gpu_power_w": 300.0},
               {**second, "epoch": 3, "epoch_time_s": 2.0, "gpu_util_percent": 60.0, "gpu_power_w": 150.0}]
    gpu_run = tmp_path / "gpu.jsonl"
    gpu_run.write_text("".join(json.dumps(r) + "\n" for r in sampled))
    png = tmp_path / "gpu.png"
    assert report.main([str(gpu_run), str(metrics[1]), "--plot", str(png)]) == 0
    rows = {row["Run"]: row for row in _rows(capsys.readouterr().out, "Runs")}
    assert (rows["gpu.jsonl"]["GPU util %"], rows["gpu.jsonl"]["GPU W"]) == ("70", "200")  # (90+2*60)/3, (300+300)/3
    assert (rows["one.jsonl"]["GPU util %"], rows["one.jsonl"]["GPU W"]) == ("-", "-")
    assert png.stat().st_size > 0


def test_a_profiled_epoch_is_left_out_of_the_throughput(metrics, tmp_path, capsys):
    first, second = read_metrics(metrics[1])
    records = [first, {**second, "profiled": True, "train_images": 8, "epoch_time_s": 8.0},  # 1 img/s
               {**second, "epoch": 3, "profiled": False, "train_images": 8, "epoch_time_s": 2.0}]  # 4 img/s
    path = tmp_path / "profiled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.main([str(path)]) == 0
    assert _rows(capsys.readouterr().out, "Runs")[0]["img/s after epoch 1"] == "4.0"
