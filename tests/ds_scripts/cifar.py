"""A CIFAR-10 classifier in the shape of DeepSpeed's cifar10_deepspeed.py (random images)."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="from distributed launcher")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def dataset():
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(64, 3, 8, 8, generator=gen)
    labels = torch.randint(0, 4, (64,), generator=gen)
    return torch.utils.data.TensorDataset(images, labels)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=dataset()
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses, norms = [], []
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            total = loss.detach().float().clone()
            deepspeed.comm.all_reduce(total)
            losses.append(total.item() / deepspeed.comm.get_world_size())
            norms.append(model_engine.get_global_grad_norm())
    if deepspeed.comm.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "norms": norms, "lr": optimizer.param_groups[0]["lr"]}, f)


if __name__ == "__main__":
    main()
