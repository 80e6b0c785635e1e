"""The seed tutorial's results table (standard PyTorch, NVIDIA DALI, AMP, without GPU), filled by
one command: MNIST written as a folder of PNG files, as the tutorial's DALI file reader expects,
then train.py on it once per row, the same model and recipe each time:

    python tools/tutorial_table.py                                   # 10,000 training images, 3 epochs
    python tools/tutorial_table.py --images 60000 --markdown table.md   # all of MNIST's
    srun --gpus=1 apptainer exec --nv "$CONTAINER_PATH" python tools/tutorial_table.py   # on Olivia

Rows (train.py's flags on top of the folder's):
    standard PyTorch   --loader torchvision --precision fp32: a DataLoader, one image at a time
    NVIDIA DALI        --loader dali --precision fp32: each PNG decoded every epoch, on the GPU
    DALI + AMP         --loader dali --precision auto: bf16 autocast where the GPU has it
    without GPU        --device cpu --loader torchvision --precision fp32: the tutorial's --no-cuda
Images per second: the training images of the epochs after the first (its warm-up excluded);
time: the whole train.py command, start-up and evaluation included. MNIST comes from
--data-dir (train.py's layout: MNIST/raw/) or, without it there, a learnable stand-in of the
same shape (tools/demo_data.py). A row that cannot run here (DALI not installed; no GPU for the
CPU row to differ) says why.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

if __package__ in (None, ""):  # run as python tools/NAME.py: the project's modules are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.cli import OneLineParser, run_cli  # noqa: E402
from engine.dali_loader import dali_installed, dali_package  # noqa: E402
from engine.data_formats import default_data_dir, missing_files, read_split  # noqa: E402
from engine.errors import UserError  # noqa: E402
from engine.flags import plugin_ref, positive_int  # noqa: E402
from engine.models import DEFAULT_MODEL  # noqa: E402
from engine.task import DATASETS  # noqa: E402
from tools.demo_data import write_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ROWS = {
    "standard PyTorch": ["--loader", "torchvision", "--precision", "fp32"],
    "NVIDIA DALI": ["--loader", "dali", "--precision", "fp32"],
    "DALI + AMP": ["--loader", "dali", "--precision", "auto"],
    "without GPU": ["--device", "cpu", "--loader", "torchvision", "--precision", "fp32"],
}


def mnist(data_dir, images, seed=0):
    """{split: (uint8 images (N, 28, 28, 1), labels (N,))}: MNIST's first ``images`` training and
    images / 5 test images, from ``data_dir`` or a learnable stand-in of its shape."""
    spec = DATASETS["mnist"]
    if missing_files(data_dir, spec):
        data_dir = Path(tempfile.mkdtemp(prefix="mnist-"))
        write_dataset(data_dir, "mnist", learnable=True, n_train=images, n_test=max(1, images // 5), seed=seed)
    return {split: tuple(array[:images if split == "train" else max(1, images // 5)]
                         for array in read_split(data_dir, split, spec)) for split in ("train", "test")}


def write_png_folder(root, splits):
    """DIR/train/CLASS/N.png and DIR/test/CLASS/N.png (gray PNGs) of ``splits``; returns the count."""
    written = 0
    for split, (images, labels) in splits.items():
        for i, (image, label) in enumerate(zip(images, labels)):
            folder = Path(root) / split / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image[:, :, 0]).save(folder / f"{i:05d}.png")
            written += 1
    return written


def measure(name, flags, folder, common, cwd):
    """(images/s after the first epoch, the command's seconds) of train.py with ``flags``."""
    metrics = Path(cwd) / f"{name.replace(' ', '_').replace('+', '')}.jsonl"
    command = [sys.executable, str(REPO / "train.py"), "--dataset", "folder", "--data-dir", str(folder), *common,
               *flags, "--metrics-file", str(metrics)]
    print(f"\n== {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return None, seconds, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "failed"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    later = records[1:] or records  # after the warm-up epoch, when there is one
    images = sum(r["train_images"] for r in later)
    return images / sum(r["epoch_time_s"] for r in later), seconds, None


def table(results, images, epochs, device):
    lines = [f"MNIST as PNG files, {images:,} training images, {epochs} epochs, on {device}", "",
             "| step of the tutorial | images/s | time (s) |", "| --- | ---: | ---: |"]
    for name, (rate, seconds, why) in results.items():
        lines.append(f"| {name} | {f'{rate:,.0f}' if rate else '-'} | "
                     f"{f'{seconds:.1f}' if why is None else f'- ({why})'} |")
    return lines


def build_parser():
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", metavar="N", type=positive_int, default=10_000,
                        help="MNIST training images to write (and N/5 test images); 60000 = all of them "
                             "(default: %(default)s)")
    parser.add_argument("--epochs", metavar="EPOCHS", type=positive_int, default=3,
                        help="epochs per row (the first is warm-up, not in images/s) (default: %(default)s)")
    parser.add_argument("--batch-size", metavar="IMAGES", type=positive_int, default=256,
                        help="images per step (default: %(default)s)")
    parser.add_argument("--model", metavar="FILE.py:NAME", type=plugin_ref, default=DEFAULT_MODEL,
                        help="the network, as train.py's --model (default: the guide's Wide ResNet)")
    parser.add_argument("--data-dir", metavar="DIR", default=str(default_data_dir()),
                        help="where MNIST is (MNIST/raw/), else a learnable stand-in of its shape "
                             "(default: %(default)s)")
    parser.add_argument("--rows", metavar="NAMES", default=",".join(ROWS),
                        help=f"the rows to measure, comma-separated (default: all: {', '.join(ROWS)})")
    parser.add_argument("--markdown", metavar="FILE.md", default=None, help="also append the table to this file")
    return parser


def main(argv=None):
    opts = build_parser().parse_args(argv)
    rows = [name.strip() for name in opts.rows.split(",")]
    unknown = [name for name in rows if name not in ROWS]
    if unknown:
        raise UserError(f"--rows: no row {unknown[0]!r}; the rows are {', '.join(ROWS)}")
    import torch  # after the flags: a mistake costs no import
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="tutorial-") as work:
        folder = Path(work) / "mnist_png"
        written = write_png_folder(folder, mnist(opts.data_dir, opts.images))
        print(f"Wrote {written:,} PNG files into {folder}")
        common = ["--model", opts.model, "--epochs", str(opts.epochs), "--batch-size", str(opts.batch_size),
                  "--target-accuracy", "1", "--log-interval", "0", "--cache-dir", str(Path(work) / "cache")]
        results = {}
        for name in rows:
            if "DALI" in name and not dali_installed():
                results[name] = (None, 0.0, f"DALI is not installed: pip install {dali_package()}")
            elif name == "without GPU" and not cuda:
                results[name] = (None, 0.0, "no GPU here: the standard PyTorch row runs on the CPU")
            else:
                results[name] = measure(name, ROWS[name], folder, common, work)
    lines = table(results, opts.images, opts.epochs, torch.cuda.get_device_name() if cuda else "the CPU")
    print("\n" + "\n".join(lines))
    if opts.markdown:
        with open(opts.markdown, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    run_cli(main)
