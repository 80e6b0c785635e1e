"""benchmark.py in quick mode on the CPU: both recipes, both measures, and a table that
agrees with the rows it wrote."""

import json
import math
import re

import pytest

import gpu_report
import monitor
from conftest import error_lines, run_main

REQUIRED = {"recipe", "measure", "images_per_sec", "device", "batch_size", "precision", "loader"}


def test_quick_benchmark_measures_both_recipes_and_writes_the_rows(tmp_path, capsys):
    rows_path = tmp_path / "rows.json"
    assert run_main("benchmark.py", "--quick", "--data-dir", tmp_path / "no-data", "--json", rows_path,
                    "--profile", "1") == 0
    out = capsys.readouterr().out
    profile = out[out.index("== torch.profiler: 1 training steps of the project recipe, by CPU time"):]
    assert "aten::convolution_backward" in profile and "Self CPU time total" in profile
    rows = json.loads(rows_path.read_text())
    assert all(REQUIRED <= row.keys() for row in rows)
    found = {(row["recipe"], row["measure"], row["loader"]): row for row in rows}
    for measure in ("pipeline", "train"):
        guide, project = found[("guide", measure, "torchvision")], found[("project", measure, "device")]
        assert guide["workers"] == 0 and guide["precision"] == project["precision"] == "fp32"  # on the CPU
        assert guide["batch_size"] == project["batch_size"] == 32
        for row in (guide, project):
            assert row["device"].startswith("CPU") and row["data"] == "synthetic"
            assert 0 < row["images_per_sec"] < math.inf
        ratio = project["images_per_sec"] / guide["images_per_sec"]
        assert any(line.startswith(measure) and line.endswith(f"{ratio:.1f}x") for line in out.splitlines())
    project_torchvision = [row for row in rows if row["recipe"] == "project" and row["loader"] == "torchvision"]
    assert 0 in {row["workers"] for row in project_torchvision}  # the guide's setting, for comparison
    assert {row["warmup_steps"] for row in rows if row["measure"] == "train"} == {1}
    assert f"Rows written to {rows_path}" in out


def test_an_unwritable_json_path_fails_before_measuring(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert run_main("benchmark.py", "--quick", "--json", tmp_path / "file" / "rows.json") == 2
    captured = capsys.readouterr()
    assert error_lines(captured.err) == [captured.err.strip()] and "--json" in captured.err
    assert "recipe" not in captured.out  # nothing was measured


# ---------------------------------------------------------------------------------------------
# --report (gpu_report.py): it measures a GPU; here, its pieces and its refusal without one.

def test_report_needs_a_gpu_and_says_so_in_one_line(tmp_path, capsys):
    assert run_main("benchmark.py", "--report", tmp_path / "report.md") == 2
    captured = capsys.readouterr()
    assert error_lines(captured.err) == [captured.err.strip()]
    assert "--report measures a CUDA GPU and this machine has none" in captured.err
    assert not (tmp_path / "report.md").exists() and "recipe" not in captured.out


def _figures(eager, compiled, split):
    rows = [{"recipe": recipe, "measure": measure, "loader": loader, "images_per_sec": value, "batch_size": 256,
             "data": "synthetic"}
            for recipe, loader, values in (("guide", "torchvision", (5000.0, 5100.0)),
                                           ("project", "device", (90000.0, eager)))
            for measure, value in zip(("pipeline", "train"), values)]
    versions = {"gpu": "NVIDIA H100 80GB HBM3, 79.1 GiB", "driver": "570.1", "torch": "2.8.0", "cuda": "12.9",
                "cudnn": 91000, "nccl": "2.27.3", "torchvision": "0.23.0", "python": "3.12.3", "machine": "aarch64"}
    return gpu_report.Figures(versions=versions, rows=rows, compiled={"images_per_sec": compiled, "warmup_s": 95.0},
                              split=split, peaks={256: 5.5, 1024: 21.0}, tier="30 passed, 1 skipped in 250.0s",
                              seconds=500.0)


def test_report_block_and_its_recommendation():
    split = {"convolutions and matmuls": 45.0, "normalization and element-wise": 38.0, "idle": 12.0, "other": 5.0}
    text = gpu_report.markdown(_figures(20000.0, 26000.0, split), "python benchmark.py --report r.md")
    lines = text.splitlines()
    assert lines[0].startswith("## ") and "NVIDIA H100 80GB HBM3" in lines[0] and "torch 2.8.0, CUDA 12.9" in lines[0]
    assert "| train | 5,100 | 20,000 | 26,000 (compiling: 95 s) |" in lines
    assert "| pipeline | 5,000 | 90,000 | - |" in lines
    assert "Peak GPU memory of training steps: batch 256: 5.50 GiB, batch 1024: 21.00 GiB" in lines
    assert "GPU tier (`python -m pytest -q tests/test_gpu.py`): 30 passed, 1 skipped in 250.0s" in lines
    assert "- --compile trains 1.30x as fast as the eager defaults (20,000 -> 26,000 img/s)" in text
    assert "make it the default on CUDA" in text
    assert "- Largest part of a step: convolutions and matmuls (45% of its wall time)" in text
    assert "- Goal of 25,000 img/s on one GPU: met (26,000 img/s" in text
    slow = gpu_report.recommendation(_figures(20000.0, 20200.0, {**split, "idle": 60.0}))
    assert slow[0].startswith("--compile gives 1.01x") and "keep it off by default" in slow[0]
    assert slow[1].startswith("Largest part of a step: idle (60% of its wall time)")
    assert slow[2].startswith("Goal of 25,000 img/s on one GPU: missed by 19%")


def test_profile_split_of_a_real_profile():
    import torch
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU())
    x = torch.randn(8, 3, 32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        conv(x).sum().backward()
    times = monitor.top_operators(profiler.key_averages(), device_time=False, limit=None)
    total = times.compute_ms
    split = gpu_report.profile_split(times.rows, wall_ms=2 * total)  # half of the wall time computing
    assert split["idle"] == pytest.approx(50.0)
    assert sum(share for part, share in split.items() if part != "idle") == pytest.approx(50.0)
    assert split["convolutions and matmuls"] > 0 and split["normalization and element-wise"] > 0
    assert gpu_report.category("aten::cudnn_convolution") == "convolutions and matmuls"
    assert gpu_report.category("aten::native_batch_norm") == "normalization and element-wise"
    assert gpu_report.category("nccl:all_reduce") == "communication"


def test_gpu_tier_summary_on_this_machine():
    """No GPU here: the tier is collected and skipped, and the summary says so."""
    summary = gpu_report.run_gpu_tier(timeout_s=300)
    assert re.fullmatch(r"\d+ skipped in [\d.]+s( \(\d+:\d+:\d+\))?", summary), summary
    assert gpu_report.run_gpu_tier(timeout_s=10).startswith("not run (no time left)")
