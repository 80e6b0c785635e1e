"""The engine: what train.py, train_ddp.py and the tools stand on, one concern per file. You
edit recipe.py, model.py and your own files; nothing here names a model, a data set or an
optimizer, so yours plug in without changes here. Imports flow one way: the top-level
scripts import the engine, and the engine imports no top-level module except the user's
files named on the command line (--model, --dataset FILE.py:NAME).

    errors.py        UserError, RunAborted, OutOfMemory, DatasetError, TrainingStopped: what ends a run with
                     one line, its exit status; a full disk; Ctrl-C and SIGUSR1 before training takes them
    cli.py           run_cli: those as one line and an exit status; OneLineParser: a bad command line as
                     one line; torchrun's variables, read without torch
    processes.py     who this process is (DistContext) and how the ranks agree
    lost_ranks.py    a rank that stopped answering, named in one line
    flags.py         the engine's flags, parsed with recipe.py's
    task.py          Task and DataInfo: where the loop meets the model and the data; what each built-in
                     --dataset is (DATASETS); labels checked, --val-fraction's stratified split
    plugins.py       loading the user's FILE.py:NAME
    models.py        --model built, probed and given --weights
    finetune.py      --finetune: the weights that fit, a new head, --freeze-backbone
    user_data.py     --dataset FILE.py:NAME read into memory
    data_formats.py  the built-in data sets' files: fetched, read, checked (not by --synthetic)
    image_folder.py  --dataset folder: scanned and decoded
    image_list.py    --loader dali's list of an image folder: each image checked once, no copy kept
    image_cache.py   the decoded images on disk: built once, space checked, verified on open
    dali_loader.py   --loader dali: DALI's pipeline per epoch, the project's order and shards
    memory.py        the device's memory; an error that ran out of it; the memory a training step needs, measured
    out_of_memory.py out of memory in one line: what to change, the command that continues
    seeds.py         every random stream from (seed, epoch, rank)
    compiling.py     --compile: its mode (CUDA graphs where safe), its caches in the checkpoint folder so a
                     requeued job does not compile again
    optimization.py  whatever optimizer and schedule recipe.py builds: fused safety, resume, names; the loss tried;
                     the schedule's cycles (warm restarts when a run is extended)
    own_scheduler.py recipe.make_scheduler's own scheduler checked: refused in one line, or a Note on its length
    model_ema.py     --model-ema: what AveragedModel averages, and when the loop updates it
    checkpoints.py   checkpoint folders, resume, Checkpointer
    weights.py       weights files: save, read (with what they were trained on and their --model), load, check;
                     --eval-only's images prepared, and held out, as their training had them
    files.py         atomic writes, outputs checked at start
    folder_lock.py   one run per checkpoint folder
    stopping.py      signals and --stop-file: all ranks stop after the same step
    log.py           the run's clock, the start-up block's pieces, each epoch's record and the metrics file
    monitor.py       GPU utilization and power, and the Monitors the loop sees
    profiling.py     --profile-dir: a torch.profiler window of a few steps, its trace and top operators
    tensorboard_log.py  --tensorboard: each epoch's scalars, one folder per run
    nccl_log.py      a DDP run's NCCL report (the library loaded, the network settings, the multi-node ones
                     missing); which network NCCL chose, from its own log (check_network.py)
    interfaces.py    GLOO_/NCCL_SOCKET_IFNAME checked against this node's interfaces
    exact_sums.py    check_network.py's data: sums exact in any order, a wrong one in one line
    bandwidth.py     message sizes, algbw and busbw as nccl-tests defines them
    all_reduce_timing.py  timed all-reduces that never hang or abort (check_network.py)
    private_torch.py the private PyTorch read (no public API has it), with fallbacks: CUDA-graph skips,
                     NCCL's flight recorder
"""
