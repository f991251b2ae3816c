"""BERT masked-LM pre-training in the shape of DeepSpeed's Bing BERT tutorial, on fzero.

    fzero run -n 2 examples/bert_pretraining/train.py --deepspeed \
        --deepspeed_config examples/bert_pretraining/ds_config.json --max_steps 300

The tutorial's structure is kept: `get_arguments()` with `add_config_arguments`, a
model config file (`--cf`), `prepare_model_optimizer` handing `model.network` and
no-decay parameter groups to `initialize(..., dist_init_required=False)`, a loop
with `model.network.backward(loss)` / `model.network.step()`, and `checkpoint_model`
/ `load_training_checkpoint` keeping epoch, step and samples in the client state.
The only DeepSpeed-specific line is the import.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM

import fzero as deepspeed  # the one change from a DeepSpeed script

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples/text_data.py, shared by the examples
from text_data import MaskedLMDataset, tokenizer  # noqa: E402


def get_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="BERT masked-LM pre-training")
    parser.add_argument("--cf", default=os.path.join(HERE, "bert_tiny.json"), help="model config")
    parser.add_argument("--max_steps", type=int, default=300, help="optimizer steps in all")
    parser.add_argument("--print_steps", type=int, default=20)
    parser.add_argument("--checkpoint_steps", type=int, default=100)
    parser.add_argument("--output_dir", default="out/bert_pretraining")
    parser.add_argument("--load_training_checkpoint", default=None, help="checkpoint directory")
    parser.add_argument("--load_checkpoint_id", default=None, help="tag (default: latest)")
    parser.add_argument("--seed", type=int, default=42)
    return parser


def get_arguments() -> argparse.Namespace:
    parser = get_argument_parser()
    # Include DeepSpeed configuration arguments
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class BertMultiTask:
    """As in Bing BERT: the trainable network sits in `.network`."""

    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        with open(args.cf) as f:
            config = BertConfig(vocab_size=vocab_size, **json.load(f)["bert_model_config"])
        torch.manual_seed(args.seed)
        self.network = BertForMaskedLM(config)


def prepare_optimizer_parameters(args: argparse.Namespace, model: BertMultiTask) -> list[dict]:
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    named = list(model.network.named_parameters())
    return [
        {
            "params": [p for n, p in named if not any(nd in n for nd in no_decay)],
            "weight_decay": 0.01,
        },
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def prepare_model_optimizer(args: argparse.Namespace, vocab_size: int):
    # Loading Model
    model = BertMultiTask(args, vocab_size)
    # Optimizer parameters
    optimizer_parameters = prepare_optimizer_parameters(args, model)
    model.network, optimizer, _, _ = deepspeed.initialize(
        args=args,
        model=model.network,
        model_parameters=optimizer_parameters,
        dist_init_required=False,
    )
    return model, optimizer


def checkpoint_model(
    PATH, ckpt_id, model, epoch, last_global_step, last_global_data_samples, **kwargs
):
    """Utility function for checkpointing model + optimizer dictionaries
    The main purpose for this is to be able to resume training from that instant again
    """
    checkpoint_state_dict = {
        "epoch": epoch,
        "last_global_step": last_global_step,
        "last_global_data_samples": last_global_data_samples,
    }
    # Add extra kwargs too
    checkpoint_state_dict.update(kwargs)
    model.network.save_checkpoint(PATH, ckpt_id, checkpoint_state_dict)


def load_training_checkpoint(args, model, PATH, ckpt_id):
    """Utility function for checkpointing model + optimizer dictionaries
    The main purpose for this is to be able to resume training from that instant again
    """
    _, checkpoint_state_dict = model.network.load_checkpoint(PATH, ckpt_id)
    epoch = checkpoint_state_dict["epoch"]
    last_global_step = checkpoint_state_dict["last_global_step"]
    last_global_data_samples = checkpoint_state_dict["last_global_data_samples"]
    del checkpoint_state_dict
    return (epoch, last_global_step, last_global_data_samples)


def main() -> None:
    args = get_arguments()
    deepspeed.comm.init_distributed()  # the application's own process group, as in the tutorial
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(args.cf) as f:
        data_config = json.load(f)["data"]
    tok = tokenizer(args.output_dir, data_config["vocab_size"])
    dataset = MaskedLMDataset(
        tok, data_config["max_seq_length"], data_config["mask_probability"], args.seed
    )
    model, _ = prepare_model_optimizer(args, tok.get_vocab_size())
    engine = model.network
    micro, accumulation = (
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    )
    sampler = torch.utils.data.DistributedSampler(
        dataset, world, rank, shuffle=True, seed=args.seed
    )
    # its own generator: starting an epoch must not draw from the RNG dropout uses, or a
    # resumed run would drop out differently from an uninterrupted one
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=micro,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    steps_per_epoch = len(loader) // accumulation
    epoch = global_step = global_samples = 0
    if args.load_training_checkpoint:
        epoch, global_step, global_samples = load_training_checkpoint(
            args, model, args.load_training_checkpoint, args.load_checkpoint_id
        )
        if rank == 0:
            print(f"resumed from {args.load_training_checkpoint} at step {global_step}", flush=True)
    first_loss = last_loss = None
    window: list[float] = []
    engine.train()
    while global_step < args.max_steps:
        sampler.set_epoch(epoch)
        dataset.epoch = epoch
        skip = (global_step - epoch * steps_per_epoch) * accumulation  # resumed mid-epoch
        for index, batch in enumerate(loader):
            if index < skip:
                continue
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            window.append(loss.item())
            if engine.micro_steps % accumulation:
                continue  # inside an accumulation window
            global_step += 1
            global_samples += engine.train_batch_size()
            mean = torch.tensor(sum(window) / len(window))
            dist.all_reduce(mean)
            mean = mean.item() / world
            window.clear()
            first_loss = mean if first_loss is None else first_loss
            last_loss = mean
            if rank == 0 and (global_step % args.print_steps == 0 or global_step == 1):
                lr = engine.get_lr()[0]
                print(
                    f"step {global_step} epoch {epoch} mlm loss {mean:.4f} lr {lr:.2e}", flush=True
                )
            if global_step % args.checkpoint_steps == 0 or global_step == args.max_steps:
                checkpoint_model(
                    os.path.join(args.output_dir, "checkpoints"), f"epoch{epoch}_step{global_step}",
                    model, epoch, global_step, global_samples,
                )  # fmt: skip
            if global_step >= args.max_steps:
                break
        else:
            epoch += 1
    if rank == 0:
        print(f"MLM loss {first_loss:.4f} -> {last_loss:.4f} in {global_step} steps", flush=True)
        # a Transformers model directory (weights, config, vocabulary) for fine-tuning
        export = os.path.join(args.output_dir, "model")
        deepspeed.checkpoint.consolidate(os.path.join(args.output_dir, "checkpoints"), export)
        engine.module.config.save_pretrained(export)
        tok.save_model(export)
        print(f"consolidated model: {export}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
