"""Tensor parallelism across processes and machines, on torch.distributed.

    rank 0 (the engine process)                        ranks 1..N-1 (worker.py)
    scheduler, block manager, sampler                   a model shard, a KV pool shard
    ModelRunner.run ──StepPlan──> control group ──────> the same forward pass
          └─ forward: 2 all-reduces per layer <─ data group ─> └─ forward
    move_tokens ──MoveTokens──> ...                     move_tokens on its pool

group.py joins the ranks (gloo on CPU, NCCL on CUDA for the all-reduces; step plans always go
through a gloo group), launch.py starts the workers of this node and watches them, executor.py
is rank 0's side (one step plan per forward, heartbeats while idle), rank_zero.py its start-up
(calibrate, shard, Setup), worker.py the workers', messages.py what travels between them.
The model's side (which heads a rank holds, the sharded layers) is kvserve/model/parallel.py.
"""
