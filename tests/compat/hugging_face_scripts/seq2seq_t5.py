"""A ``Seq2SeqTrainer`` script as transformers' translation and summarization examples write
it: a tiny T5 built from a config, ``predict_with_generate``, so evaluation and prediction
call ``model.generate`` (at ZeRO-3 with ``synced_gpus``, which all-reduces a flag each token).
Run unchanged under ``spmdzero launch`` (or, with ``--deepspeed none``, as plain PyTorch on the
CPU: the reference). Plain SGD: Adam's first update is the sign of each gradient element, so
elements that are rounding noise in both runs would move by the learning rate either way.
Writes the logged losses, the eval loss and the generated token ids to ``--results``."""

import argparse
import json

import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
parser.add_argument("--deepspeed", default="none")
parser.add_argument("--out", required=True)
parser.add_argument("--results", required=True)
args = parser.parse_args()


class Reverse(torch.utils.data.Dataset):
    """Learn to write the source backwards; 1 is the end-of-sequence token, 0 the padding."""

    def __init__(self, n, seed):
        self.ids = torch.randint(2, 12, (n, 4), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        eos = torch.ones(1, dtype=torch.long)
        return {"input_ids": torch.cat([self.ids[i], eos]), "attention_mask": torch.ones(5, dtype=torch.long),
                "labels": torch.cat([self.ids[i].flip(0), eos])}


torch.manual_seed(0)
config = T5Config(vocab_size=12, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, dropout_rate=0.0,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
model = T5ForConditionalGeneration(config)
training = Seq2SeqTrainingArguments(
    output_dir=args.out, deepspeed=None if args.deepspeed == "none" else args.deepspeed,
    per_device_train_batch_size=8, per_device_eval_batch_size=8, optim="sgd", learning_rate=0.5,
    lr_scheduler_type="constant", max_steps=24, logging_steps=1, save_strategy="no", report_to=[], seed=0,
    predict_with_generate=True, generation_max_length=6, use_cpu=args.deepspeed == "none")
trainer = Seq2SeqTrainer(model=model, args=training, train_dataset=Reverse(48, 1), eval_dataset=Reverse(16, 2))
trainer.train()
history = trainer.state.log_history
predicted = trainer.predict(Reverse(16, 2))
results = {
    "loss": [float(h["loss"]) for h in history if "loss" in h],
    "grad_norm": [float(h["grad_norm"]) for h in history if "loss" in h],
    "eval_loss": float(predicted.metrics["test_loss"]),
    "generated": predicted.predictions.tolist(),
    "engine": type(trainer.model_wrapped).__module__,
    # generate() calls the engine ran on the devices (0 for plain PyTorch)
    "device_generate_calls": getattr(getattr(trainer.model_wrapped, "generation", None), "calls", 0),
}
with open(args.results, "w") as f:
    json.dump(results, f)
print("results", json.dumps(results))
