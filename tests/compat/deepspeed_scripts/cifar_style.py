"""A CIFAR-10 classifier trained the way DeepSpeedExamples' training/cifar does it."""

import argparse
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: F401 (as the original)


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-e", "--epochs", default=1, type=int)
    parser.add_argument("--steps", default=3, type=int)
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--load_dir", default=None)
    parser.add_argument("--reload", action="store_true", help="after saving, load the checkpoint back, train one step")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_ds_config(args):
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                  "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                      "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "loss_scale": 0, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(4, 8, 5)
        self.fc1 = nn.Linear(8 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def synthetic_cifar(n, seed):
    """CIFAR-10's shapes (3x32x32 images, 10 classes) in place of the download."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def main(args):
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()
    trainset, testset = synthetic_cifar(256, 0), synthetic_cifar(8, 1)
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()

    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=get_ds_config(args))
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    if args.load_dir:
        model_engine.load_checkpoint(args.load_dir)
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else None
    criterion = nn.CrossEntropyLoss()

    def train(steps):
        for epoch in range(args.epochs):
            for i, data in enumerate(trainloader):
                if i == steps:
                    break
                inputs, labels = data[0].to(local_device), data[1].to(local_device)
                if target_dtype is not None:
                    inputs = inputs.to(target_dtype)
                outputs = model_engine(inputs)
                loss = criterion(outputs, labels)
                model_engine.backward(loss)
                model_engine.step()
                if local_rank == 0:
                    print(f"STEP {model_engine.global_steps} rows={inputs.shape[0]} "
                          f"global_samples={model_engine.global_samples} loss={loss.item():.4f}")

    train(args.steps)
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir)
    if args.reload:
        _, client_state = model_engine.load_checkpoint(args.save_dir)
        print(f"RELOADED global_steps={model_engine.global_steps} global_samples={model_engine.global_samples}")
        train(1)

    # test as the original does: a plain DataLoader of 4 images, fed to the engine
    model_engine.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in torch.utils.data.DataLoader(testset, batch_size=4):
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    print(f"EVAL total={total} accuracy={100 * correct / total:.0f}")


if __name__ == "__main__":
    main(add_argument())
