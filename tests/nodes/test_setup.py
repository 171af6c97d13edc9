"""Nodes declare cheaply and build their models in setup(): a constructed node holds no model,
builds are bitwise reproducible in any order, and bad model files are one clear ValueError."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from graphs import mm_grpo, mm_ppo
from nodes.models.policy import tiny_prefix_vlm
from nodes.reference import ReferenceLogprobs
from nodes.rewards import ClipScoreReward, RewardModel
from nodes.rollout import Rollout
from nodes.vision import TINY_OPEN_CLIP_CFG, VisionEncoder, tiny_vision_encoder


def _modules(value: Any, seen: set[int] | None = None) -> list[str]:
    """Where ``value`` (a node's __dict__, recursively) holds torch modules or optimizers."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, nn.Module | torch.optim.Optimizer):
        return [type(value).__name__]
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list | tuple)
        else ()
    )
    return [f"{k}: {found}" for k, v in items for found in _modules(v, seen)]


@pytest.mark.parametrize("module", [mm_ppo, mm_grpo], ids=["mm_ppo", "mm_grpo"])
def test_a_declared_graph_holds_no_model_until_setup(module):
    g = module.build_graph(batch_size=4)
    held = {name: _modules(vars(n)) for name, n in g.nodes.items()}
    assert all(not found for found in held.values()), held
    for n in g.nodes.values():
        n.setup()
    built = {name for name, n in g.nodes.items() if _modules(vars(n))}
    assert {"vision", "rollout", "reference"} <= built  # the walk does find modules


def _weights(g) -> dict[str, torch.Tensor]:
    out = {}
    for name, n in g.nodes.items():
        for attr in ("policy", "tower", "value_model"):
            module = n.__dict__.get(attr)
            if isinstance(module, nn.Module):
                for key, value in module.state_dict().items():
                    out[f"{name}.{attr}.{key}"] = value
    return out


@pytest.mark.parametrize("module", [mm_ppo, mm_grpo], ids=["mm_ppo", "mm_grpo"])
def test_builds_give_the_same_weights_in_any_order(module):
    first, second = module.build_graph(batch_size=4), module.build_graph(batch_size=4)
    torch.manual_seed(1)
    for n in first.nodes.values():
        n.setup()
        torch.rand(5)  # whatever a build leaves in the global generator must not matter
    torch.manual_seed(2)
    for n in reversed(list(second.nodes.values())):
        n.setup()
        torch.rand(3)
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys() and len(a) > 50
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    # the same policy spec in the rollout, the reference and the update: one initial policy
    trained = "ppo" if module is mm_ppo else "grpo"
    for key, value in first.nodes["rollout"].policy.state_dict().items():
        assert torch.equal(value, a[f"reference.policy.{key}"])
        assert torch.equal(value, a[f"{trained}.policy.{key}"])


def test_a_build_leaves_the_global_generator_alone():
    node = Rollout(policy={"name": "tiny-prefix-vlm", "seed": 3})
    torch.manual_seed(0)
    state = torch.get_rng_state()
    node.setup()
    assert torch.equal(torch.get_rng_state(), state)


def test_the_encoder_declares_its_dims_from_the_config_without_building():
    tiny = tiny_vision_encoder()
    assert tiny.embed_dim == 32 and tiny.image_size == (32, 32)
    assert "tower" not in vars(tiny)
    assert tiny.tower.output_dim == tiny.embed_dim  # and the built tower agrees
    wide = VisionEncoder("ViT-S-32", model_cfg={**TINY_OPEN_CLIP_CFG, "embed_dim": 48})
    assert wide.embed_dim == 48 and not _modules(vars(wide))


def test_setup_twice_keeps_the_built_models():
    node = ReferenceLogprobs(policy={"name": "tiny-prefix-vlm", "seed": 1})
    node.setup()
    policy = node.policy
    node.setup()
    assert node.policy is policy


def test_bad_options_still_fail_at_construction():
    with pytest.raises(ValueError, match="unknown name 'tiny-gpt9'"):
        Rollout(policy={"name": "tiny-gpt9"})
    with pytest.raises(ValueError, match=r"takes no key\(s\) \['layers'\]; valid keys"):
        ReferenceLogprobs(policy={"name": "tiny-prefix-vlm", "layers": 3})
    with pytest.raises(ValueError, match="not a local directory"):
        Rollout(policy="/no/such/dir")
    with pytest.raises(ValueError, match="unknown open_clip model"):
        VisionEncoder("ViT-Nope")


# --- bad files: one ValueError line naming the file ------------------------------------------


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_a_garbage_vision_weights_file_names_the_file(tmp_path):
    weights = tmp_path / "vit.safetensors"
    weights.write_bytes(b"this is not a checkpoint")
    node = VisionEncoder("ViT-S-32", pretrained=str(weights), model_cfg=TINY_OPEN_CLIP_CFG)
    with pytest.raises(ValueError) as exc:
        node.setup()
    assert str(weights) in _one_line(exc) and "could not be loaded" in str(exc.value)
    clip = ClipScoreReward("ViT-S-32", str(weights), model_overrides=TINY_OPEN_CLIP_CFG)
    with pytest.raises(ValueError, match="could not be loaded") as exc:
        clip.setup()
    assert str(weights) in _one_line(exc)


def test_the_vision_option_of_a_ready_graph_fails_at_setup_naming_the_file(tmp_path):
    weights = tmp_path / "garbage.bin"
    weights.write_bytes(b"\x00\x01garbage")
    g = mm_ppo.build_graph(batch_size=4, vision=f"open_clip:ViT-S-32:{weights}")
    with pytest.raises(ValueError) as exc:
        g.nodes["vision"].setup()
    assert str(weights) in _one_line(exc)


@pytest.fixture(scope="module")
def saved_policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    tiny_prefix_vlm(seed=0).save_pretrained(path)
    return path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_saved_policy_dir_loads(saved_policy):
    node = Rollout(policy=str(saved_policy))
    assert not _modules(vars(node))
    assert torch.equal(node.policy.projector.weight, tiny_prefix_vlm(seed=0).projector.weight)


def test_a_truncated_model_safetensors_names_the_file(saved_policy, tmp_path):
    path = _copy(saved_policy, tmp_path / "p")
    weights = path / "lm" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError) as exc:
        Rollout(policy=str(path)).setup()
    assert str(weights) in _one_line(exc) and "truncated or corrupt" in str(exc.value)


def test_a_corrupt_config_json_names_the_file(saved_policy, tmp_path):
    path = _copy(saved_policy, tmp_path / "p")
    (path / "lm" / "config.json").write_text('{"model_type": "gpt2", ')
    with pytest.raises(ValueError) as exc:
        ReferenceLogprobs(policy=str(path)).setup()
    assert str(path / "lm" / "config.json") in _one_line(exc) and "not valid JSON" in str(exc.value)


@pytest.mark.parametrize(
    "text, why",
    [("{not json", "not valid JSON"), ('{"image_dim": 32}', "integer 'num_prefix_tokens'")],
)
def test_a_bad_prefix_vlm_json_names_the_file(saved_policy, tmp_path, text, why):
    path = _copy(saved_policy, tmp_path / "p")
    (path / "prefix_vlm.json").write_text(text)
    with pytest.raises(ValueError, match=why) as exc:
        Rollout(policy=str(path)).setup()
    assert str(path / "prefix_vlm.json") in _one_line(exc)


def test_an_empty_policy_folder_says_config_json_is_missing(tmp_path):
    # declaring reads the folder's config.json (its model family), never its weights
    with pytest.raises(ValueError, match="has no config.json") as exc:
        mm_ppo.build_graph(batch_size=4, policy=str(tmp_path))
    assert str(tmp_path) in _one_line(exc)


def test_a_reward_model_dir_without_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a JSON object") as exc:
        RewardModel(str(tmp_path)).setup()
    assert str(tmp_path / "config.json") in _one_line(exc)
