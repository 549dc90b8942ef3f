"""Supervised fine-tuning of a small causal LM, the way DeepSpeed-Chat's step 1 (main.py and
its dschat utils) does it: a get_train_ds_config-style dict, its own DataLoader with a
DistributedSampler, FusedAdam, a transformers schedule."""

import argparse
import math
import os

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed import get_accelerator
from deepspeed.compression.helper import recursive_getattr, recursive_setattr  # noqa: F401 (dschat's lora.py)
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: F401 (dschat's utils.py)
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, GPT2Config, default_data_collator, get_scheduler

GLOBAL_BATCH_SIZE = 32
MICRO_BATCH_SIZE = 4


def get_train_ds_config(offload, dtype, stage=2, enable_tensorboard=False, tb_path="", tb_name=""):
    device = "cpu" if offload else "none"
    if dtype == "fp16":
        data_type, dtype_config = "fp16", {"enabled": True, "loss_scale_window": 100}
    else:
        data_type, dtype_config = "bfloat16", {"enabled": True}
    zero_opt_dict = {
        "stage": stage, "overlap_comm": True, "offload_param": {"device": device},
        "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False,
    }
    return {
        "train_batch_size": GLOBAL_BATCH_SIZE, "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10, "zero_optimization": zero_opt_dict, data_type: dtype_config,
        "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": enable_tensorboard, "output_path": f"{tb_path}/ds_tensorboard_logs/",
                        "job_name": f"{tb_name}_tensorboard"},
    }


class PromptDataset(Dataset):
    """Fixed-length token rows (the step-1 data after tokenization), in place of the HF download."""

    def __init__(self, n, seq_len, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def to_device(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def get_optimizer_grouped_parameters(model, weight_decay, no_decay_name_list=("bias", "ln_")):
    return [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay_name_list) and p.requires_grad], "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay_name_list) and p.requires_grad], "weight_decay": 0.0},
    ]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--lr_scheduler_type", default="cosine")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--resume_dir", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    parser.add_argument("--zero_stage", type=int, default=2)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (args.per_device_train_batch_size * torch.distributed.get_world_size()
                                     * args.gradient_accumulation_steps)
    torch.manual_seed(1234)
    get_accelerator().manual_seed_all(1234)
    torch.distributed.barrier()

    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1,
                                                        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    train_dataset, eval_dataset = PromptDataset(64, 16, 96, 0), PromptDataset(8, 16, 96, 1)
    train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator,
                                  sampler=DistributedSampler(train_dataset), batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 sampler=DistributedSampler(eval_dataset), batch_size=args.per_device_eval_batch_size)

    def evaluation(model, eval_dataloader):
        model.eval()
        losses = 0
        for step, batch in enumerate(eval_dataloader):
            batch = to_device(batch, device)
            with torch.no_grad():
                outputs = model(**batch)
            losses += outputs.loss.float()
        losses = get_all_reduce_mean(losses / (step + 1))
        return torch.exp(losses).item(), losses.item()

    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(get_optimizer_grouped_parameters(model, args.weight_decay), lr=args.learning_rate,
                              betas=(0.9, 0.95))
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * num_update_steps_per_epoch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.resume_dir:
        _, client_state = model.load_checkpoint(args.resume_dir)
        print(f"RESUMED global_steps={model.global_steps} global_samples={model.global_samples} "
              f"epoch={client_state['epoch']}")

    perplexity, eval_loss = evaluation(model, eval_dataloader)
    print(f"EVAL ppl={perplexity:.2f} loss={eval_loss:.4f}")
    for epoch in range(args.num_train_epochs):
        train_dataloader.sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dataloader):
            if model.global_steps >= args.max_steps:
                break
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            model.backward(outputs.loss)
            model.step()
            if args.global_rank == 0 and (step + 1) % args.gradient_accumulation_steps == 0:
                hf_model = model.transformer  # the engine hands module attributes through (print_throughput's model.model)
                print(f"STEP {model.global_steps} rows={batch['input_ids'].shape[0]} "
                      f"global_samples={model.global_samples} n_embd={hf_model.config.n_embd} "
                      f"lr={lr_scheduler.get_last_lr()[0]:.6f}")
        model.tput_timer.update_epoch_count()
    if args.output_dir is not None:
        model.save_checkpoint(args.output_dir, client_state={"epoch": 0})
        if args.global_rank == 0:
            model_to_save = model.module if hasattr(model, "module") else model
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save({k: v.cpu() for k, v in model_to_save.state_dict().items()},
                       os.path.join(args.output_dir, "pytorch_model.bin"))


if __name__ == "__main__":
    main()
