"""Which captured training step wins on this GPU, outside train.py's loop: the guide's Wide
ResNet at batch 256, bf16 autocast, channels_last, fused SGD (momentum 0.9, Nesterov, weight
decay 5e-4) with a tensor learning rate the schedule fills each step, label smoothing 0.1;
synthetic batches already on the GPU (the device loader's case). Needs a CUDA GPU.

    python tools/capture_probe.py --out probe.json          # every variant, about 2 minutes on an H200
    python tools/capture_probe.py --only eager reduce-overhead

Variants: eager; torch.compile (default mode); torch.compile(mode="reduce-overhead"); the whole
step (forward, loss, backward, optimizer) captured in one torch.cuda.CUDAGraph (PyTorch's
"whole network capture") around the eager or the compiled model; torch.cuda.make_graphed_callables
on the model. Each: img/s over timed steps (CUDA events), the first call's seconds (compiling,
capturing), GPU kernels per step and the share of the profiled steps' wall time they ran
(torch.profiler: the profiler slows the host, so eager looks idler than it is), and its losses
over 8 fixed batches against eager's from the same weights. What the figures decided is in
BENCHMARKS.md (2026-11-27).
"""

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.cli import OneLineParser, run_cli  # noqa: E402
from engine.errors import UserError  # noqa: E402
from engine.files import check_writable  # noqa: E402
from engine.flags import positive_int  # noqa: E402
from engine.profiling import device_profiler, kernel_times  # noqa: E402
from model import WideResNet  # noqa: E402

BATCH, CLASSES = 256, 100


def make(seed=0):
    torch.manual_seed(seed)
    model = WideResNet(CLASSES).cuda().to(memory_format=torch.channels_last)
    lr = torch.tensor(0.1, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return model, opt, lr


def batches(n, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(BATCH, 3, 32, 32, device="cuda", generator=g).contiguous(memory_format=torch.channels_last),
             torch.randint(0, CLASSES, (BATCH,), device="cuda", generator=g)) for _ in range(n)]


LOSS = nn.CrossEntropyLoss(label_smoothing=0.1)


def lr_at(step):
    return 0.1 * (0.5 + 0.5 * torch.cos(torch.tensor(step / 1000.0)).item())  # a host float, as LambdaLR gives


def eager_step(model, opt, lr, fwd=None, graphs=False, autocast_cache=True):
    """A step as train.py runs it, calling ``fwd`` (the model compiled or graphed) for the model.
    ``graphs``: reduce-overhead's CUDA graphs, so each step begins with mark_step_begin and the
    loss is copied out of the graphs' memory; ``autocast_cache`` off for make_graphed_callables."""
    fwd = model if fwd is None else fwd  # not `or`: a compiled module has no truth value

    def step(x, y, i):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=autocast_cache):
            loss = LOSS(fwd(x), y)
        loss.backward()
        lr.fill_(lr_at(i))
        opt.step()
        return loss.detach().clone() if graphs else loss.detach()
    return step


def whole_step(model, opt, lr, fwd=None):
    """The documented whole-network capture: warm up on a side stream, capture once, replay."""
    fwd = model if fwd is None else fwd  # not `or`: a compiled module has no truth value
    sx = torch.empty(BATCH, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    sy = torch.zeros(BATCH, dtype=torch.long, device="cuda")
    state = {}

    def body():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = LOSS(fwd(sx), sy)
        loss.backward()
        opt.step()
        return loss.detach()

    def step(x, y, i):
        sx.copy_(x)
        sy.copy_(y)
        lr.fill_(lr_at(i))
        if "graph" not in state:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up: autotuning, lazy state, compile, on a side stream
                    opt.zero_grad(set_to_none=True)
                    body()
            torch.cuda.current_stream().wait_stream(side)
            opt.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                state["loss"] = body()
            state["graph"] = graph
            # the warm-up steps above stepped the weights three times: fine for timing, not for
            # the loss comparison, so it restarts from copies (below)
        state["graph"].replay()
        return state["loss"].clone()
    return step


def graphed_callables_step(model, opt, lr):
    sx = torch.randn(BATCH, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        fwd = torch.cuda.make_graphed_callables(model, (sx,))
    return eager_step(model, opt, lr, fwd, autocast_cache=False)


VARIANTS = {
    "eager": lambda m, o, lr: eager_step(m, o, lr),
    "compile": lambda m, o, lr: eager_step(m, o, lr, torch.compile(m)),
    "reduce-overhead": lambda m, o, lr: eager_step(m, o, lr, torch.compile(m, mode="reduce-overhead"), graphs=True),
    "whole-step graph (eager model)": lambda m, o, lr: whole_step(m, o, lr),
    "whole-step graph (compiled model)": lambda m, o, lr: whole_step(m, o, lr, torch.compile(m)),
    "make_graphed_callables": graphed_callables_step,
}


def measure(name, warmup, timed, data):
    model, opt, lr = make()
    step = VARIANTS[name](model, opt, lr)
    torch.cuda.synchronize()
    t = time.perf_counter()
    step(*data[0], 0)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    for i in range(1, warmup):
        step(*data[i % len(data)], i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(timed):
        step(*data[i % len(data)], warmup + i)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / timed
    # Kernels per step, and their GPU time over the unprofiled step's: the profiler slows the host,
    # so the profiled steps' own wall time would make a launch-bound step look idler than it is.
    profiler = device_profiler(torch.device("cuda"))
    with profiler:
        for i in range(5):
            step(*data[i % len(data)], i)
        torch.cuda.synchronize()
    kernel_ms, _, kernels = kernel_times(profiler.events())
    return {"variant": name, "images_per_sec": BATCH / ms * 1e3, "ms_per_step": ms, "first_call_s": first_s,
            "kernels_per_step": kernels / 5, "gpu_busy": min(1.0, kernel_ms / 5 / ms)}


def losses(name, data, steps=8):
    """Losses of ``steps`` steps from the same initial weights; the whole-step graph's warm-up
    steps its weights, so it (like the others) starts from a fresh copy taken after warm-up."""
    model, opt, lr = make()
    ref = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    step = VARIANTS[name](model, opt, lr)
    step(*data[0], 0)  # compile / capture
    torch.cuda.synchronize()
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(ref[0][k])
        for p in model.parameters():
            opt.state[p]["momentum_buffer"].zero_()
    torch.manual_seed(5)
    out = [step(*data[i], 1000 + i).float().item() for i in range(steps)]
    return out, [p.detach().float().clone() for p in model.parameters()]


def build_parser():
    parser = OneLineParser(prog="capture_probe.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", metavar="FILE.json", default=None,
                        help="also write the rows to this new file, after each variant")
    parser.add_argument("--warmup", metavar="STEPS", type=positive_int, default=20,
                        help="untimed steps first (default 20)")
    parser.add_argument("--timed", metavar="STEPS", type=positive_int, default=100, help="timed steps (default 100)")
    parser.add_argument("--only", metavar="VARIANT", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="these variants alone (default: all): " + ", ".join(VARIANTS))
    return parser


def main():
    opts = build_parser().parse_args()
    if opts.out:
        if Path(opts.out).exists():
            raise UserError(f"--out {opts.out} exists already; choose a new file name (nothing is overwritten)")
        check_writable(opts.out, "--out")
    if not torch.cuda.is_available():
        raise UserError("capture_probe.py measures CUDA graphs, and this machine has no CUDA GPU")
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    data = batches(8)
    rows = []
    ref_losses, ref_params = losses("eager", data)
    for name in opts.only:
        try:
            row = measure(name, opts.warmup, opts.timed, data)
            got, params = losses(name, data)
            row["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses))
            # All weights as one vector: a per-tensor ratio is dominated by tensors of nearly zero norm.
            row["param_rel_diff"] = (torch.cat([(p - q).flatten() for p, q in zip(params, ref_params)]).norm()
                                     / torch.cat([q.flatten() for q in ref_params]).norm()).item()
            row["losses"] = got
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            row = {"variant": name, "error": repr(err)[:400]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if opts.out:  # this run's own file, rewritten whole after each variant
            Path(opts.out).write_text(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                                                  "eager_losses": ref_losses, "rows": rows}, indent=1))
        torch.compiler.reset()
        torch.cuda.empty_cache()
    print("\n| variant | img/s | ms/step | first call s | kernels/step | GPU busy | loss rel diff | param rel diff |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'][:120]} |")
        else:
            kernels = "-" if r["kernels_per_step"] is None else f"{r['kernels_per_step']:.0f}"
            busy = "-" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.0f}%"
            print(f"| {r['variant']} | {r['images_per_sec']:,.0f} | {r['ms_per_step']:.2f} | {r['first_call_s']:.1f} | "
                  f"{kernels} | {busy} | {r['loss_max_rel_diff']:.2e} | {r['param_rel_diff']:.2e} |")


if __name__ == "__main__":
    run_cli(main)
