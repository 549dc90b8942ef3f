"""An accelerate training loop as users write it: ``Accelerator(deepspeed_plugin=...)``,
or ``Accelerator()`` configured by ``accelerate launch --config_file``'s environment,
``accelerator.prepare``, the loss computed outside the model, ``accelerator.backward``.
Runs unchanged under ``spmdzero launch``; with ``--plugin none`` it is the plain-PyTorch
reference on the CPU. Writes the losses and the final weights to ``--results`` (JSON)."""

import argparse
import json

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
parser.add_argument("--plugin", choices=["none", "hf_ds_config", "arguments", "environment"], required=True)
parser.add_argument("--config", default=None)
parser.add_argument("--results", required=True)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
loader = torch.utils.data.DataLoader(data, batch_size=8)
losses = []

if args.plugin == "none":
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = [p.detach().tolist() for p in model.parameters()]
else:
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if args.plugin == "hf_ds_config":
        plugin = DeepSpeedPlugin(hf_ds_config=args.config)
    elif args.plugin == "arguments":
        plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=0.5)
    else:  # "environment": what `accelerate launch --config_file` exports (ACCELERATE_USE_DEEPSPEED, ...)
        plugin = None
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print("distributed_type", accelerator.distributed_type, "engine", type(model).__module__)
    weights = [p.detach().cpu().tolist() for p in accelerator.unwrap_model(model).parameters()]
with open(args.results, "w") as f:
    json.dump({"loss": losses, "weights": weights}, f)
print("losses", losses)
