"""Record a DeepSpeed ZeRO-3 checkpoint whose layout the shared case does not reach: a frozen
parameter (saved as per-rank fragments in the model files), sizes that 4 ranks do not divide
(each parameter's last slice padded) and two param groups (weights with weight decay, biases
without, as the HF Trainer makes them), beside the parameters DeepSpeed gathers whole from it.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=4 tests/oracle/deepspeed_zero3_layout.py OUT.json CKPT_DIR

Needs deepspeed==0.19.8 (not a dependency of spmdzero; kept out of the test venv, e.g.
``pip install --target DIR deepspeed==0.19.8`` and ``PYTHONPATH=DIR`` for this run). Trains 4 steps of AdamW at stage 3 in
fp32, saves, and writes the gathered parameters and which are frozen.
"""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "steps_per_print": 1000, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.0}}}
WEIGHT_DECAY = 0.1  # the weights' group
FROZEN = "0.bias"


def make_model() -> torch.nn.Module:
    """Widths 30 and 5: biases of 30 and 5 values and a 5 x 30 weight, none a multiple of 4."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
    model.get_parameter(FROZEN).requires_grad_(False)
    return model


def param_groups(model: torch.nn.Module) -> list[dict]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in trainable if n.endswith("weight")], "weight_decay": WEIGHT_DECAY},
            {"params": [p for n, p in trainable if not n.endswith("weight")], "weight_decay": 0.0}]


def main(out_path: str, ckpt_dir: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=CONFIG)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(4):
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 5, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(ckpt_dir)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().tolist() for n, p in engine.module.named_parameters()}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"deepspeed_version": deepspeed.__version__, "config": CONFIG, "frozen": [FROZEN],
                       "global_steps": engine.global_steps, "params": params}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
