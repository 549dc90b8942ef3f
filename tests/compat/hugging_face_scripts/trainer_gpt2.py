"""A Hugging Face ``Trainer`` script as users write it: a tiny GPT-2 built from a config,
synthetic tokens, ``TrainingArguments(deepspeed=...)``. Run unchanged under ``spmdzero launch``
(or, with ``--deepspeed none``, as plain PyTorch on the CPU: the reference). Writes what it
saw to ``--results`` (JSON): the logged losses, learning rates and gradient norms, the eval
loss, and what the engine was built with."""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
parser.add_argument("--deepspeed", default="none")
parser.add_argument("--out", required=True)
parser.add_argument("--results", required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save_steps", type=int, default=3)
parser.add_argument("--resume", default=None)
parser.add_argument("--bf16", action="store_true")
parser.add_argument("--scheduler", default="constant_with_warmup")
parser.add_argument("--dropout", type=float, default=0.0)  # GPT-2's stock dropouts (0.1) when set
args = parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 96, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=args.dropout,
                    embd_pdrop=args.dropout, attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
training = TrainingArguments(
    output_dir=args.out, deepspeed=None if args.deepspeed == "none" else args.deepspeed,
    per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-3,
    lr_scheduler_type="constant" if args.scheduler == "deepspeed_warmup" else args.scheduler, warmup_steps=2, max_steps=args.steps, logging_steps=1,
    save_steps=args.save_steps, save_strategy="steps", eval_strategy="no", report_to=[], seed=0, bf16=args.bf16,
    use_cpu=args.deepspeed == "none")  # the DataLoader pins memory, the Trainer's default
optimizers = (None, None)
if args.scheduler == "deepspeed_warmup":  # the reference for DeepSpeed's WarmupLR (linear, 2 steps, from 0):
    # its first two updates use lr 0 (set at construction, then iteration 0), then 1/2, then all
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, weight_decay=0.0)
    optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, max(0, s - 1) / 2)))
trainer = Trainer(model=model, args=training, train_dataset=Tokens(64, 1), eval_dataset=Tokens(16, 2),
                  optimizers=optimizers)
trainer.train(resume_from_checkpoint=args.resume)
history = trainer.state.log_history
results = {
    "steps": [h["step"] for h in history if "loss" in h],
    "loss": [float(h["loss"]) for h in history if "loss" in h],
    "lr": [float(h["learning_rate"]) for h in history if "loss" in h],
    "grad_norm": [float(h["grad_norm"]) for h in history if "loss" in h],
    "eval_loss": trainer.evaluate()["eval_loss"],
}
if trainer.is_deepspeed_enabled:
    engine = trainer.model_wrapped
    results["engine"] = {
        "class": type(engine).__module__, "optimizer": type(engine.optimizer).__name__,
        "bf16": engine.bfloat16_enabled(), "gas": engine.gradient_accumulation_steps(),
        "micro": engine.train_micro_batch_size_per_gpu(), "clipping": engine.gradient_clipping(),
        "deepspeed_version": __import__("importlib.metadata").metadata.version("deepspeed"),
    }
trainer.save_model(os.path.join(args.out, "final"))
reloaded = GPT2LMHeadModel.from_pretrained(os.path.join(args.out, "final"))
state = {k: v.float() for k, v in trainer.model.state_dict().items()}
results["reloaded_equal"] = all(torch.equal(v.float(), state[k]) for k, v in reloaded.state_dict().items())
results["reloaded_max_diff"] = max(float((v.float() - state[k]).abs().max()) for k, v in reloaded.state_dict().items())
with open(args.results, "w") as f:
    json.dump(results, f)
print("results", json.dumps(results))
