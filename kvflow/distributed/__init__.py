"""Tensor parallelism over torch.distributed: one model split across ranks by attention heads and MLP columns.

    group.py         the process group (gloo on CPU, NCCL on CUDA): made by kvflow's own launcher or by torchrun
    sharding.py      which rows and columns of each weight a rank keeps, and the sums that join the ranks' parts
    launch.py        starting the other ranks on this machine, and noticing when one dies
    step_channel.py  rank 0 tells the others what each step runs; they run the same step on their shard

The loop a rank other than 0 runs is the engine's (kvflow/engine/rank_worker.py): this package sits below
the executors, which shard a model with it, and knows nothing of the engine.
"""
