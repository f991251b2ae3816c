"""T5 "translation" with ZeRO-2 and optimizer offload, with the flags of Transformers'
`run_translation.py` that DeepSpeed's tutorial uses; its ZeRO-2 config (all the
"auto" values) is kept verbatim and resolved from those flags by `fzero.resolve_auto`.

    fzero run -n 2 examples/t5_translation/train.py \
        --deepspeed examples/t5_translation/ds_config_zero2.json \
        --per_device_train_batch_size 16 --per_device_eval_batch_size 16 \
        --do_train --do_eval --output_dir out/t5 --overwrite_output_dir \
        --max_train_samples 2000 --num_train_epochs 4 --source_lang en --target_lang en_rev

Nothing is downloaded: a tiny `T5ForConditionalGeneration` is built from config, and
the parallel corpus is made deterministically from the stdlib's documentation text:
each English sentence (4-12 words) is paired with the same words in reverse order
(the "en_rev" language). Prints eval loss and a BLEU score (4-gram, brevity penalty)
of greedy outputs; the consolidated model in --output_dir loads with `from_pretrained`.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import shutil
import sys

import torch
import torch.distributed as dist
from transformers import T5Config, T5ForConditionalGeneration

import fzero

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples/text_data.py, shared by the examples
from text_data import corpus, tokenizer  # noqa: E402

MAX_LEN = 24


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="T5 translation (run_translation.py's flags)")
    p.add_argument("--deepspeed", required=True, help="DeepSpeed/fzero JSON config")
    p.add_argument("--per_device_train_batch_size", type=int, default=16)
    p.add_argument("--per_device_eval_batch_size", type=int, default=16)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--do_train", action="store_true")
    p.add_argument("--do_eval", action="store_true")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--overwrite_output_dir", action="store_true")
    p.add_argument("--max_train_samples", type=int, default=4000)
    p.add_argument("--max_eval_samples", type=int, default=200)
    p.add_argument("--num_train_epochs", type=float, default=8)
    p.add_argument("--source_lang", default="en")
    p.add_argument("--target_lang", default="en_rev")
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def sentence_pairs(target_lang: str) -> list[tuple[str, str]]:
    """English sentences and their rule-based translation, in a fixed order."""
    if target_lang != "en_rev":
        raise SystemExit(f"--target_lang {target_lang!r}: this corpus has 'en_rev' only")
    pairs = []
    for paragraph in corpus():
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
            words = re.findall(r"[A-Za-z]+", sentence.lower())
            if 4 <= len(words) <= 12:
                pairs.append((" ".join(words), " ".join(reversed(words))))
    return list(dict.fromkeys(pairs))


def t5_config(tok) -> T5Config:
    """The tiny T5 both routes train: the tokenizer's vocabulary, [PAD] as pad and
    decoder start, [SEP] as end of sequence."""
    pad, eos = tok.token_to_id("[PAD]"), tok.token_to_id("[SEP]")
    return T5Config(
        vocab_size=tok.get_vocab_size(), d_model=128, d_kv=32, d_ff=256, num_layers=2,
        num_decoder_layers=2, num_heads=4, pad_token_id=pad, eos_token_id=eos,
        decoder_start_token_id=pad, dropout_rate=0.0,
    )  # fmt: skip


def bleu(candidates: list[list[str]], references: list[list[str]]) -> float:
    """Corpus BLEU-4 with the brevity penalty (Papineni et al. 2002), single reference."""
    matches, totals = [0] * 4, [0] * 4
    length = reference_length = 0
    for cand, ref in zip(candidates, references):
        length, reference_length = length + len(cand), reference_length + len(ref)
        for n in range(1, 5):
            grams = collections.Counter(tuple(cand[i : i + n]) for i in range(len(cand) - n + 1))
            ref_grams = collections.Counter(tuple(ref[i : i + n]) for i in range(len(ref) - n + 1))
            matches[n - 1] += sum(min(c, ref_grams[g]) for g, c in grams.items())
            totals[n - 1] += max(0, len(cand) - n + 1)
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity = min(0.0, 1 - reference_length / max(length, 1))
    return 100 * math.exp(log_precision + brevity)


def main() -> None:
    args = parse_args()
    fzero.comm.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and args.overwrite_output_dir:
        shutil.rmtree(args.output_dir, ignore_errors=True)
    dist.barrier()
    tok = tokenizer(os.path.join(args.output_dir, "tokenizer"), vocab_size=3000)
    pad, eos = tok.token_to_id("[PAD]"), tok.token_to_id("[SEP]")
    pairs = sentence_pairs(args.target_lang)
    generator = torch.Generator().manual_seed(args.seed)
    pairs = [pairs[i] for i in torch.randperm(len(pairs), generator=generator)]
    evaluation, training = pairs[: args.max_eval_samples], pairs[args.max_eval_samples :]
    training = training[: args.max_train_samples]

    def encode(texts: list[str]) -> torch.Tensor:
        encodings = tok.encode_batch(texts, add_special_tokens=False)
        ids = [[*e.ids[: MAX_LEN - 1], eos] for e in encodings]
        return torch.tensor([row + [pad] * (MAX_LEN - len(row)) for row in ids])

    def dataset(part: list[tuple[str, str]]) -> torch.utils.data.TensorDataset:
        sources, labels = encode([s for s, _ in part]), encode([t for _, t in part])
        return torch.utils.data.TensorDataset(sources, labels.masked_fill(labels == pad, -100))

    config = t5_config(tok)
    torch.manual_seed(args.seed)
    model = T5ForConditionalGeneration(config)
    train_set = dataset(training)
    steps_per_epoch = math.ceil(
        len(train_set)
        / (args.per_device_train_batch_size * world * args.gradient_accumulation_steps)
    )
    total_steps = int(steps_per_epoch * args.num_train_epochs)
    ds_config = fzero.resolve_auto(
        fzero.load_config(args.deepspeed),
        world_size=world,
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        lr=args.learning_rate,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        total_steps=total_steps,
        max_grad_norm=args.max_grad_norm,
        fp16=args.fp16,
        bf16=args.bf16,
        hidden_size=config.d_model,
    )
    engine, _, loader, _ = fzero.initialize(
        model=model, model_parameters=model.parameters(), training_data=train_set, config=ds_config
    )
    if args.do_train:
        step = 0
        for epoch in range(math.ceil(args.num_train_epochs)):
            loader.sampler.set_epoch(epoch)
            engine.train()
            for sources, labels in loader:
                loss = engine(input_ids=sources, attention_mask=sources != pad, labels=labels).loss
                engine.backward(loss)
                engine.step()
                step += (
                    engine.is_gradient_accumulation_boundary()
                    or engine.gradient_accumulation_steps() == 1
                )
                if step >= total_steps:
                    break
            if args.do_eval:
                evaluate(engine, tok, evaluation, dataset, args, pad, epoch)
        engine.save_checkpoint(os.path.join(args.output_dir, "checkpoints"))
        if rank == 0:  # the consolidated model, loadable with from_pretrained
            fzero.checkpoint.consolidate(
                os.path.join(args.output_dir, "checkpoints"), args.output_dir
            )
            config.save_pretrained(args.output_dir)
            print(f"model saved to {args.output_dir}", flush=True)
        dist.barrier()
    elif args.do_eval:
        evaluate(engine, tok, evaluation, dataset, args, pad, 0)


def evaluate(engine, tok, evaluation, dataset, args, pad: int, epoch: int) -> None:
    """Eval loss over the held-out pairs and BLEU of greedy outputs (every rank runs
    the same, so stage 3 could gather; rank 0 prints)."""
    engine.eval()
    data = dataset(evaluation)
    total, count, outputs = 0.0, 0, []
    with torch.no_grad():
        for start in range(0, len(data), args.per_device_eval_batch_size):
            sources, labels = data[start : start + args.per_device_eval_batch_size]
            mask = sources != pad
            total += engine(
                input_ids=sources, attention_mask=mask, labels=labels
            ).loss.item() * len(sources)
            count += len(sources)
            generated = engine.module.generate(
                input_ids=sources, attention_mask=mask, max_new_tokens=MAX_LEN, do_sample=False
            )
            outputs += tok.decode_batch(generated.tolist(), skip_special_tokens=True)
    score = bleu([o.split() for o in outputs], [t.split() for _, t in evaluation])
    if dist.get_rank() == 0:
        print(f"epoch {epoch} eval loss {total / count:.4f} bleu {score:.1f}", flush=True)


if __name__ == "__main__":
    main()
