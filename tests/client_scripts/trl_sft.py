"""A TRL `SFTTrainer` script as its users write one: `SFTConfig` (its `--deepspeed`
switches DeepSpeed on), a causal LM, a text dataset, `trainer.train()`, `save_model()`.
Tiny GPT-2 built from a config and a word-level tokenizer built here: no download. The
final weights go to `--output_dir/model.safetensors` (save_model's file)."""

import sys

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "log",
    "big",
    "small",
    "red",
    "blue",
    "and",
    "then",
]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def main() -> None:
    (args,) = HfArgumentParser(SFTConfig).parse_args_into_dataclasses(sys.argv[1:])
    torch.manual_seed(0)
    tok = tokenizer()
    config = GPT2Config(
        vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(0)
    texts = [
        " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (8,), generator=gen))
        for _ in range(32)
    ]
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tok,
    )  # fmt: skip
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
