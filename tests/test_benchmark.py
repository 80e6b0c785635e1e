"""benchmark.py in quick mode on the CPU: both recipes, both measures, and a table that
agrees with the rows it wrote."""

import json
import math

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
