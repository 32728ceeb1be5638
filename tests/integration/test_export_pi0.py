"""learner.export on the tiny pi0 and pi0.5 (offline, CPU; lerobot 0.6 only): lerobot's own loader reads the export with
every tensor the project's, and lerobot's pipeline (its env-observation conversion, preprocessor, sampler and
postprocessor) turns env-unit state and frames into the project's env actions. The refusals and the command line in a
fresh process do not depend on the backend: tests/integration/test_export.py covers them on SmolVLA.

lerobot builds its two Gemma sizes only; the tiny ones are the project's (common.policy.pi0.stand_ins.TINY_GEMMA). Its loader
reads them inside lerobot_knows_tiny: its config accepts the tiny names and its builder makes the tiny sizes
(tiny_gemma_sizes, as PiFlowPolicy builds them). Reading config.json, model.safetensors and the processor files, the
model's classes and the sampler are lerobot's own.

pi0.5 spells the state into its prompt, in 256 bins of the state lerobot's normaliser maps into [-1, 1]; the export's
MIN_MAX statistics put the project's clip, mean -+ OBS_CLIP std, at -+1, so lerobot's prompt is the project's token
for token (for states within the clip).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.policy import OBS_CLIP
from common.policy.lerobot_compat import LEROBOT_LINE, SUPPORTED_LEROBOT

if LEROBOT_LINE < (0, 6):
    pytest.skip(
        f"pi0 / pi0.5 need lerobot 0.6 (its pi0 on lerobot 0.4 needs a patched transformers): {SUPPORTED_LEROBOT[(0, 6)]}",
        allow_module_level=True,
    )

from common.policy.pi0.model import LEROBOT_CLASSES, LEROBOT_PROCESSORS, PALIGEMMA_TOKENIZER, PiFlowPolicy, resolve_tokenizer_path  # noqa: E402
from common.policy.pi0.stand_ins import swapped_attributes, tiny_gemma_sizes  # noqa: E402
from tests.helpers.lerobot_export import (  # noqa: E402
    ACTION,
    CAMERAS,
    OBS_IMAGES,
    OBS_LANGUAGE_ATTENTION_MASK,
    OBS_LANGUAGE_TOKENS,
    OBS_STATE,
    check_lerobot_chunk_is_the_projects,
    check_normaliser_statistics,
    check_tensors_are_the_projects,
    export,
    get_policy_class,
    instructions_of,
    lerobot_observation,
    make_pre_post_processors,
    moved_off_init,
    save_checkpoint,
    within_clip,
)
from tests.helpers.vla import IMAGE_SIZE, tiny_observations, tiny_pi  # noqa: E402

# Padded actions on both sides (lerobot's sampler integrates the padded elements, the project's chain holds them at 0),
# and pi0's state padded too.
PADDED = {"pi0": {"max_action_dim": 6, "max_state_dim": 42}, "pi05": {"max_action_dim": 6}}
# float32: the project's chain runs t from 0 to 1 and lerobot's from 1 to 0, so the same steps round differently.
ACTION_TOLERANCE = 1e-5  # env units: float32 rounding; a chunk sampled with the padded elements free is far off


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def exported(request, tmp_path_factory) -> tuple[PiFlowPolicy, Path]:
    """(a tiny pi0 / pi0.5 with two cameras, padded widths, moved off its initialisation; its export by the command)."""
    policy_type = request.param
    root = tmp_path_factory.mktemp(f"export_{policy_type}")
    policy = moved_off_init(tiny_pi(policy_type, seed=40, cameras=CAMERAS, pi0=PADDED[policy_type]), seed=40)
    checkpoint = save_checkpoint(policy, root / "checkpoint")
    status, stdout, stderr = export(str(checkpoint), "--out", str(root / "lerobot"))
    assert status == 0, stderr
    assert stdout.splitlines()[0] == f"wrote a lerobot {policy_type} checkpoint of {checkpoint} to {root / 'lerobot'}:"
    assert f"{LEROBOT_CLASSES[policy_type][1].__name__} weights" in stdout
    assert f'get_policy_class("{policy_type}").from_pretrained(' in stdout
    return policy, root / "lerobot"


@contextlib.contextmanager
def lerobot_knows_tiny(policy: PiFlowPolicy) -> Iterator[None]:
    """While open, lerobot's config for policy.type accepts the tiny variant names (its check runs on the real names in
    their place) and its modeling builds them at the tiny sizes."""
    config_class, _, module = LEROBOT_CLASSES[policy.config.type]
    check = config_class.__post_init__

    def post_init(config) -> None:
        tiny = config.paligemma_variant, config.action_expert_variant
        config.paligemma_variant, config.action_expert_variant = "gemma_2b", "gemma_300m"
        check(config)
        config.paligemma_variant, config.action_expert_variant = tiny

    with swapped_attributes(config_class, {"__post_init__": post_init}), tiny_gemma_sizes(module, len(policy.tokenizer)):
        yield


def load_lerobot(policy: PiFlowPolicy, directory: Path) -> tuple[torch.nn.Module, object, object, str]:
    """As the exporter tells users to (lerobot's policy class by type, strictly, and its processor pipelines), inside
    lerobot_knows_tiny -> (lerobot's policy, preprocessor, postprocessor, what its loader printed)."""
    printed = io.StringIO()
    with lerobot_knows_tiny(policy), contextlib.redirect_stdout(printed):
        loaded = get_policy_class(policy.config.type).from_pretrained(str(directory), strict=True)
    preprocessor, postprocessor = make_pre_post_processors(loaded.config, pretrained_path=str(directory))
    return loaded, preprocessor, postprocessor, printed.getvalue()


def test_lerobot_reads_every_tensor_and_the_normalisation_of_the_export(exported) -> None:
    policy, out = exported
    loaded, preprocessor, postprocessor, printed = load_lerobot(policy, out)
    assert type(loaded) is LEROBOT_CLASSES[policy.config.type][1]
    # lerobot's loader reports a strict mismatch by printing it, and goes on with the model's random weights.
    assert "All keys loaded successfully!" in printed

    config = loaded.config
    assert (config.paligemma_variant, config.action_expert_variant) == ("tiny", "tiny_expert")
    assert {k: (f.type.name, tuple(f.shape)) for k, f in config.input_features.items()} == {
        OBS_STATE: ("STATE", (39,)),
        **{f"{OBS_IMAGES}.{camera}": ("VISUAL", (3, IMAGE_SIZE, IMAGE_SIZE)) for camera in CAMERAS},
    }
    assert {k: (f.type.name, tuple(f.shape)) for k, f in config.output_features.items()} == {ACTION: ("ACTION", (policy.action_dim,))}
    assert (config.chunk_size, config.num_inference_steps, config.max_action_dim, config.image_resolution) == (4, 3, 6, (32, 32))
    assert config.tokenizer_max_length == policy.config.pi0.tokenizer_max_length
    (tokenizer,) = [step for step in preprocessor.steps if type(step).__name__ == "TokenizerProcessorStep"]
    assert tokenizer.tokenizer_name == str(resolve_tokenizer_path(policy.config))  # local: nothing downloads

    check_tensors_are_the_projects(policy, out, loaded)
    if policy.is_pi05:
        assert config.normalization_mapping["STATE"].name == "MIN_MAX"
        state = {"min": policy.obs_mean - OBS_CLIP * policy.obs_std, "max": policy.obs_mean + OBS_CLIP * policy.obs_std}
    else:
        assert config.max_state_dim == 42 and config.normalization_mapping["STATE"].name == "MEAN_STD"
        state = {"mean": policy.obs_mean, "std": policy.obs_std}
    check_normaliser_statistics(policy, preprocessor, postprocessor, state)


@pytest.mark.parametrize("start", ["zero", "gaussian"])
def test_lerobot_pipeline_gives_the_projects_env_actions(exported, start) -> None:
    """Env-unit state and frames in, env actions out: lerobot's pipeline on the export against the project's chain on
    the same observation and initial noise. "zero" is the project's deterministic (evaluation) policy, a_0 = 0;
    "gaussian" starts both from the same draw, the padded elements of lerobot's included."""
    policy, out = exported
    loaded, preprocessor, postprocessor, _ = load_lerobot(policy, out)
    obs = within_clip(policy, tiny_observations(policy, 3, seed=41), seed=42)
    batch = preprocessor(lerobot_observation(obs, instructions_of(3)))
    if policy.is_pi05:
        tokens, mask = policy.pi05_prompt(obs)  # the instruction and the discretised state
    else:
        tokens, mask = obs.tokens, obs.token_mask
        torch.testing.assert_close(batch[OBS_STATE], policy.normalized_state(obs), atol=1e-6, rtol=0)  # lerobot adds 1e-8 to std
    assert torch.equal(batch[OBS_LANGUAGE_TOKENS], tokens) and torch.equal(batch[OBS_LANGUAGE_ATTENTION_MASK], mask)
    check_lerobot_chunk_is_the_projects(policy, loaded, postprocessor, obs, batch, start, ACTION_TOLERANCE)


def test_a_copy_of_paligemmas_tokenizer_is_named_as_lerobots_factory_names_it(exported, tmp_path) -> None:
    """With policy.pi0.tokenizer_path (a local copy of PaliGemma's tokenizer) the export's preprocessor names the tokenizer
    as lerobot's own factory does, on the hub, not by this machine's path; the offline stand-in, a tokenizer of no hub
    id, keeps its directory."""
    policy, out = exported
    stand_in = str(resolve_tokenizer_path(policy.config))
    assert tokenizer_named(out) == stand_in
    assert f'tokenizer_name="{PALIGEMMA_TOKENIZER}"' in inspect.getsource(LEROBOT_PROCESSORS[policy.config.type])
    copy = shutil.copytree(stand_in, tmp_path / "tokenizer")
    checkpoint = save_checkpoint(PiFlowPolicy.from_pretrained(out.parent / "checkpoint", tokenizer_path=str(copy)), tmp_path / "copy")
    status, stdout, stderr = export(str(checkpoint), "--out", str(tmp_path / "lerobot"))
    assert status == 0, stderr
    assert tokenizer_named(tmp_path / "lerobot") == PALIGEMMA_TOKENIZER and f"tokenizer {PALIGEMMA_TOKENIZER};" in stdout
    assert "note: the export names" not in stdout


def tokenizer_named(export: Path) -> str:
    (name,) = [step["config"]["tokenizer_name"] for step in json.loads((export / "policy_preprocessor.json").read_text())["steps"]
               if "tokenizer_name" in step.get("config", {})]  # fmt: skip
    return name
