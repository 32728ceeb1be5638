"""Stand-ins for pi0 and pi0.5 where the real pieces are not at hand, for CPU runs, tests and GPU benchmarks: the tiny
variants lerobot's builder does not know (policy.pi0.paligemma_variant "tiny", action_expert_variant "tiny_expert"),
a character tokenizer at PaliGemma's vocabulary size written offline, and a random-weight lerobot checkpoint at the real
sizes. Free of lerobot imports: the lerobot module they patch is passed in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from common.config import cache_dir
from common.file_digests import short_digest
from common.policy.offline_tokenizer import build_tokenizer, writer_line
from common.storage import write_directory_atomically

PALIGEMMA_VOCAB = 257_152  # the vocabulary lerobot builds PaliGemma and the expert with
# Gemma's special tokens (ids 0-3 in PaliGemma's tokenizer); its tokenizer prepends <bos> to every text.
GEMMA_SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
PI_TOKENIZER_FORMAT = 1  # bump when the files pi_tokenizer_dir writes change, so cached directories are rebuilt

# The tiny variants, in lerobot's GemmaConfig fields. Eight query heads as lerobot's variants (its joint forward
# reshapes attention to 8 heads); the expert reads the backbone's keys, so head sizes agree.
TINY_GEMMA = {
    "tiny": dict(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8),
    "tiny_expert": dict(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=8),
}
# The tiny SigLIP: 16 tokens per 32 px frame. Attention dropout > 0 on purpose: train mode would make log-probs
# random (a failure the tests provoke).
TINY_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=8, attention_dropout=0.1)


@contextlib.contextmanager
def swapped_attributes(owner: Any, stand_ins: dict[str, Any]) -> Iterator[None]:
    """While open, each name of `stand_ins` on `owner` (a lerobot module or class) is its stand-in; restored on exit."""
    real = {name: getattr(owner, name) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        setattr(owner, name, stand_in)
    try:
        yield
    finally:
        for name, original in real.items():
            setattr(owner, name, original)


@contextlib.contextmanager
def tiny_gemma_sizes(module: ModuleType, vocab_size: int) -> Iterator[None]:
    """While open, lerobot's pi0 / pi0.5 modeling `module` builds the tiny variants: its builder knows gemma_2b and
    gemma_300m only and fixes SigLIP So400m, a 2048-wide image projection and the 257k vocabulary, so the three names
    it builds from (get_gemma_config and the two model classes) are swapped for ones that apply TINY_GEMMA,
    TINY_SIGLIP and `vocab_size` to the configs it makes. Its classes and forward code run unchanged."""
    names = ("get_gemma_config", "PaliGemmaForConditionalGenerationWithPiGemma", "PiGemmaForCausalLM")
    real = {name: getattr(module, name) for name in names}

    def gemma_config(variant: str) -> Any:
        return module.GemmaConfig(**TINY_GEMMA[variant]) if variant in TINY_GEMMA else real["get_gemma_config"](variant)

    def paligemma(config: Any) -> nn.Module:
        for name, value in TINY_SIGLIP.items():
            setattr(config.vision_config, name, value)
        config.vision_config.projection_dim = config.text_config.hidden_size  # image tokens live in the text width
        config.text_config.vocab_size = vocab_size
        return real["PaliGemmaForConditionalGenerationWithPiGemma"](config=config)

    def expert(config: Any) -> nn.Module:
        config.vocab_size = vocab_size
        return real["PiGemmaForCausalLM"](config=config)

    with swapped_attributes(module, dict(zip(names, (gemma_config, paligemma, expert)))):
        yield


def write_pi_tokenizer(directory: str | Path, vocab_size: int | None = PALIGEMMA_VOCAB) -> Path:
    """Write a character-level tokenizer with Gemma's special tokens and PaliGemma's <bos> prefix into `directory`,
    `vocab_size` tokens in all (PALIGEMMA_VOCAB: the full model's table; None: the characters alone, for the tiny
    variants). A stand-in that runs the model at its real cost; pretrained weights need PaliGemma's own tokenizer."""
    directory = Path(directory)
    build_tokenizer(GEMMA_SPECIAL_TOKENS, {}, vocab_size, add_bos=True).save_pretrained(directory)
    return directory


def pi_tokenizer_dir(vocab_size: int | None) -> Path:
    """The cached directory of write_pi_tokenizer(vocab_size), written on first use (atomically, so parallel actors
    never read a half-written one)."""
    payload = {"format": PI_TOKENIZER_FORMAT, "written_by": writer_line(), "vocab_size": vocab_size}
    key = short_digest(payload)
    path = cache_dir("pi_tokenizer") / key
    if not (path / "tokenizer_config.json").is_file():
        write_directory_atomically(path, lambda tmp: write_pi_tokenizer(tmp, vocab_size))
    return path
