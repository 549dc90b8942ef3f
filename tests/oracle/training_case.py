"""The shared training case for the DeepSpeed comparison: model, data and config JSON.

Imported by the DeepSpeed oracle (``deepspeed_training.py``, run under torchrun) and by the
spmdzero test, so both sides train exactly the same thing.
"""

import torch

WORLD_SIZE = 4
MICRO_BATCH = 2
MICRO_STEPS = 24
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "steps_per_print": 1000,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.05}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_max_lr": 0.02,
                             "warmup_type": "linear"}},
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def global_micro_batches():
    """MICRO_STEPS global micro-batches of WORLD_SIZE * MICRO_BATCH samples; rank r's
    micro-batch is rows [r * MICRO_BATCH, (r + 1) * MICRO_BATCH)."""
    g = torch.Generator().manual_seed(1)
    n = WORLD_SIZE * MICRO_BATCH
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)) for _ in range(MICRO_STEPS)]


CONFIG_BF16 = {**CONFIG, "bf16": {"enabled": True}}


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output.float(), target)


def train_spmdzero(engine, start: int = 0) -> dict:
    """spmdzero's side: micro-steps ``start..`` of the case, as JSON-ready results."""
    losses, lrs = [], []
    for x, y in global_micro_batches()[start:]:
        loss = loss_fn(engine(x), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss)
        lrs.append(engine.get_lr()[0])
    return {"losses": [l.item() for l in losses], "lrs": lrs, "world": engine.dp_world_size,
            "global_steps": engine.global_steps,
            "params": {n: p.detach().float().cpu().tolist() for n, p in engine.module.named_parameters()}}
