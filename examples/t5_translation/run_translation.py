"""T5 "translation" through Transformers' `Seq2SeqTrainer`, as the DeepSpeed tutorial runs
`run_translation.py`: DeepSpeed is the Trainer's `--deepspeed ds_config.json`, and
`fzero run --as-deepspeed` serves it.

    fzero run --as-deepspeed -n 2 examples/t5_translation/run_translation.py \
        --deepspeed examples/t5_translation/ds_config_zero2.json \
        --do_train --do_eval --predict_with_generate --use_cpu --report_to none \
        --per_device_train_batch_size 16 --per_device_eval_batch_size 16 \
        --output_dir out/t5_trainer --overwrite_output_dir --num_train_epochs 4 \
        --max_train_samples 2000 --source_lang en --target_lang en_rev

With `ds_config_zero3.json` the model is built inside `deepspeed.zero.Init` (Transformers
does it for `from_config` under ZeRO-3) and evaluation generates with `synced_gpus`, every
rank stepping the decoder until all are done. The data and the tiny T5 are those of
`train.py` (nothing downloaded, `--model_name_or_path` a saved model directory); eval
reports loss and BLEU of the generated outputs, `--do_predict` writes them to
`generated_predictions.txt`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # examples/text_data.py, shared by the examples
from text_data import tokenizer  # noqa: E402
from train import MAX_LEN, bleu, sentence_pairs, t5_config  # noqa: E402


@dataclass
class DataArguments:
    model_name_or_path: str = ""  # a saved model directory; else a new model from config
    source_lang: str = "en"
    target_lang: str = "en_rev"
    max_train_samples: int = 4000
    max_eval_samples: int = 200


class Pairs(torch.utils.data.Dataset):
    """Encoded (source, target) pairs as the Trainer's dicts."""

    def __init__(self, sources: torch.Tensor, labels: torch.Tensor, pad: int) -> None:
        self.sources, self.labels, self.pad = sources, labels, pad

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.sources[i],
            "attention_mask": (self.sources[i] != self.pad).long(),
            "labels": self.labels[i].masked_fill(self.labels[i] == self.pad, -100),
        }


def main() -> None:
    parser = HfArgumentParser((Seq2SeqTrainingArguments, DataArguments))
    args, data_args = parser.parse_args_into_dataclasses()
    tok = tokenizer(os.path.join(args.output_dir, "tokenizer"), vocab_size=3000)
    pad, eos = tok.token_to_id("[PAD]"), tok.token_to_id("[SEP]")
    pairs = sentence_pairs(data_args.target_lang)
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(args.seed))
    pairs = [pairs[i] for i in order]
    evaluation = pairs[: data_args.max_eval_samples]
    training = pairs[data_args.max_eval_samples :][: data_args.max_train_samples]

    def encode(texts: list[str]) -> torch.Tensor:
        encodings = tok.encode_batch(texts, add_special_tokens=False)
        ids = [[*e.ids[: MAX_LEN - 1], eos] for e in encodings]
        return torch.tensor([row + [pad] * (MAX_LEN - len(row)) for row in ids])

    def dataset(part: list[tuple[str, str]]) -> Pairs:
        return Pairs(encode([s for s, _ in part]), encode([t for _, t in part]), pad)

    def compute_metrics(prediction) -> dict[str, float]:
        outputs = [
            tok.decode([t for t in row.tolist() if t >= 0], skip_special_tokens=True).split()
            for row in prediction.predictions
        ]
        return {"bleu": bleu(outputs, [t.split() for _, t in evaluation])}

    config = t5_config(tok)
    torch.manual_seed(args.seed)
    if data_args.model_name_or_path:
        model = AutoModelForSeq2SeqLM.from_pretrained(data_args.model_name_or_path)
    else:
        model = AutoModelForSeq2SeqLM.from_config(config)
    model.generation_config.max_new_tokens = MAX_LEN
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=dataset(training) if args.do_train else None,
        eval_dataset=dataset(evaluation) if args.do_eval or args.do_predict else None,
        compute_metrics=compute_metrics if args.predict_with_generate else None,
    )
    if args.do_train:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.save_model()
    if args.do_eval:
        metrics = trainer.evaluate(metric_key_prefix="eval")
        if trainer.is_world_process_zero():
            print(f"eval loss {metrics['eval_loss']:.4f} bleu {metrics.get('eval_bleu', 0):.1f}")
            trainer.save_metrics("eval", metrics)
    if args.do_predict:  # the held-out sources, translated (run_translation.py's file)
        predictions = trainer.predict(dataset(evaluation)).predictions
        if trainer.is_world_process_zero():
            lines = [
                tok.decode([t for t in row.tolist() if t >= 0], skip_special_tokens=True)
                for row in predictions
            ]
            path = os.path.join(args.output_dir, "generated_predictions.txt")
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
