"""train_utils.py's lines (progress for terminals and batch logs, epoch lines, ETA, the
summary), and engine/log.py's run clock and a metrics file that survives a failing disk. Pure
functions are called directly."""

import io
from types import SimpleNamespace
import json
import re
import sys

import pytest
import torch

from engine import cli
from engine import log as run_log
from engine.errors import UserError
from engine.processes import DistContext
import train_utils as tu


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _show(stream, clock, interval_s, steps=4):
    """Run a 4-batch phase, one second per batch; count the calls of the (GPU-syncing) detail."""
    calls = []
    progress = tu.Progress(True, "Epoch 1/3", steps, interval_s, stream=stream, clock=clock)
    for step in range(1, steps + 1):
        clock.now += 1.0
        progress.update(step, 8 * step, lambda: calls.append(step) or "loss 2.0000")
    progress.close()
    return calls


def test_progress_in_a_batch_log_is_timestamped_lines_at_most_every_interval():
    log, clock = io.StringIO(), FakeClock()
    calls = _show(log, clock, interval_s=2.0, steps=6)
    lines = log.getvalue().splitlines()
    # Steps at 1 s each: lines at 2 s and 4 s; step 6 is the last (its epoch line follows).
    assert calls == [2, 4] and len(lines) == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d Epoch 1/3 \[2/6\] loss 2\.0000, 8\.0 img/s, 0:00:04 left",
                        lines[0])
    assert lines[1].endswith("[4/6] loss 2.0000, 8.0 img/s, 0:00:02 left")


def test_progress_on_a_terminal_is_one_updating_line_and_none_when_disabled():
    terminal, clock = FakeTerminal(), FakeClock()
    calls = _show(terminal, clock, interval_s=0)  # the terminal ignores --log-interval
    shown = terminal.getvalue()
    assert calls == [1, 2, 3] and "\n" not in shown
    assert "\rEpoch 1/3 [1/4] loss 2.0000, 8.0 img/s, 0:00:03 left\033[K" in shown and shown.endswith("\r\033[K")
    for enabled, interval_s in ((True, 0), (False, 1)):  # --log-interval 0, or not rank 0
        log = io.StringIO()
        progress = tu.Progress(enabled, "x", 4, interval_s, stream=log, clock=FakeClock())
        progress.update(1, 8, lambda: pytest.fail("no line, so no GPU sync"))
        assert log.getvalue() == ""


def test_progress_of_a_resumed_epoch_counts_only_its_own_batches():
    log, clock = io.StringIO(), FakeClock()
    progress = tu.Progress(True, "Epoch 2/3", 10, 1.0, first=6, stream=log, clock=clock)
    clock.now += 2.0
    progress.update(8, 16)  # 2 batches in 2 s: 2 left take 2 s
    assert "[8/10], 8.0 img/s, 0:00:02 left" in log.getvalue()


@pytest.mark.parametrize("seconds, text", [(0, "0:00:00"), (59.6, "0:01:00"), (3725, "1:02:05"),
                                           (90000, "1d 1:00:00"), (None, "?"), (float("nan"), "?")])
def test_duration(seconds, text):
    assert tu.duration(seconds) == text


def test_eta_leaves_out_this_processs_first_epoch():
    assert tu.eta_seconds([], 5) is None
    assert tu.eta_seconds([30.0], 2) == 60.0  # nothing else known yet
    assert tu.eta_seconds([30.0, 10.0, 12.0], 3) == pytest.approx(33.0)
    assert tu.eta_seconds([30.0, 10.0], 0) == 0.0
    # Resumed after an epoch's last step: no epoch measured here yet, the run's own records then
    earlier = [{"epoch_time_s": 9.0, "eval_time_s": 1.0}, {"epoch_time_s": 11.0, "eval_time_s": 1.0}]
    assert tu.eta_seconds([], 3, earlier) == pytest.approx(33.0) and tu.eta_seconds([30.0], 3, earlier) == 90.0


def test_the_eta_after_a_resume_leaves_out_the_start_up_and_scales_a_partial_epoch():
    """A resumed process: 20 s of start-up (the data, a checkpoint read) before the loop, then the
    second half of an epoch in 4 s: the pace is 8 s per epoch, not 24 s."""
    ticks = iter([0.0, 20.0, 24.0, 32.0, 33.0])
    clock = run_log.RunClock(now=lambda: next(ticks))
    clock.loop_started()
    clock.epoch_done(0.5)
    assert clock.epoch_walls == [8.0] and tu.eta_seconds(clock.epoch_walls, 2) == 16.0
    clock.epoch_done()
    assert clock.epoch_walls == [8.0, 8.0] and clock.elapsed() == 33.0
    assert run_log.RunClock(now=lambda: 5.0).epoch_walls == []


def test_the_length_line_promises_an_early_stop_only_where_one_can_come_before_the_last_epoch():
    """A new user's walk: 'Length: 1 epoch, or fewer' with --patience 2 promised what cannot be."""
    assert run_log.describe_length(3, 0.95, 2).startswith("Length: 3 epochs, or fewer: early stop once validation ")
    for epochs in (1, 2):
        assert run_log.describe_length(epochs, 0.95, 2) == (
            f"Length: {epochs} epoch{'s' if epochs > 1 else ''} (no early stop: it takes validation accuracy at "
            "least 0.95 for 2 epochs in a row, --patience)")
    assert run_log.describe_length(1, None, 2) == "Length: 1 epoch (no early stop: --target-accuracy off)"


def test_epoch_line_starts_with_a_timestamp_and_ends_with_elapsed_and_eta():
    record = {"epoch": 3, "epoch_time_s": 9.8191, "train_loss": 3.12341, "val_loss": 2.6997, "val_accuracy": 0.3386,
              "images_per_sec": 5084.21, "lr": 0.0099, "eval_time_s": 1.04}
    line = tu.epoch_line(record, 100, 125.0, 3600.4)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d Epoch 3/100: Time=9\.819s, Train Loss=3\.1234, "
                        r"Val Loss=2\.6997, Val Accuracy=0\.3386, Throughput=5084\.2 img/s, LR=0\.0099, "
                        r"Eval=1\.0s \| elapsed 0:02:05, ETA 1:00:00", line)


def test_metrics_are_appended_never_rewritten(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    run_log.RunLogger(True, path).record({"epoch": 1})
    run_log.RunLogger(True, path).record({"epoch": 2})
    run_log.RunLogger(False, path).record({"epoch": 99})  # not rank 0: writes nothing
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_metrics_line_that_cannot_be_written_is_kept_for_the_next_one(tmp_path):
    (tmp_path / "logs").write_text("a file where the folder should be")  # every write fails
    out = io.StringIO()
    logger = run_log.RunLogger(True, tmp_path / "logs" / "m.jsonl", stream=out)
    logger.record({"epoch": 1})
    assert out.getvalue().startswith(f"WARNING: cannot append to --metrics-file {tmp_path / 'logs' / 'm.jsonl'} (")
    assert out.getvalue().endswith("); 1 line kept in memory for the next epoch\n")  # no checkpoints
    (tmp_path / "logs").unlink()  # the disk is back
    logger.record({"epoch": 2})
    assert [json.loads(line)["epoch"] for line in (tmp_path / "logs" / "m.jsonl").read_text().splitlines()] == [1, 2]
    assert logger.pending == []


def _record(epoch, seconds, accuracy, **extra):
    return {"epoch": epoch, "epoch_time_s": seconds, "eval_time_s": 0.5, "train_images": 100,
            "val_accuracy": accuracy, "val_samples": 320, **extra}


def test_summary_separates_warm_up_training_evaluation_and_wall_time():
    records = [_record(1, 4.0, 0.1), _record(2, 1.0, 0.3), _record(3, 1.0, 0.2, device="CPU: x", peak_memory_gib=None)]
    ctx = DistContext(device=torch.device("cpu"), world_size=8, local_world_size=4)
    text = "\n".join(tu.summarize(records, ctx, test_size=10_000, wall_s=9.5))
    assert "Final Accuracy: 0.2000 on 320 of 10000 test images (--limit-batches) (best 0.3000 at epoch 2)" in text
    assert ("Time: training 6.0s + evaluation 1.5s over the run's 3 epochs; wall time 9.5s (reading the data, start-up "
            "and checkpoints included; Python's imports not)") in text
    resumed = "\n".join(tu.summarize(records, ctx, test_size=10_000, wall_s=9.5, resumed=True))
    assert "over the run's 3 epochs (those before the resume too); wall time of this start 9.5s" in resumed
    records[0].update(world_size=2, nodes=1)  # epoch 1 trained on 2 processes before the resume
    resumed = "\n".join(tu.summarize(records, ctx, test_size=10_000, wall_s=9.5, resumed=True))
    assert ("Number of nodes: 2, CPU processes per node: 4, total CPU processes: 8 (epochs before the resume: "
            "2 processes on 1 node)") in resumed
    assert "Throughput: 50.0 img/s" in text and "excluding epoch 1 (warm-up): 100.0 img/s" in text
    assert "Number of nodes: 2" in text and "total CPU processes: 8" in text
    assert "on all 320 test images" in "\n".join(tu.summarize(records, ctx, test_size=320))


def test_a_data_set_of_the_wrong_size_is_said():
    """As read: the splits --val-fraction makes out of the training images are no warning."""
    def cifar(train, test):
        return SimpleNamespace(title="CIFAR-100", expected_sizes={"train": 50_000, "test": 10_000},
                               read_sizes={"train": train, "test": test})

    assert run_log.size_warning(cifar(64, 10_000)) == [
        "WARNING: this CIFAR-100 has 64 training images instead of 50000: a small copy (tools/demo_data.py), an "
        "incomplete one, or other files?"]
    assert run_log.size_warning(cifar(64, 9)) == [
        "WARNING: this CIFAR-100 has 64 training images instead of 50000 and 9 test images instead of 10000: a "
        "small copy (tools/demo_data.py), an incomplete one, or other files?"]
    assert run_log.size_warning(cifar(50_000, 10_000)) == []
    assert run_log.size_warning(SimpleNamespace(title="my folder", expected_sizes=None, read_sizes={"train": 64})) == []


def test_an_error_line_is_one_write(monkeypatch):
    """Processes sharing stderr (srun's nodes, torchrun's ranks) must not interleave their lines:
    print() writes a line's text and its newline apart."""
    writes = []

    class Recording(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    def mistake():  # a node's own error, which every node prints
        raise UserError("GLOO_SOCKET_IFNAME=hsn0: node n1 has no such interface", same_on_every_rank=False)
    monkeypatch.setattr(sys, "stderr", Recording())
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as exit_:
        cli.run_cli(mistake)
    assert exit_.value.code == 2
    assert writes == ["[rank 3] error: GLOO_SOCKET_IFNAME=hsn0: node n1 has no such interface\n"]
