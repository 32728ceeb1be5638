"""The one place where the two supported lerobot lines differ for the project's VLA backends.

  lerobot 0.4.x (Python 3.11, transformers 4.57): installed with --no-deps beside torch 2.13 (docs/smolvla.md).
  lerobot 0.6.x (Python >= 3.12, transformers 5.4-5.5): the project's `lerobot` extra (lerobot[smolvla]) beside torch 2.11.

What differs, and what the backends get from here instead:
  prefix KV cache   The backends run the prefix once (encode) and keep its per-layer keys and values as plain
                    tensors, batch first, (B, L, kv_heads, head_dim): index_features/concat_features slice and join
                    them, and every denoising step, PPO epoch and minibatch reuses them. lerobot keeps that cache
                    as a dict {layer: {"key_states", "value_states"}} in that layout in SmolVLA 0.4.x (filled by
                    forward(fill_kv_cache=True), only read by denoise_step), and as a transformers DynamicCache of
                    (B, kv_heads, L, head_dim) in SmolVLA 0.6.x and in pi0/pi0.5 on both lines; 0.6.x SmolVLA
                    fills it when forward gets no cache, and its denoise_step appends the action tokens to it and
                    crops them off again in place. So every denoising call gets a cache of its own, built from the
                    kept tensors (`denoise_cache`), and the kept tensors are never touched by lerobot.
  helpers           make_att_2d_masks, pad_vector and resize_with_pad moved to lerobot.policies.common.vla_utils
                    in 0.6, and resize_with_pad's arguments became (height, width, *, pad_value).

What does not differ: a lerobot SmolVLA checkpoint (FlowPolicy.to_lerobot, python -m learner.export). Both lines save
config.json and model.safetensors with SmolVLAPolicy.save_pretrained, and build their processor pipelines with
lerobot.policies.factory.make_pre_post_processors(config, dataset_stats=...). Both write the same
policy_preprocessor.json and policy_postprocessor.json, with the same step names and normaliser state files, and read
them back the same way. So the backends call lerobot for these directly.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from importlib.metadata import version

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from common.policy.torchvision_shim import install_cpu_torchvision_shim

# Supported lerobot lines (major, minor) -> the Python they need and how they install (docs/smolvla.md).
SUPPORTED_LEROBOT = {
    (0, 4): 'Python 3.11: pip install torch==2.13.0 && pip install -e ".[smolvla]" && pip install --no-deps lerobot==0.4.4',
    (0, 6): 'Python >= 3.12: pip install torch==2.11.0 && pip install -e ".[lerobot]"',
}


def lerobot_line(installed: str) -> tuple[int, int]:
    """'0.6.1' -> (0, 6), or ImportError naming the installed version and the supported installs."""
    line = tuple(int(part) for part in installed.split(".")[:2])
    if line not in SUPPORTED_LEROBOT:
        installs = "; ".join(f"{'.'.join(map(str, key))}.x on {how}" for key, how in SUPPORTED_LEROBOT.items())
        raise ImportError(f"lerobot {installed} is installed; the VLA backends support lerobot {installs}")
    return line


LEROBOT_VERSION = version("lerobot")
LEROBOT_LINE = lerobot_line(LEROBOT_VERSION)

install_cpu_torchvision_shim()  # before lerobot's first import of torchvision (a no-op beside a CUDA torch)

if LEROBOT_LINE >= (0, 6):
    from lerobot.policies.common.vla_utils import make_att_2d_masks, pad_vector
    from lerobot.policies.common.vla_utils import resize_with_pad as lerobot_resize_with_pad
else:
    from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks, pad_vector
    from lerobot.policies.smolvla.modeling_smolvla import resize_with_pad as lerobot_resize_with_pad

__all__ = [
    "LEROBOT_VERSION",
    "denoise_cache",
    "embed_whole_frames",
    "fill_prefix_cache",
    "make_att_2d_masks",
    "pad_vector",
    "resize_with_pad",
]

KVLayers = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]  # per layer keys, per layer values, each (B, L, kv_heads, head_dim)


def resize_with_pad(images: Tensor, height: int, width: int, pad_value: float) -> Tensor:
    """lerobot's aspect-keeping resize of (B, C, H, W) images, padded on the left and top, on either line."""
    if LEROBOT_LINE >= (0, 6):
        return lerobot_resize_with_pad(images, height, width, pad_value=pad_value)
    return lerobot_resize_with_pad(images, width, height, pad_value=pad_value)


DICT_CACHE_CLASSES: dict[type[nn.Module], bool] = {}  # keeps_dict_cache's answer per class


@torch.compiler.assume_constant_result  # a compiled step (actors.speed.compile_steps) takes the class's answer, never traces it
def keeps_dict_cache(model_class: type[nn.Module]) -> bool:
    """Whether a VLM-with-expert class fills a dict cache on request (SmolVLA 0.4.x's `fill_kv_cache`)."""
    if model_class not in DICT_CACHE_CLASSES:
        DICT_CACHE_CLASSES[model_class] = "fill_kv_cache" in inspect.signature(model_class.forward).parameters
    return DICT_CACHE_CLASSES[model_class]


def fill_prefix_cache(
    vlm_with_expert: nn.Module, embeddings: Tensor, attention_mask: Tensor, position_ids: Tensor
) -> tuple[Tensor, KVLayers]:
    """One pass of the VLM over the prefix embeddings (B, L, text_hidden), with the attention mask and
    position ids the model's own sampler builds for its prefix -> (final prefix hidden states
    (B, L, text_hidden), the per-layer keys and values it cached)."""
    dict_cache = keeps_dict_cache(type(vlm_with_expert))
    (prefix_out, _), cache = vlm_with_expert.forward(
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=None,
        inputs_embeds=[embeddings, None],
        use_cache=True,
        **({"fill_kv_cache": True} if dict_cache else {}),
    )
    if dict_cache:
        layers = [cache[i] for i in range(len(cache))]
        return prefix_out, (tuple(layer["key_states"] for layer in layers), tuple(layer["value_states"] for layer in layers))
    return prefix_out, kv_layers(cache)


def kv_layers(cache: DynamicCache) -> KVLayers:
    """A transformers DynamicCache -> per-layer keys and values in the backends' layout (views, no copy)."""
    return tuple(layer.keys.transpose(1, 2) for layer in cache.layers), tuple(layer.values.transpose(1, 2) for layer in cache.layers)


def dynamic_cache(kv: KVLayers) -> DynamicCache:
    """The inverse of kv_layers: a fresh DynamicCache holding copies of the given keys and values."""
    return DynamicCache(ddp_cache_data=[(keys.transpose(1, 2), values.transpose(1, 2)) for keys, values in zip(*kv)])


def denoise_cache(vlm_with_expert: nn.Module, kv: KVLayers) -> dict[int, dict[str, Tensor]] | DynamicCache:
    """The prefix cache in the form `vlm_with_expert`'s denoise_step reads, new for each call (0.6.x extends
    and crops a DynamicCache in place; the kept tensors must stay the prefix's)."""
    if keeps_dict_cache(type(vlm_with_expert)):
        return {i: {"key_states": keys, "value_states": values} for i, (keys, values) in enumerate(zip(*kv))}
    return dynamic_cache(kv)


# Per vision embeddings module: (frame height and width, device) -> the position ids of a whole frame's patches.
WHOLE_FRAME_POSITIONS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Tensor]] = weakref.WeakKeyDictionary()


def whole_frame_positions(vision: nn.Module, frames: Tensor) -> Tensor:
    """The position ids (1, P) SmolVLM's vision embeddings give the patches of a whole frame of this size, as the
    installed transformers computes them (4.57 numbers them otherwise than 5.x: the ids are read, not derived). Read once
    per embeddings module and frame size, by one eager call on the first frame, and kept on the frames' device."""
    embeddings = vision.embeddings
    key = (tuple(frames.shape[-2:]), frames.device)
    kept = WHOLE_FRAME_POSITIONS.setdefault(embeddings, {})
    if key not in kept:
        side = vision.config.patch_size
        whole = torch.ones((1, frames.shape[-2] // side, frames.shape[-1] // side), dtype=torch.bool, device=frames.device)
        read: list[Tensor] = []
        handle = embeddings.position_embedding.register_forward_pre_hook(lambda _module, args: read.append(args[0]))
        try:
            embeddings(pixel_values=frames[:1], patch_attention_mask=whole)
        finally:
            handle.remove()
        kept[key] = read[0].clone()
    return kept[key]


def whole_frame_tower(vlm_with_expert: nn.Module, pixels: Tensor, positions: Tensor) -> Tensor:
    """SigLIP and the connector over whole frames whose patches have the position ids `positions`: embed_whole_frames'
    work once the ids are known, a function of tensors alone (what actors.speed.compile_vision compiles)."""
    vision = vlm_with_expert.get_vlm_model().vision_model
    patches = vision.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
    hidden = patches + vision.embeddings.position_embedding(positions)
    hidden = vision.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state
    return vlm_with_expert.get_vlm_model().connector(vision.post_layernorm(hidden))


def embed_whole_frames(vlm_with_expert: nn.Module, images: Tensor, tower: Callable[..., Tensor] = whole_frame_tower) -> Tensor:
    """lerobot's `embed_image` (SigLIP, then the connector) for whole frames, without reading any tensor on the host
    after the first call. SmolVLM's vision tower takes frames of any size: at every call it reads the patch mask's
    contents to number the patches (a boolean index and scalar reads) and to drop the attention mask, which stalls the
    CPU and rules out a CUDA graph. Every patch of a whole frame is real, so the numbering is fixed
    (whole_frame_positions) and attention needs no mask: the same numbers (tests/integration/test_decision_graph.py). `tower`:
    whole_frame_tower, or a compiled copy of it."""
    vision = vlm_with_expert.get_vlm_model().vision_model
    pixels = images.to(dtype=vision.dtype)
    return tower(vlm_with_expert, pixels, whole_frame_positions(vision, pixels))
