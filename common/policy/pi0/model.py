"""pi0 and pi0.5 (lerobot 0.6's PI0Policy and PI05Policy) as flow policies: camera frames, instruction and state in.

Both are a PaliGemma backbone (SigLIP + Gemma) whose per-layer keys and values an action expert (a smaller Gemma)
attends to. What each FlowPolicy piece reads:
  encode(obs)   runs the prefix ONCE with lerobot's `embed_prefix` (SigLIP tokens of every camera, embedded in one batch
                by vla_common.one_vision_pass or recorded by a rollout, then the prompt's tokens) and the model's prefix pass
                (common.policy.vla_common.prefix_features), keeping the per-layer KV cache, the pad mask and the
                critic's input. pi0's prompt is the instruction (with lerobot's trailing newline); its state enters the
                expert's suffix at every step through `state_proj`, so encode keeps the padded normalised state beside
                the cache. pi0.5 has no state projection: as lerobot's preprocessor
                (Pi05PrepareStateTokenizerProcessorStep, called here), the state is discretised into 256 bins and
                spelled out in the prompt, "Task: <instruction>, State: <bins>;\\nAction: ", which is tokenized anew
                at every encode from the instruction's tokens and the current state.
  velocity      lerobot's `denoise_step` on a fresh copy of that cache (common.policy.vla_common.VLAFlowPolicy.velocity),
                its time convention mapped by common.policy.vla_common.lerobot_flow_time; pi0.5's expert takes the time
                through adaRMS conditioning, pi0's through an MLP over [action, time] embeddings.
  sigma, value  the ReinFlow noise head on the expert hidden state (the input of `action_out_proj`) and the critic on
                the pooled prefix and the normalised state, as for SmolVLA (common.policy.vla_common).
  fuse_attention  both Gemmas attend through one fused kernel (gemma_attention) instead of transformers' eager
                attention, which lerobot's passes select.

Sizes: lerobot builds gemma_2b (PaliGemma) and gemma_300m (expert) with SigLIP So400m at 224 px and PaliGemma's
257,152-token vocabulary, random unless policy.pi0.lerobot_checkpoint names a checkpoint. policy.pi0 variants "tiny" /
"tiny_expert" build the same lerobot classes at a few hundred thousand parameters (TINY_GEMMA, TINY_SIGLIP) for CPU
tests. Nothing downloads: the tokenizer is policy.pi0.tokenizer_path, or a character tokenizer written offline
(pi_tokenizer_dir) at the model's vocabulary size.

Install (docs/pi0.md): lerobot 0.6, i.e. the project's `lerobot` extra on Python >= 3.12 (lerobot 0.4's pi0 needs a
patched transformers). This module is imported only when policy.type is "pi0" or "pi05".
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from common.config import PolicyConfig
from common.observation import Observation
from common.policy import vla_common
from common.policy.base import OBS_CLIP
from common.policy.lerobot_compat import LEROBOT_LINE, LEROBOT_VERSION, SUPPORTED_LEROBOT, denoise_cache, make_att_2d_masks, pad_vector
from common.policy.pi0.stand_ins import PALIGEMMA_VOCAB, pi_tokenizer_dir, swapped_attributes, tiny_gemma_sizes
from common.policy.vla_common import VLAFeatures, VLAFlowPolicy, grouped_query_attention, one_vision_pass, prefix_features
from common.storage import CheckpointError

if LEROBOT_LINE < (0, 6):
    raise ImportError(
        f"policy.type pi0 / pi05 needs lerobot 0.6 ({SUPPORTED_LEROBOT[(0, 6)]}); lerobot {LEROBOT_VERSION} is installed (docs/pi0.md)"
    )

from lerobot.lerobot_types import TransitionKey  # noqa: E402
from lerobot.policies.common.vla_utils import prepare_attention_masks_4d  # noqa: E402
from lerobot.policies.pi0 import modeling_pi0, processor_pi0  # noqa: E402
from lerobot.policies.pi0.configuration_pi0 import PI0Config  # noqa: E402
from lerobot.policies.pi05 import modeling_pi05, processor_pi05  # noqa: E402
from lerobot.policies.pi05.configuration_pi05 import PI05Config  # noqa: E402
from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep  # noqa: E402
from lerobot.utils.constants import OBS_STATE  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

# lerobot config.json fields that fix tensor shapes: a lerobot checkpoint must agree with policy.pi0 on each
# (the SigLIP resolution shows as a wrong-shaped position embedding). pi0.5 has no state projection.
LEROBOT_ARCHITECTURE_FIELDS = {
    "pi0": ("paligemma_variant", "action_expert_variant", "max_state_dim", "max_action_dim"),
    "pi05": ("paligemma_variant", "action_expert_variant", "max_action_dim"),
}
LEROBOT_CLASSES = {"pi0": (PI0Config, modeling_pi0.PI0Policy, modeling_pi0), "pi05": (PI05Config, modeling_pi05.PI05Policy, modeling_pi05)}
LEROBOT_PROCESSORS = {"pi0": processor_pi0, "pi05": processor_pi05}  # the modules of lerobot's processor factories
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # the tokenizer those factories name on the hub
FUSED_ATTENTION = "grouped_query_sdpa"  # gemma_attention's name in transformers' AttentionInterface


def gemma_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor, scaling: float, dropout: float = 0.0, **_: Any
) -> tuple[Tensor, None]:
    """transformers' Gemma `eager_attention_forward` as an AttentionInterface function ((B, heads, Lq, D) queries,
    (B, kv_heads, Lk, D) keys and values, lerobot's additive (B, 1, Lq, Lk) mask, whose masked entries are finite ->
    (B, Lq, heads, D) and no weights) through common.policy.vla_common.grouped_query_attention. No dropout: the lerobot
    model stays in eval mode (VLAFlowPolicy.train)."""
    if dropout:
        raise ValueError(f"{FUSED_ATTENTION} runs without dropout (an eval-mode model); {type(module).__name__} asked for {dropout}")
    return grouped_query_attention(query, key, value, attention_mask, scaling).transpose(1, 2), None


AttentionInterface.register(FUSED_ATTENTION, gemma_attention)


def is_tiny(config: PolicyConfig) -> bool:
    return config.pi0.paligemma_variant.startswith("tiny")


@contextlib.contextmanager
def local_tokenizer_step(module: ModuleType, tokenizer_path: Path) -> Iterator[None]:
    """While open, lerobot's pi0 / pi0.5 processor factory in `module` builds its tokenizer step on the local
    `tokenizer_path`: the factory names PaliGemma's tokenizer on the hub, which the step loads as it is built. The
    step saves the name it loaded, so the written pipeline reads the same local directory."""
    step = module.TokenizerProcessorStep

    def local(**kwargs: Any) -> Any:
        return step(**{**kwargs, "tokenizer_name": str(tokenizer_path)})

    with swapped_attributes(module, {"TokenizerProcessorStep": local}):
        yield


def resolve_tokenizer_path(config: PolicyConfig) -> Path:
    """policy.pi0.tokenizer_path, or the offline character tokenizer for the configured sizes when it is empty."""
    what = "PaliGemma's tokenizer files (e.g. a copy of google/paligemma-3b-pt-224's)"
    return vla_common.local_directory(
        config,
        "pi0",
        "tokenizer_path",
        "tokenizer_config.json",
        what,
        lambda: pi_tokenizer_dir(None if is_tiny(config) else PALIGEMMA_VOCAB),
    )


def build_lerobot_config(config: PolicyConfig) -> PI0Config | PI05Config:
    """lerobot's PI0Config / PI05Config for this policy config (float32; actors cast with set_backbone_dtype)."""
    pi = config.pi0
    lerobot_config_class = LEROBOT_CLASSES[config.type][0]
    tiny = is_tiny(config)
    lerobot_config = lerobot_config_class(
        # lerobot's config accepts its two sizes only; the tiny names are set below, for tiny_gemma_sizes to build
        paligemma_variant="gemma_2b" if tiny else pi.paligemma_variant,
        action_expert_variant="gemma_300m" if tiny else pi.action_expert_variant,
        dtype="float32",
        num_inference_steps=config.num_steps,
        image_resolution=(pi.image_resolution, pi.image_resolution),
        **vla_common.lerobot_config_fields(config),
    )
    if tiny:
        lerobot_config.paligemma_variant, lerobot_config.action_expert_variant = pi.paligemma_variant, pi.action_expert_variant
    return lerobot_config


class PiFlowPolicy(VLAFlowPolicy):
    """lerobot's PI0Policy (policy.type pi0) or PI05Policy (pi05), attribute `vla`, plus a ReinFlow noise head and a
    critic head; settings in policy.pi0."""

    prefix_groups = ("vlm",)  # encode() runs PaliGemma alone: pi0's state_proj feeds the expert's suffix

    def __init__(self, config: PolicyConfig):
        super().__init__()
        config.validate()
        if config.type not in LEROBOT_CLASSES:
            raise CheckpointError(f"PiFlowPolicy needs policy.type 'pi0' or 'pi05', got {config.type!r}")
        self.config = copy.deepcopy(config)  # its own: set_trainable changes it, never the caller's run config
        self.prompt_written = False  # pi0.5 inside capture_context(): the observation's tokens are the whole prompt
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(resolve_tokenizer_path(config)))
        _, policy_class, module = LEROBOT_CLASSES[config.type]
        tiny = tiny_gemma_sizes(module, len(self.tokenizer)) if is_tiny(config) else contextlib.nullcontext()
        with tiny, vla_common.building_lerobot_model(config, "pi0"):
            self.vla = policy_class(build_lerobot_config(config))
        paligemma = self.vla.model.paligemma_with_expert.paligemma
        vocab = paligemma.model.language_model.embed_tokens.num_embeddings
        if len(self.tokenizer) > vocab:
            raise CheckpointError(
                f"the tokenizer at policy.pi0.tokenizer_path has {len(self.tokenizer)} tokens, the model embeds {vocab}: "
                "use PaliGemma's tokenizer"
            )
        # lerobot's sampler switches both Gemmas to eager attention before its passes; encode() runs the prefix pass itself
        for gemma in self.gemmas():
            gemma.config._attn_implementation = "eager"
        if config.pi0.lerobot_checkpoint:
            vla_common.load_lerobot_checkpoint(self.vla, config, "pi0", LEROBOT_ARCHITECTURE_FIELDS[config.type])
        self.add_heads(self.vla.model.action_in_proj.out_features, paligemma.config.text_config.hidden_size)

    @property
    def is_pi05(self) -> bool:
        return self.config.type == "pi05"

    def gemmas(self) -> tuple[nn.Module, nn.Module]:
        """PaliGemma's language model (the prefix pass) and the expert's (the denoising steps)."""
        with_expert = self.vla.model.paligemma_with_expert
        return with_expert.paligemma.model.language_model, with_expert.gemma_expert.model

    def fuse_attention(self, fused: bool = True) -> None:
        """Both Gemmas attend through gemma_attention (actors.speed.fused_attention, learner.speed.fused_attention) from
        here on, or again through transformers' eager attention (fused False). A Gemma attention layer looks its function
        up by its config's attention implementation at every call, and lerobot's denoise_step sets the expert's shared
        config back to eager before every step: so each layer reads a copy of its model's config that names the fused
        function, and fused False hands every layer its model's own config again."""
        for gemma in self.gemmas():
            layer_config = gemma.config
            if fused:
                layer_config = copy.copy(gemma.config)
                layer_config._attn_implementation = FUSED_ATTENTION
            for layer in gemma.layers:
                layer.self_attn.config = layer_config

    @property
    def attention_fused(self) -> bool:
        return all(layer.self_attn.config._attn_implementation == FUSED_ATTENTION for gemma in self.gemmas() for layer in gemma.layers)

    # -- what trains -------------------------------------------------------------------------------

    def parameter_groups(self) -> dict[str, tuple[nn.Module, ...]]:
        """Every trainable-flag group (policy.pi0.train_<group>) -> its modules; they partition the parameters.
        pi0.5's time conditioning is its time MLP plus the adaRMS layers of every expert norm (they read the time
        embedding), so those go with train_time_mlp and the rest of the expert with train_expert."""
        model = self.vla.model
        expert = model.paligemma_with_expert.gemma_expert
        groups: dict[str, tuple[nn.Module, ...]] = {"vlm": (model.paligemma_with_expert.paligemma,)}
        if self.is_pi05:
            layers = expert.model.layers
            norms = tuple(norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm))
            groups["expert"] = (*(part for layer in layers for part in (layer.self_attn, layer.mlp)), expert.lm_head)
            groups["time_mlp"] = (model.time_mlp_in, model.time_mlp_out, *norms, expert.model.norm)
        else:
            groups["expert"] = (expert,)
            groups["time_mlp"] = (model.action_time_mlp_in, model.action_time_mlp_out)
            groups["state_proj"] = (model.state_proj,)
        groups["action_proj"] = (model.action_in_proj, model.action_out_proj)
        groups["noise_head"] = (self.noise_head,)
        groups["critic"] = (self.critic_head,)
        return groups

    def set_backbone_dtype(self, dtype: torch.dtype) -> PiFlowPolicy:
        """Store PaliGemma and the expert in `dtype` for a reduced-precision actor, as lerobot's own bfloat16 mode does
        (its to_bfloat16_for_selected_params keeps SigLIP, the image projection and the norms in float32); the
        projections, noise head and critic stay float32. See SmolVLAFlowPolicy.set_backbone_dtype for why autocast
        alone is not enough."""
        precision = {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(dtype)
        if precision is None:
            raise ValueError(f"pi0 / pi0.5 backbones run in bfloat16 or float32 (lerobot's choices), got {dtype}")
        self.vla.model.paligemma_with_expert.to_bfloat16_for_selected_params(precision)
        return self

    # -- inputs ------------------------------------------------------------------------------------

    def tokenize(self, instructions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Instructions -> (ids (B, L) int64, mask (B, L) bool), L = policy.pi0.tokenizer_max_length, right-padded.
        pi0: the prompt itself, with lerobot's trailing newline. pi0.5: the instruction alone; encode() decodes it
        and tokenizes the full prompt with the current state."""
        texts = instructions if self.is_pi05 else [text if text.endswith("\n") else f"{text}\n" for text in instructions]
        return vla_common.tokenize_texts(self.tokenizer, texts, self.config.pi0.tokenizer_max_length)

    def pi05_prompt(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """pi0.5's prompt tokens (B, L) and mask: lerobot's Pi05PrepareStateTokenizerProcessorStep over the instruction
        and the state, then the tokenizer. lerobot discretises a state normalised into [-1, 1] (its quantile
        normalisation); here that is the normalised state (clipped to +-OBS_CLIP std) divided by OBS_CLIP."""
        length = self.config.pi0.tokenizer_max_length
        rows = [ids[mask].tolist() for ids, mask in zip(obs.tokens.cpu(), obs.token_mask.cpu())]
        tasks = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        transition = {
            TransitionKey.OBSERVATION: {OBS_STATE: self.normalized_state(obs) / OBS_CLIP},
            TransitionKey.COMPLEMENTARY_DATA: {"task": tasks},
        }
        prompts = Pi05PrepareStateTokenizerProcessorStep()(transition)[TransitionKey.COMPLEMENTARY_DATA]["task"]
        ids, mask = vla_common.tokenize_texts(self.tokenizer, prompts, length + 1)  # one more, to see a prompt that does not fit
        if mask[:, length].any():
            raise ValueError(
                f"pi0.5's prompt {prompts[int(np.argmax(mask[:, length]))]!r} has more than policy.pi0.tokenizer_max_length={length} "
                "tokens: raise it (lerobot's default is 200)"
            )
        device = obs.state.device
        return torch.from_numpy(ids[:, :length]).to(device), torch.from_numpy(mask[:, :length]).to(device)

    def compiled_vision_tower(self) -> Callable[[Tensor], Tensor]:
        """lerobot's embed_image (PaliGemma's SigLIP and projector) compiled: it reads nothing on the host."""
        return torch.compile(self.vla.model.paligemma_with_expert.embed_image)

    @contextlib.contextmanager
    def capture_context(self) -> Iterator[None]:
        """pi0.5's prompt is text built from the state on the host (pi05_prompt), which a CUDA graph cannot hold: while
        a graph is warmed up and captured, encode() reads the whole prompt's tokens from the observation, which
        graph_observation wrote there before each replay."""
        self.prompt_written = self.is_pi05
        try:
            yield
        finally:
            self.prompt_written = False

    def graph_observation(self, obs: Observation) -> Observation:
        """pi0.5: the observation with its instruction tokens replaced by the whole prompt's (instruction and state
        bins, pi05_prompt), computed from the same normalised state as the eager path."""
        if not self.is_pi05:
            return obs
        device = self.obs_device
        tokens, mask = self.pi05_prompt(
            Observation(
                state=torch.from_numpy(np.asarray(obs.state)).to(device),
                tokens=torch.from_numpy(np.asarray(obs.tokens)),
                token_mask=torch.from_numpy(np.asarray(obs.token_mask)),
            )
        )
        return dataclasses.replace(obs, tokens=tokens.cpu().numpy(), token_mask=mask.cpu().numpy())

    def lerobot_inputs(self, obs: Observation) -> list[Tensor | list[Tensor]]:
        """Observation -> the inputs of lerobot's sample_actions: images and image masks (lerobot's own preprocessing:
        [0, 1] frames resized with padding to policy.pi0.image_resolution, then [-1, 1]; a placeholder per camera where the
        observation carries recorded tokens instead: camera_placeholders), prompt tokens and mask, and for pi0 the padded
        normalised state."""
        vla_common.require_frames_and_instruction(obs, self.config)
        if obs.image_embeddings is not None:
            images = self.camera_placeholders(obs)
            image_masks = [torch.ones(obs.state.shape[0], dtype=torch.bool, device=obs.state.device) for _ in images]
        else:
            # under the keys the model reads them by (lerobot's _preprocess_images looks its image features up by name)
            frames = {key: obs.images[:, i].permute(0, 3, 1, 2).float() / 255.0 for i, key in enumerate(self.config.image_features())}
            images, image_masks = self.vla._preprocess_images(frames)
        if self.is_pi05:
            return [images, image_masks, *((obs.tokens, obs.token_mask) if self.prompt_written else self.pi05_prompt(obs))]
        return [images, image_masks, obs.tokens, obs.token_mask, pad_vector(self.normalized_state(obs), self.config.pi0.max_state_dim)]

    # -- the FlowPolicy pieces ---------------------------------------------------------------------

    def encode(self, obs: Observation) -> VLAFeatures:
        """One PaliGemma pass over the prefix (images, prompt) -> KV cache, pad mask, critic input (and pi0's state)."""
        model = self.vla.model
        images, image_masks, tokens, token_mask, *state = self.lerobot_inputs(obs)
        embedded = self.camera_embeddings(obs, images, model.paligemma_with_expert)
        with one_vision_pass(model.paligemma_with_expert, images, embedded):
            embeddings, pad_mask, att_mask = model.embed_prefix(images, image_masks, tokens, token_mask)
        attention = prepare_attention_masks_4d(make_att_2d_masks(pad_mask, att_mask))  # as lerobot's sample_actions
        suffix_state = state[0] if state else None
        return prefix_features(
            model.paligemma_with_expert,
            embeddings,
            pad_mask,
            attention,
            self.normalized_state(obs),
            suffix_state,
            self.kept_image_embeddings(embedded),
        )

    def denoise(self, features: VLAFeatures, action: Tensor, lerobot_t: Tensor) -> Tensor:
        model = self.vla.model
        cache = denoise_cache(model.paligemma_with_expert, features.kv())
        if self.is_pi05:
            return model.denoise_step(features.prefix_pad_mask, cache, action, lerobot_t)
        return model.denoise_step(features.suffix_state, features.prefix_pad_mask, cache, action, lerobot_t)

    # -- export to lerobot (VLAFlowPolicy.to_lerobot) -------------------------------------------------

    def lerobot_summary(self, files: str) -> str:
        pi = self.config.pi0
        return f"PaliGemma {pi.paligemma_variant}, expert {pi.action_expert_variant}, tokenizer {files}"

    def lerobot_files(self) -> Path:
        return resolve_tokenizer_path(self.config)

    def lerobot_hub_id(self) -> str | None:
        """lerobot's own name for PaliGemma's tokenizer where policy.pi0.tokenizer_path holds a copy of it; the offline
        character tokenizer has none."""
        return PALIGEMMA_TOKENIZER if self.config.pi0.tokenizer_path else None

    def lerobot_state_normalisation(self) -> tuple[str, dict[str, np.ndarray]]:
        """pi0: as every backend (its state_proj reads the normalised state). pi0.5's prompt spells out a state lerobot's
        normaliser maps into [-1, 1] (pi05_prompt): here the normalised state over OBS_CLIP, which is lerobot's MIN_MAX
        with min and max at the mean -+ OBS_CLIP std."""
        if not self.is_pi05:
            return super().lerobot_state_normalisation()
        mean, spread = self.obs_mean.detach().cpu().numpy(), OBS_CLIP * self.obs_std.detach().cpu().numpy()
        return "MIN_MAX", {"min": mean - spread, "max": mean + spread}

    def lerobot_processors(self, lerobot_config: Any, stats: dict[str, dict[str, np.ndarray]]) -> tuple[Any, Any]:
        """As lerobot builds them, the tokenizer step reading this policy's tokenizer (policy.pi0.tokenizer_path, or the
        offline one) where lerobot's names PaliGemma's on the hub."""
        with local_tokenizer_step(LEROBOT_PROCESSORS[self.config.type], resolve_tokenizer_path(self.config)):
            return super().lerobot_processors(lerobot_config, stats)

    @classmethod
    def from_pretrained(cls, directory: str | Path, tokenizer_path: str | None = None, **overrides: Any) -> PiFlowPolicy:
        """Strict load (every tensor from the file, or CheckpointError naming the missing ones). `tokenizer_path`
        replaces the saved tokenizer directory (the weights are all in the checkpoint)."""
        return cls.load_with_local_path(directory, "tokenizer_path", tokenizer_path, **overrides)
