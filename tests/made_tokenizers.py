"""Pretrained-style tokenizer.json files for tests, made by the tokenizers library on the spot (nothing is
downloaded): what a Hugging Face model folder ships, not what trainforge's own BPE option writes."""

from __future__ import annotations

from pathlib import Path

WORDS = ["the", "model", "reads", "tokens", "of", "its", "own", "vocabulary", "über", "日本", "shard", "merge"]
DOCS = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(4 + i % 11)) + f" {i}" for i in range(200)]


def make_tokenizer(path: Path, specials: tuple[str, ...] = ("<unk>", "<s>", "</s>"), vocab: int = 400,
                   template: bool = True) -> str:
    """A tokenizer.json as a model folder ships one (written by the tokenizers library, not by trainforge)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=specials[0] if specials[0] == "<unk>" else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS[::3], trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials),
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    if template and "<s>" in specials:  # what a Llama folder's post-processor does: not applied by the build
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path.read_text()
