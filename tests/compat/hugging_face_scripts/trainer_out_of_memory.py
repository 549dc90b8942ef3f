"""The Trainer's ``--auto_find_batch_size`` on a model that runs out of device memory above 2
rows: it asks for 1 TiB there (an output it never reads). The Trainer tries smaller batches until
one fits, as on a GPU, where the run is refused only when CUDA's out-of-memory error reaches
accelerate's ``find_executable_batch_size``. Plain PyTorch on the CPU (``--deepspeed none``, the
reference) fails the same allocation with its CPU allocator's error, which accelerate also
knows. Writes the batch size found, the logged losses, the trained weights and, under
spmdzero, the bytes of the live device arrays (``--results``, JSON)."""

import argparse
import gc
import json

import torch
from transformers import Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--deepspeed", default="none")
parser.add_argument("--out", required=True)
parser.add_argument("--results", required=True)
args = parser.parse_args()

TOO_MANY_ROWS = 2


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)
        self.table = torch.nn.Parameter(torch.zeros(256, 1024))  # 1 MiB: the bytes an engine holds are seen

    def forward(self, x, labels):
        loss = ((self.fc(x).squeeze(-1) - labels) ** 2).mean() + (self.table ** 2).mean()
        out = {"loss": loss}
        if x.shape[0] > TOO_MANY_ROWS:  # 1 TiB: more than any device or host
            out["scratch"] = torch.ones(2 ** 38, device=x.device) * loss
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 8, generator=g), torch.randn(32, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


torch.manual_seed(0)
model = Regression()
training = TrainingArguments(
    output_dir=args.out, deepspeed=None if args.deepspeed == "none" else args.deepspeed,
    per_device_train_batch_size=8, auto_find_batch_size=True, max_steps=3, logging_steps=1, learning_rate=1e-2,
    max_grad_norm=0.0, report_to=[], save_strategy="no", seed=0, use_cpu=args.deepspeed == "none")
trainer = Trainer(model=model, args=training, train_dataset=Rows())
trainer.train()
results = {"batch_size": trainer._train_batch_size,
           "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "weight": trainer.model.fc.weight.detach().cpu().flatten().tolist(),
           "parameters": sum(p.numel() for p in model.parameters())}
if args.deepspeed != "none":  # the engine the Trainer trained with, and what the devices hold
    from spmdzero.observe.reports import live_device_bytes, model_state_bytes

    gc.collect()
    results["live_bytes"] = live_device_bytes()
    results["engine_bytes"] = model_state_bytes(trainer.model_wrapped).total
with open(args.results, "w") as f:
    json.dump(results, f)
