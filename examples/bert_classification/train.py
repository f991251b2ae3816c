"""BERT sequence classification fine-tuning on fzero, as DeepSpeed's tutorials do it.

    fzero run -n 2 examples/bert_classification/train.py \
        --deepspeed_config examples/bert_classification/ds_config.json [--epochs 4]
        [--init_from out/bert_pretraining/model]

`transformers.BertForSequenceClassification`, from a tiny config, or from the MLM
example's consolidated model (`--init_from`); `model_engine(**inputs)` and a
`CrossEntropyLoss`; `initialize(..., training_data=...)` gives the distributed loader.
The task (built from the stdlib's documentation, nothing downloaded): does a
paragraph show interactive Python? Prints loss per epoch and held-out accuracy.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

import fzero as deepspeed

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples/text_data.py, shared by the examples
from text_data import code_paragraphs, tokenizer  # noqa: E402

SEQ_LEN = 64


def get_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="BERT classification fine-tuning")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--init_from", default=None, help="a Transformers model directory")
    parser.add_argument("--output_dir", default="out/bert_classification")
    parser.add_argument("--seed", type=int, default=0)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def encode(tok, texts: list[str], labels: list[int]) -> torch.utils.data.TensorDataset:
    tok.enable_truncation(SEQ_LEN)
    tok.enable_padding(length=SEQ_LEN)
    encodings = tok.encode_batch(texts)
    ids = torch.tensor([e.ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    return torch.utils.data.TensorDataset(ids, mask, torch.tensor(labels))


def main() -> None:
    args = get_arguments()
    deepspeed.comm.init_distributed()
    rank = dist.get_rank()
    if args.init_from:
        from tokenizers import BertWordPieceTokenizer

        tok = BertWordPieceTokenizer(os.path.join(args.init_from, "vocab.txt"), lowercase=True)
        model = BertForSequenceClassification.from_pretrained(args.init_from, num_labels=2)
    else:
        tok = tokenizer(args.output_dir, vocab_size=4000)
        config = BertConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=128, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=512, max_position_embeddings=128,
            num_labels=2,
        )  # fmt: skip
        torch.manual_seed(args.seed)
        model = BertForSequenceClassification(config)
    texts, labels = code_paragraphs(args.seed)
    split = len(texts) * 4 // 5
    train_set = encode(tok, texts[:split], labels[:split])
    held_out = encode(tok, texts[split:], labels[split:])

    def collate(rows):
        ids, mask, label = (torch.stack(column) for column in zip(*rows))
        return {"input_ids": ids, "attention_mask": mask}, label

    model_engine, _, loader, _ = deepspeed.initialize(
        args=args,
        model=model,
        model_parameters=model.parameters(),
        training_data=train_set,
        collate_fn=collate,
    )
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        model_engine.train()
        total, batches = 0.0, 0
        for inputs, label in loader:
            loss = criterion(model_engine(**inputs).logits, label)
            model_engine.backward(loss)
            model_engine.step()
            total, batches = total + loss.item(), batches + 1
        summed = torch.tensor([total, batches], dtype=torch.float64)
        dist.all_reduce(summed)
        accuracy = evaluate(model_engine, held_out)
        if rank == 0:
            print(
                f"epoch {epoch} loss {summed[0].item() / summed[1].item():.4f} "
                f"held-out accuracy {accuracy:.3f} ({len(held_out)} paragraphs)",
                flush=True,
            )
    model_engine.save_checkpoint(os.path.join(args.output_dir, "checkpoints"))


def evaluate(model_engine, dataset) -> float:
    """Accuracy on the held-out set; every rank runs it (stage 3 gathers collectively)."""
    model_engine.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(dataset), 32):
            ids, mask, label = dataset[start : start + 32]
            logits = model_engine(input_ids=ids, attention_mask=mask).logits
            correct += (logits.argmax(-1) == label).sum().item()
    return correct / len(dataset)


if __name__ == "__main__":
    main()
