"""A tiny SmolVLM backbone built fully offline, for tests and CPU runs of the SmolVLA backend.

SmolVLA (lerobot) builds its VLM from `vlm_model_name`: a directory holding a SmolVLM config, an image
processor and a tokenizer. Here that directory is written from scratch: a character-level tokenizer built
with the `tokenizers` library (printable ASCII plus SmolVLM's image special tokens), a SmolVLM processor,
and a SmolVLM config a few hundred thousand parameters in size. No hub access, no weights: the policy's
own checkpoint holds every tensor (see common.policy.smolvla.model).

SMOLVLM2_500M_SHAPES gives the same offline directory at smolvla_base's backbone sizes (random weights at the
real compute cost: bench/smolvla_gpu.py); only its vocabulary stays the character tokenizer's.

Shape rules lerobot and transformers impose (checked in TinyVLMSpec.validate):
  - square images whose side is divisible by patch_size * scale_factor (the pixel shuffle of the connector);
  - lerobot's expert is 0.75 x the text width, and its sinusoidal time embedding needs that width even;
  - SmolVLA's num_vlm_layers must not exceed text_layers.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from common.config import cache_dir
from common.console import log
from common.file_digests import short_digest
from common.policy.offline_tokenizer import build_tokenizer, writer_line
from common.policy.torchvision_shim import install_cpu_torchvision_shim
from common.storage import write_directory_atomically

install_cpu_torchvision_shim()

# SmolVLM's special tokens: lerobot reads fake_image_token_id / global_image_token_id from the tokenizer,
# the processor reads image_token / end_of_utterance_token.
SPECIAL_TOKENS = {
    "pad_token": "<|pad|>",
    "unk_token": "<|unk|>",
    "bos_token": "<|im_start|>",
    "eos_token": "<end_of_utterance>",
}
EXTRA_SPECIAL_TOKENS = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}
# Bump when the files written below change, so cached directories are rebuilt.
TINY_VLM_FORMAT = 2


@dataclass(frozen=True)
class TinyVLMSpec:
    """Sizes of the tiny SmolVLM. The defaults give ~0.1M VLM parameters (SmolVLA adds its expert)."""

    image_size: int = 32
    patch_size: int = 8
    scale_factor: int = 2  # connector pixel shuffle: (image/patch)^2 / scale^2 image tokens per camera
    vision_hidden: int = 32
    vision_intermediate: int = 64
    vision_layers: int = 1
    vision_heads: int = 2
    vision_attention_dropout: float = 0.1  # > 0 on purpose: train mode would make log-probs random (a failure the tests provoke)
    text_hidden: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 128

    def validate(self) -> None:
        cell = self.patch_size * self.scale_factor
        if self.image_size <= 0 or self.image_size % cell:
            raise ValueError(f"TinyVLMSpec.image_size must be a positive multiple of patch_size*scale_factor={cell}, got {self.image_size}")
        if int(self.text_hidden * 0.75) % 2:
            raise ValueError(f"TinyVLMSpec.text_hidden*0.75 must be even (SmolVLA's expert width), got {self.text_hidden}")
        if self.text_hidden % self.text_heads or self.text_heads % self.text_kv_heads:
            raise ValueError("TinyVLMSpec.text_heads must divide text_hidden and be a multiple of text_kv_heads")

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor**2

    def key(self) -> str:
        return short_digest({"format": TINY_VLM_FORMAT, "written_by": writer_line(), **dataclasses.asdict(self)})


# SmolVLM2-500M-Video-Instruct, smolvla_base's backbone: SigLIP-B/16 at 512 px, a 4x pixel shuffle (64 tokens per
# image), SmolLM2-360M's text model (SmolVLA keeps its first 16 of 32 layers). Its 49k-token vocabulary is the one
# size not reproduced: the embedding table is only looked up, so it changes memory, not compute.
SMOLVLM2_500M_SHAPES = TinyVLMSpec(
    image_size=512,
    patch_size=16,
    scale_factor=4,
    vision_hidden=768,
    vision_intermediate=3072,
    vision_layers=12,
    vision_heads=12,
    vision_attention_dropout=0.0,
    text_hidden=960,
    text_layers=32,
    text_heads=15,
    text_kv_heads=5,
    text_intermediate=2560,
)


def write_tiny_vlm(directory: str | Path, spec: TinyVLMSpec) -> Path:
    """Write config.json, the tokenizer and the processor of a tiny SmolVLM into `directory`."""
    from transformers import SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    spec.validate()
    directory = Path(directory)
    tokenizer = build_tokenizer(SPECIAL_TOKENS, EXTRA_SPECIAL_TOKENS)
    vocab_size = len(tokenizer)
    config = SmolVLMConfig(
        vision_config={
            "hidden_size": spec.vision_hidden,
            "intermediate_size": spec.vision_intermediate,
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads,
            "image_size": spec.image_size,
            "patch_size": spec.patch_size,
            "attention_dropout": spec.vision_attention_dropout,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": spec.text_hidden,
            "intermediate_size": spec.text_intermediate,
            "num_hidden_layers": spec.text_layers,
            "num_attention_heads": spec.text_heads,
            "num_key_value_heads": spec.text_kv_heads,
            "head_dim": spec.text_hidden // spec.text_heads,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5,
            "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": False,
        },
        scale_factor=spec.scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids(EXTRA_SPECIAL_TOKENS["image_token"]),
        pad_token_id=tokenizer.pad_token_id,
    )
    edge = {"longest_edge": spec.image_size}
    processor = SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(size=edge, max_image_size=edge, do_image_splitting=False),
        tokenizer=tokenizer,
        video_processor=SmolVLMVideoProcessor(size=edge, max_image_size=edge),
        image_seq_len=spec.image_tokens,
    )
    config.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def tiny_vlm_dir(spec: TinyVLMSpec | None = None) -> Path:
    """The cached directory of the tiny SmolVLM for `spec`, written on first use (atomically, so parallel
    actors never read a half-written one)."""
    spec = spec or TinyVLMSpec()
    spec.validate()
    path = cache_dir("tiny_smolvla") / spec.key()
    if not (path / "config.json").is_file():
        write_directory_atomically(path, lambda tmp: write_tiny_vlm(tmp, spec))
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m common.policy.smolvla.stand_ins --image-size 64`: writes (once) the tiny SmolVLM backbone for that
    frame size and prints its directory, which lerobot-train takes as --policy.vlm_model_name (docs/lerobot.md)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.policy.smolvla.stand_ins", description=main.__doc__)
    parser.add_argument("--image-size", type=int, default=TinyVLMSpec.image_size, help="the vision tower's square input side")
    args = parser.parse_args(argv)
    try:
        log.info(tiny_vlm_dir(dataclasses.replace(TinyVLMSpec(), image_size=args.image_size)))
    except ValueError as exc:
        log.error(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
