"""Train the guide's Wide ResNet on CIFAR-100, or your own model on your own images, with
DistributedDataParallel: N GPUs on one or many nodes, or N CPU processes (gloo) on a laptop.
Start it with torchrun:

    torchrun --standalone --nproc_per_node=4 train_ddp.py --batch-size 1024 --epochs 100 \\
        --base-lr 0.04 --target-accuracy 0.95 --patience 2
    torchrun --standalone --nproc_per_node=2 train_ddp.py --synthetic --epochs 1 --limit-batches 5
    torchrun --standalone --nproc_per_node=4 train_ddp.py --dataset fashion-mnist --epochs 10
    torchrun --standalone --nproc_per_node=4 train_ddp.py --model my_net.py:Net --dataset folder --data-dir images
    torchrun --standalone --nproc_per_node=4 train_ddp.py --checkpoint-dir ckpt --resume  # continue a run
    sbatch --account=nnXXXXk multigpu_job.sh --epochs 10     # 4 GPUs, one node
    sbatch --account=nnXXXXk multinode_job.sh --epochs 10    # 2 nodes x 4 GPUs

--batch-size is the global batch (split evenly over the processes); the recipe and every
flag are shared with train.py.
"""

from dataclasses import replace

from engine.errors import hold_stop_request, quiet_interrupt

quiet_interrupt()  # Ctrl-C while torch imports (seconds) ends the command without a traceback
hold_stop_request()  # a SIGUSR1 from now on stops training after its first step, with a checkpoint

from torch.nn.parallel import DistributedDataParallel as DDP

from engine.cli import recipe_imported, run_cli

with recipe_imported():  # recipe.py, the file you edit: a mistake in it is one line, not a traceback
    from device_utils import no_forward_buffer_sync, setup_distributed
    from engine.log import RunClock
    from engine.lost_ranks import process_group_scope
    from train_utils import build_task, check_outputs, fit, parse_args


def main():
    clock = RunClock()  # the run's wall time, joining the group, reading the data and building the model included
    args = parse_args(__doc__)
    # Reads torchrun's variables, picks the GPU, joins the group; NCCL dumps into the checkpoint folder on a hang
    # (not an evaluation's: it writes nothing into the training's folder).
    traces = None if args.eval_only else args.checkpoint_dir
    ctx = setup_distributed(args.collective_timeout, traces, device=args.device)
    # A rank that stops answering ends the run with one line naming it (exit 3), not a hang.
    with process_group_scope(ctx, args.collective_timeout, traces):
        check_outputs(args, ctx)  # before the data is read: an unwritable output fails now, not at the end
        task = build_task(args, ctx)  # this rank's shard of the data, the model on this rank's GPU
        # DDP broadcasts rank 0's weights here, so every rank starts from the same model.
        # No buffer broadcast before every forward (forward_sync_buffers=False, or
        # broadcast_buffers=False before PyTorch 2.13). Training uses batch
        # statistics, and fit broadcasts rank 0's BatchNorm running statistics before each
        # evaluation and checkpoint. gradient_as_bucket_view: gradients are views into the
        # all-reduce buckets, so no second copy of them is kept (with zero_grad(set_to_none=True)
        # each step's new gradient is still copied into its bucket once).
        model = DDP(task.model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                    gradient_as_bucket_view=True, **no_forward_buffer_sync())
        fit(replace(task, model=model), args, ctx, clock)


if __name__ == "__main__":
    run_cli(main)
