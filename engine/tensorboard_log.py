"""--tensorboard DIR: each epoch's scalars as TensorBoard events, one folder per run. The
package is optional (the NGC PyTorch container has it) and imported only when asked for; a
disk that cannot take the events is one warning, never the end of a run.
"""

import importlib.util
import math
import threading
from pathlib import Path

from engine.errors import first_line, space_warning

TENSORBOARD_PIP = "pip install tensorboard"

# Epoch record key -> TensorBoard tag. Grouped by the part before "/" (TensorBoard's cards).
TENSORBOARD_TAGS = {
    "train_loss": "loss/train",
    "val_loss": "loss/validation",
    "val_accuracy": "accuracy/validation",
    "images_per_sec": "speed/images_per_s",
    "epoch_time_s": "speed/training_s_per_epoch",
    "eval_time_s": "speed/evaluation_s_per_epoch",
    "lr": "recipe/learning_rate",
    "peak_memory_gib": "gpu/peak_memory_gib",
    "gpu_util_percent": "gpu/utilization_percent",
    "gpu_power_w": "gpu/power_w",
}


def tensorboard_missing():
    """One line for a user who asked for --tensorboard without a working package, else None.
    The writer is imported here, at start, so that a broken install (protobuf, numpy) is this
    line on every rank rather than a traceback on rank 0 after the data is loaded."""
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # blocked (sys.modules["tensorboard"] = None)
        found = False
    if not found:
        return f"--tensorboard needs the tensorboard package, which is not installed: {TENSORBOARD_PIP}"
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception as err:  # anything an install can break
        return (f"--tensorboard: the tensorboard package does not load ({first_line(err)[:160]}); reinstall it: "
                f"{TENSORBOARD_PIP}")
    return None


class TensorBoardLog:
    """Epoch scalars of one run in DIR/RUN_ID (so runs sharing DIR are curves of their own, and
    a resumed run continues its own). ``first_epoch``: the epoch this process starts at; the
    events an interrupted process wrote from there on (after its last checkpoint) are dropped
    (purge_step), so each epoch shows once. A write that fails (a full disk) is one warning
    through ``warn`` and the end of the events, never of the run: every epoch is in the metrics
    and the checkpoints."""

    def __init__(self, directory, run_id, first_epoch, resumed, warn=print):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.path = Path(directory) / run_id
        self.warn = warn
        # tensorboard's writer thread re-raises a failed write, which Python would print as a
        # traceback; the failure comes back at the next flush, here, as the warning.
        self._thread_hook = threading.excepthook
        threading.excepthook = self._writer_thread_failed
        self.writer = None
        try:
            self.writer = SummaryWriter(str(self.path), purge_step=first_epoch if resumed else None)
        except OSError as err:
            self._failed(err, first_epoch)
        except BaseException:
            threading.excepthook = self._thread_hook
            raise

    def _writer_thread_failed(self, failure):  # threading.excepthook's ExceptHookArgs
        if not (isinstance(failure.exc_value, OSError) and type(failure.thread).__name__ == "_AsyncWriterThread"):
            self._thread_hook(failure)

    def _failed(self, err, epoch):
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()  # its thread and file: nothing more is written
            except OSError:
                pass
        self.warn(space_warning("TensorBoard events in", self.path, err,
                                f"no events from epoch {epoch} on (every epoch is in the metrics and checkpoints)"))

    def add(self, record):
        if self.writer is None:
            return
        try:
            for key, tag in TENSORBOARD_TAGS.items():
                value = record.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(tag, value, record["epoch"])
            self.writer.flush()  # an epoch takes minutes: show it now
        except OSError as err:  # raised by the writer's thread at the flush after it failed
            self._failed(err, record["epoch"])

    def close(self):
        try:
            if self.writer is not None:
                self.writer.close()
        except OSError:  # its warning came with the failed flush
            pass
        finally:
            threading.excepthook = self._thread_hook
