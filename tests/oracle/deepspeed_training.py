"""Record DeepSpeed's own ZeRO run of the shared training case (the test oracle).

    DS_ACCELERATOR=cpu [ZERO_STAGE=3] torchrun --nproc_per_node=4 tests/oracle/deepspeed_training.py OUT.json [bf16 [CKPT_DIR]]

ZERO_STAGE (default 2) is written into the case's config. At stage 3 DeepSpeed partitions the
module's parameters, so the final ones are read whole under ``deepspeed.zero.GatheredParameters``:
the module's own dtype (bf16 in bf16 runs, as stage 2's ``engine.module`` holds), not the fp32 masters.

With CKPT_DIR, DeepSpeed also saves a checkpoint there after SAVE_AFTER micro-steps (a
boundary), so the recorded losses after it are DeepSpeed's continuation from that checkpoint.

Needs deepspeed==0.19.8 (not a dependency of spmdzero). Writes per-micro-step global losses
(the mean over ranks), the lr after each step, and the final parameters.
"""

import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training_case import CONFIG, CONFIG_BF16, MICRO_BATCH, global_micro_batches, loss_fn, make_model  # noqa: E402


SAVE_AFTER = 12


def main(out_path: str, precision: str = "fp32", ckpt_dir: str = "") -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = make_model()
    config = CONFIG_BF16 if precision == "bf16" else CONFIG
    config = {**config, "zero_optimization": {**config["zero_optimization"],
                                              "stage": int(os.environ.get("ZERO_STAGE", "2"))}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, lrs = [], []
    for step, (x, y) in enumerate(global_micro_batches()):
        if ckpt_dir and step == SAVE_AFTER:
            engine.save_checkpoint(ckpt_dir, client_state={"epoch": 1})
        rows = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
        inputs = x[rows].to(torch.bfloat16) if precision == "bf16" else x[rows]  # DeepSpeed does not cast inputs
        loss = loss_fn(engine(inputs), y[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        lrs.append(engine.get_lr()[0])
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # a no-op below stage 3
        params = {n: p.detach().float().tolist() for n, p in engine.module.named_parameters()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"deepspeed_version": deepspeed.__version__, "config": config, "losses": losses, "lrs": lrs,
                       "saved_after": SAVE_AFTER if ckpt_dir else None,
                       "global_steps": engine.global_steps, "params": params}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
