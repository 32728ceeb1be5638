"""Character-level tokenizers written offline, for the VLA backends' stand-ins (SmolVLA's tiny SmolVLM: common.policy.
smolvla.stand_ins; pi0's PaliGemma-sized tokenizer: common.policy.pi0.stand_ins): every printable ASCII character one
token, after the backbone's special tokens, so that no tokenizer is ever downloaded."""

from __future__ import annotations

import string


def writer_line() -> str:
    """The transformers line whose save_pretrained wrote a cached directory: part of its cache key, because a major
    line reads another's tokenizer files only partly (transformers 4 cannot load the tokenizer class 5 names), and
    two environments on one machine share the cache."""
    import transformers

    return f"transformers {transformers.__version__.split('.')[0]}"


def vocabulary(special_tokens: list[str], size: int | None = None) -> dict[str, int]:
    """`special_tokens` first, then every printable ASCII character (one token per character), then placeholder tokens
    up to `size` when given (a backbone's full vocabulary, so every id it embeds exists)."""
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    tokens = [*special_tokens, *chars]
    if size is not None:
        if size < len(tokens):
            raise ValueError(f"a character vocabulary needs at least {len(tokens)} tokens, got size={size}")
        tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer(special_tokens: dict[str, str], extra_special_tokens: dict[str, str], size: int | None = None, add_bos: bool = False):
    """A character-level fast tokenizer (transformers' PreTrainedTokenizerFast) with the given special tokens (pad, unk,
    bos, eos, and the backbone's extra ones), `size` tokens in all when given, and the BOS token prepended to every
    text with `add_bos`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary(list(dict.fromkeys([*special_tokens.values(), *extra_special_tokens.values()])), size)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special_tokens["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join without separators when decoding
    if add_bos:
        bos = special_tokens["bos_token"]
        core.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=512, extra_special_tokens=extra_special_tokens, **special_tokens)
