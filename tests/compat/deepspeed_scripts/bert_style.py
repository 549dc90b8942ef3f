"""Masked-LM pretraining of a small RoBERTa, the way DeepSpeedExamples' HelloDeepSpeed
(train_bert_ds.py) does it: its own DataLoader and pad-to-longest collator."""

import argparse
import os
import pathlib
import random
from typing import Dict, List, Tuple

import deepspeed
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator
from torch.utils.data import DataLoader, Dataset
from transformers.models.roberta import RobertaConfig, RobertaModel

PAD = 1


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def collate_function(batch: List[Tuple[List[int], List[int]]], pad_token_id: int) -> Dict[str, torch.Tensor]:
    """Pad to the longest sequence in the batch (HelloDeepSpeed's collator)."""
    max_length = max(len(token_ids) for token_ids, _ in batch)
    src = torch.LongTensor([t + [pad_token_id] * (max_length - len(t)) for t, _ in batch])
    tgt = torch.LongTensor([t + [pad_token_id] * (max_length - len(t)) for _, t in batch])
    return {"src_tokens": src, "tgt_tokens": tgt, "attention_mask": src.ne(pad_token_id).type_as(src)}


class SyntheticMLMDataset(Dataset):
    """Masked token lists of varying length, in place of wikitext + a tokenizer."""

    def __init__(self, n: int, vocab: int, max_len: int, seed: int = 0):
        rng = random.Random(seed)
        self.items = []
        for _ in range(n):
            labels = [rng.randrange(3, vocab) for _ in range(rng.randrange(max_len - 4, max_len + 1))]
            tokens = [4 if rng.random() < 0.15 else t for t in labels]
            self.items.append((tokens, labels))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        return self.items[idx]


class InfiniteIterator:
    def __init__(self, iterable):
        self._iterable, self._iterator = iterable, iter(iterable)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._iterable)
            return next(self._iterator)


class RobertaMLMModel(nn.Module):
    def __init__(self, config: RobertaConfig, encoder: RobertaModel):
        super().__init__()
        self.encoder = encoder
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        hidden = self.encoder(input_ids=src_tokens, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt_tokens.reshape(-1),
                                           ignore_index=PAD)


def create_model(num_layers, num_heads, ff_dim, h_dim, vocab):
    config = RobertaConfig.from_dict({
        "hidden_size": h_dim, "intermediate_size": ff_dim, "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers, "vocab_size": vocab, "pad_token_id": PAD, "type_vocab_size": 1,
        "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
    })
    return RobertaMLMModel(config, RobertaModel(config, add_pooling_layer=False))


def train(args):
    device = (torch.device(get_accelerator().device_name(), args.local_rank)
              if args.local_rank > -1 and get_accelerator().is_available() else torch.device("cpu"))
    loader = DataLoader(SyntheticMLMDataset(64, args.vocab, args.max_seq_length), batch_size=args.batch_size,
                        shuffle=True, collate_fn=lambda b: collate_function(b, PAD))
    data_iterator = InfiniteIterator(loader)
    torch.manual_seed(0)
    model = create_model(1, 2, 64, 32, args.vocab)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        args.dtype: {"enabled": True},
        "zero_optimization": {"stage": 1},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    start_step = 1
    if args.load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=args.load_checkpoint_dir)
        start_step = client_state["checkpoint_step"] + 1
        print(f"RESUMED checkpoint_step={client_state['checkpoint_step']} global_steps={model.global_steps}")
    model.train()
    for step, batch in enumerate(data_iterator, start=start_step):
        if step > args.num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        if is_rank_0():
            print(f"STEP {model.global_steps} rows={batch['src_tokens'].shape[0]} "
                  f"global_samples={model.global_samples} loss={loss.item():.4f}")
    if args.checkpoint_dir is not None:
        pathlib.Path(args.checkpoint_dir).mkdir(exist_ok=True)
        model.save_checkpoint(save_dir=args.checkpoint_dir, client_state={"checkpoint_step": step - 1})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--load_checkpoint_dir", default=None)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_iterations", type=int, default=3)
    parser.add_argument("--max_seq_length", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--local_rank", type=int, default=-1)
    torch.manual_seed(42)
    random.seed(0)
    train(parser.parse_args())
