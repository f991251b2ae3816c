"""Text, tokenizer and masked-LM batches for the example, with nothing downloaded.

English text: the Python documentation topics that ship with the standard library
(`pydoc_data.topics`, about 460 KB). A WordPiece tokenizer is trained on it with
`tokenizers` (seconds) and saved to the output directory by rank 0.
"""

from __future__ import annotations

import os
from pydoc_data.topics import topics

import torch
import torch.distributed as dist
from tokenizers import BertWordPieceTokenizer


def corpus() -> list[str]:
    """Paragraphs of the stdlib's documentation topics, in a fixed order."""
    paragraphs = []
    for name in sorted(topics):
        paragraphs += [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) > 40]
    return paragraphs


def tokenizer(output_dir: str, vocab_size: int) -> BertWordPieceTokenizer:
    """Rank 0 trains and saves the tokenizer; the other ranks load what it saved."""
    path = os.path.join(output_dir, "vocab.txt")
    if dist.get_rank() == 0 and not os.path.exists(path):
        os.makedirs(output_dir, exist_ok=True)
        trained = BertWordPieceTokenizer(lowercase=True)
        trained.train_from_iterator(corpus(), vocab_size=vocab_size, min_frequency=2)
        trained.save_model(output_dir)
    dist.barrier()
    return BertWordPieceTokenizer(path, lowercase=True)


class MaskedLMDataset(torch.utils.data.Dataset):
    """Fixed-length token blocks of the corpus; BERT's masking (15%: 80% [MASK], 10%
    random, 10% kept), drawn from a generator seeded by (seed, epoch, index) so a run
    resumed from a checkpoint sees exactly the batches it would have seen."""

    def __init__(self, tok: BertWordPieceTokenizer, seq_len: int, mask_prob: float, seed: int):
        ids = [i for enc in tok.encode_batch(corpus(), add_special_tokens=False) for i in enc.ids]
        body = seq_len - 2
        self.cls, self.sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        self.mask, self.vocab = tok.token_to_id("[MASK]"), tok.get_vocab_size()
        self.blocks = torch.tensor(ids[: len(ids) // body * body]).view(-1, body)
        self.mask_prob, self.seed, self.epoch = mask_prob, seed, 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 100_003 + index)
        tokens = torch.cat([torch.tensor([self.cls]), self.blocks[index], torch.tensor([self.sep])])
        labels = tokens.clone()
        chosen = torch.rand(len(tokens), generator=gen) < self.mask_prob
        chosen[0] = chosen[-1] = False
        labels[~chosen] = -100
        draw = torch.rand(len(tokens), generator=gen)
        tokens[chosen & (draw < 0.8)] = self.mask
        random_tokens = torch.randint(self.vocab, (len(tokens),), generator=gen)
        swap = chosen & (draw >= 0.8) & (draw < 0.9)
        tokens[swap] = random_tokens[swap]
        return {"input_ids": tokens, "labels": labels}


def code_paragraphs(seed: int = 0) -> tuple[list[str], list[int]]:
    """A labelled set built from the corpus: does a paragraph show interactive Python
    (a `>>>` prompt)? Balanced by taking as many plain paragraphs as code ones, in a
    seeded order. The label is learnable from the text, not given away by a fixed token:
    the prompts are removed, so the model must recognise code itself."""
    with_code = [p for p in corpus() if ">>>" in p]
    plain = [p for p in corpus() if ">>>" not in p and "..." not in p]
    gen = torch.Generator().manual_seed(seed)
    plain = [plain[i] for i in torch.randperm(len(plain), generator=gen)[: len(with_code)]]
    texts = [p.replace(">>>", " ") for p in with_code] + plain
    labels = [1] * len(with_code) + [0] * len(plain)
    order = torch.randperm(len(texts), generator=gen).tolist()
    return [texts[i] for i in order], [labels[i] for i in order]
