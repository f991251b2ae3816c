"""Two engines in the shape of DeepSpeed's DCGAN tutorial: client Adam optimizers, forward
through the raw modules, `optimizerD.step()`, `netD.zero_grad()` (random data)."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn


def get_argument_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--niter", type=int, default=3)
    parser.add_argument("--out", required=True)
    return deepspeed.add_config_arguments(parser)


def models():
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 7))
    net_d = nn.Sequential(nn.Linear(7, 6), nn.LeakyReLU(0.2), nn.Linear(6, 1), nn.Sigmoid())
    return net_g, net_d


def batch(step, rank, micro):
    gen = torch.Generator().manual_seed(50 + step)
    real = torch.randn(2 * micro, 7, generator=gen) + 1.0
    noise = torch.randn(2 * micro, 5, generator=gen)
    rows = slice(rank * micro, (rank + 1) * micro)
    return real[rows], noise[rows]


def main():
    args = get_argument_parser().parse_args()
    deepspeed.init_distributed()
    net_g, net_d = models()
    criterion = nn.BCELoss()
    optimizer_d = torch.optim.Adam(net_d.parameters(), lr=0.01, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(net_g.parameters(), lr=0.01, betas=(0.5, 0.999))
    model_engine_d, optimizer_d, _, _ = deepspeed.initialize(
        args=args, model=net_d, model_parameters=net_d.parameters(), optimizer=optimizer_d
    )
    model_engine_g, optimizer_g, _, _ = deepspeed.initialize(
        args=args, model=net_g, model_parameters=net_g.parameters(), optimizer=optimizer_g
    )
    rank, micro = deepspeed.comm.get_rank(), model_engine_d.train_micro_batch_size_per_gpu()
    for step in range(args.niter):
        real, noise = batch(step, rank, micro)
        net_d.zero_grad()
        label = torch.full((micro, 1), 1.0)
        err_d_real = criterion(net_d(real), label)
        model_engine_d.backward(err_d_real)
        fake = net_g(noise)
        label.fill_(0.0)
        err_d_fake = criterion(net_d(fake.detach()), label)
        model_engine_d.backward(err_d_fake)
        optimizer_d.step()
        net_g.zero_grad()
        label.fill_(1.0)
        err_g = criterion(net_d(fake), label)
        model_engine_g.backward(err_g)
        optimizer_g.step()
    state = {
        **{f"g.{k}": v.tolist() for k, v in model_engine_g.state_dict().items()},
        **{f"d.{k}": v.tolist() for k, v in model_engine_d.state_dict().items()},
    }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(state, f)


if __name__ == "__main__":
    main()
