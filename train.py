"""Train the guide's Wide ResNet on CIFAR-100, or your own model on your own images, with one
process: one GPU, or the CPU.

    python train.py --epochs 10                       # downloads CIFAR-100 to ./datasets if missing
    python train.py --optimizer adamw --epochs 10     # your recipe: recipe.py's flags, or edit recipe.py
    python train.py --dataset mnist --epochs 5        # the model gets 1 input channel and 10 classes
    python train.py --model my_net.py:Net --dataset folder --data-dir images --epochs 30   # your own
    python train.py --synthetic --epochs 1 --limit-batches 20   # smoke run, no data needed
    python train.py --epochs 100 --checkpoint-dir ckpt [--resume]  # survives kills and time limits
    python train.py --loader torchvision --num-workers 8   # a DataLoader instead of data on the GPU
    python train.py --dataset folder --data-dir photos --val-fraction 0.2 --loader dali   # DALI decodes on the GPU
    python train.py --device cpu --epochs 1           # the CPU although there is a GPU
    torchrun --standalone --nnodes=1 --nproc_per_node=1 train.py --batch-size 256 --epochs 100 \\
        --base-lr 0.01 --target-accuracy 0.95 --patience 2
    sbatch --account=nnXXXXk singlegpu_job.sh --epochs 10

The recipe and every flag are shared with train_ddp.py, so 1-GPU and N-GPU runs compare
like with like.
"""

from engine.errors import hold_stop_request, quiet_interrupt

quiet_interrupt()  # Ctrl-C while torch imports (seconds) ends the command without a traceback
hold_stop_request()  # a SIGUSR1 from now on stops training after its first step, with a checkpoint

from engine.cli import recipe_imported, run_cli

with recipe_imported():  # recipe.py, the file you edit: a mistake in it is one line, not a traceback
    from device_utils import single_process_context
    from engine.log import RunClock
    from train_utils import build_task, check_outputs, fit, parse_args


def main():
    clock = RunClock()  # the run's wall time, reading the data and building the model included
    args = parse_args(__doc__)
    ctx = single_process_context(args.device)
    check_outputs(args, ctx)  # before the data is read: an unwritable output fails now, not at the end
    task = build_task(args, ctx)  # the model and the data of --model and --dataset
    fit(task, args, ctx, clock)


if __name__ == "__main__":
    run_cli(main)
