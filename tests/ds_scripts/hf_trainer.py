"""A Transformers `Trainer` script as its users write one: `TrainingArguments` from the
command line (`--deepspeed ds_config.json` switches DeepSpeed on), a model from a config,
`trainer.train(resume_from_checkpoint=...)`, `trainer.save_model()`. Tiny BERT, data
made here; `--from_config` builds it with `AutoModelForSequenceClassification.from_config`
(inside `deepspeed.zero.Init` under ZeRO-3, as Transformers does), `--from_pretrained DIR`
loads it with `from_pretrained` (partitioned, then loaded under ZeRO-3), else its
constructor."""

import contextlib
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)
from transformers.integrations import is_deepspeed_zero3_enabled


@dataclass
class ModelArguments:
    from_config: bool = False
    from_pretrained: str = ""
    save_init: str = ""  # each rank writes its initial weights to save_init-rank{r}
    init_from: str = ""  # start from these weights


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows: int = 64) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (rows, 16), generator=gen)
        self.labels = (self.ids[:, 0] > 50).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    parser = HfArgumentParser((TrainingArguments, ModelArguments))
    args, model_args = parser.parse_args_into_dataclasses()
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    if model_args.from_pretrained:
        model = AutoModelForSequenceClassification.from_pretrained(model_args.from_pretrained)
    elif model_args.from_config:
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = BertForSequenceClassification(config)
    if model_args.save_init:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        gathered = contextlib.nullcontext()
        if is_deepspeed_zero3_enabled():  # built partitioned: gathered to be read, as with
            import deepspeed  # DeepSpeed's zero.Init

            gathered = deepspeed.zero.GatheredParameters(list(model.parameters()))
        with gathered:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        save_file(state, f"{model_args.save_init}-rank{rank}.safetensors")
    if model_args.init_from:
        model.load_state_dict(load_file(model_args.init_from))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()


if __name__ == "__main__":
    main()
