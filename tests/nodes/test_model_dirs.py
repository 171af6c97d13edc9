"""Model directories: which family each holds, loading them, clear errors, merged exports."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from policy_helpers import PROMPTS, _ids, _logits, _perturb_adapters

from nodes.models.families import model_family
from nodes.models.hf_causal import HFCausalPolicy, tiny_causal_lm
from nodes.models.policy import (
    HFVisionLanguagePolicy,
    PrefixVLM,
    build_policy,
    check_policy_spec,
    load_policy,
    tiny_prefix_vlm,
    tiny_qwen2_vl,
)

LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}


def _images():
    return [Image.new("RGB", (32, 32), c) for c in [(220, 20, 20), (20, 200, 40), (30, 40, 210)]]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_causal_dirs_load_generate_and_agree(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = tiny_causal_lm(arch, seed=1)
    policy.save_pretrained(tmp_path / arch)
    assert model_family(tmp_path / arch) == "causal-lm"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / arch).config.model_type == arch
    loaded = build_policy(str(tmp_path / arch))
    assert isinstance(loaded, HFCausalPolicy)
    assert torch.equal(_logits(loaded), _logits(policy))
    batch = loaded.encode_prompts(PROMPTS)
    gen = loaded.generate(batch, max_new_tokens=8, temperature=0.8)
    with torch.no_grad():
        tf = loaded.response_logprobs(batch, gen.response_ids, gen.response_mask, 0.8)
    assert torch.allclose(tf, gen.logprobs, atol=1e-5)


def test_loading_and_saving_show_no_progress_bar_and_leave_the_setting_as_it_was(tmp_path, capsys):
    """transformers' "Loading weights" and "Writing model shards" bars stay off while a
    model loads or saves (the run's own bar is the one to read), and a caller's setting, on
    or off, is as it was afterwards."""
    from transformers.utils import logging as hf_logging

    for shown in (True, False):
        (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
        try:
            tiny_causal_lm("llama", seed=0).save_pretrained(tmp_path / "lm")
            assert hf_logging.is_progress_bar_enabled() is shown
            build_policy(str(tmp_path / "lm")).save_pretrained(tmp_path / "again")
            tiny_prefix_vlm().save_pretrained(tmp_path / "prefix")
            build_policy(str(tmp_path / "prefix"))
            assert hf_logging.is_progress_bar_enabled() is shown
        finally:
            hf_logging.enable_progress_bar()
        out = capsys.readouterr()
        assert "it/s]" not in out.err + out.out, out.err


def test_saved_word_tokenizer_loads_back_exactly(tmp_path):
    # AutoTokenizer would give a qwen2 directory Qwen2's own tokenizer class
    for arch in ("qwen2", "llama"):
        policy = tiny_causal_lm(arch, words=["red", "blue"])
        policy.save_pretrained(tmp_path / arch)
        loaded = load_policy(tmp_path / arch)
        assert loaded.encode_prompts(["red blue"]).prompt_ids.tolist() == [[3, 4]]
        assert loaded.tokenizer.decode([3, 4]) == "red blue"


def test_vlm_and_prefix_dirs_are_told_apart(tmp_path):
    tiny_qwen2_vl().save_pretrained(tmp_path / "vlm")
    tiny_prefix_vlm().save_pretrained(tmp_path / "prefix")
    assert model_family(tmp_path / "vlm") == "vlm"
    assert model_family(tmp_path / "prefix") == "prefix-vlm"
    assert isinstance(load_policy(tmp_path / "vlm"), HFVisionLanguagePolicy)
    assert isinstance(load_policy(tmp_path / "prefix"), PrefixVLM)
    with pytest.raises(ValueError, match="own vision tower; it takes images, not image_dim"):
        load_policy(tmp_path / "vlm", image_dim=8)
    with pytest.raises(ValueError, match="saved with image_dim=32, not 8"):
        load_policy(tmp_path / "prefix", image_dim=8)


def test_unsupported_and_broken_dirs_say_what(tmp_path):
    from transformers import BertConfig

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    config.architectures = ["BertForMaskedLM"]
    config.save_pretrained(tmp_path / "bert")
    want = (
        r"holds a 'bert' model \(BertForMaskedLM\); yatt-graph loads causal LMs "
        r"\(AutoModelForCausalLM: gpt2, llama, qwen2, ...\), image-text-to-text VLMs"
    )
    with pytest.raises(ValueError, match=want):
        model_family(tmp_path / "bert")
    with pytest.raises(ValueError, match="'bert' model"):
        check_policy_spec({"path": str(tmp_path / "bert")})
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"has no config.json \(it holds \['notes.txt'\]\)"):
        load_policy(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        model_family(tmp_path / "bad")
    with pytest.raises(ValueError, match="not a local directory"):
        model_family(tmp_path / "nope")


def test_a_folder_without_its_tokenizer_or_with_another_models_is_refused(tmp_path):
    """transformers builds an empty tokenizer from the model type alone, and takes any
    tokenizer file: both failed inside generate with an IndexError."""
    import shutil

    from nodes.models.policy_base import word_tokenizer

    tiny_causal_lm("gpt2", seed=0).save_pretrained(tmp_path / "lm")
    rows = load_policy(tmp_path / "lm").model.get_input_embeddings().num_embeddings
    shutil.copytree(tmp_path / "lm", tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (tmp_path / "bare" / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"holds no tokenizer \(none of tokenizer.json"):
        load_policy(tmp_path / "bare")
    shutil.copytree(tmp_path / "lm", tmp_path / "other")
    word_tokenizer([f"w{i}" for i in range(rows + 10)]).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=rf"tokens and the model's embedding {rows} rows"):
        load_policy(tmp_path / "other")


def test_path_spec_keys_are_checked(tmp_path):
    tiny_causal_lm("gpt2").save_pretrained(tmp_path / "lm")
    path = str(tmp_path / "lm")
    with pytest.raises(ValueError, match=r"takes no key\(s\) \['words'\]; valid keys: .*image_dim"):
        check_policy_spec({"path": path, "words": ["a"]})
    with pytest.raises(ValueError, match="gradient_checkpointing='yes'; give true or false"):
        check_policy_spec({"path": path, "gradient_checkpointing": "yes"})
    with pytest.raises(ValueError, match="dtype='half'"):
        build_policy({"path": path, "dtype": "half"})
    check_policy_spec({"path": path, "dtype": "float16", "lora": LORA, "image_dim": 8, "seed": 1})


def test_causal_lora_export_is_merged_and_loads_with_auto_class(tmp_path):
    from transformers import AutoModelForCausalLM

    for arch in ("gpt2", "qwen2"):
        policy = build_policy({"name": f"tiny-{arch}", "lora": LORA})
        _perturb_adapters(policy)
        names = list(policy.state_dict())
        policy.save_pretrained(tmp_path / arch)
        assert policy.has_lora and list(policy.state_dict()) == names  # the live one is kept
        AutoModelForCausalLM.from_pretrained(tmp_path / arch)  # no peft needed
        loaded = load_policy(tmp_path / arch)
        assert not loaded.has_lora
        assert torch.allclose(_logits(loaded), _logits(policy), atol=1e-5)


def test_vlm_lora_export_is_merged_and_loads_with_auto_class(tmp_path):
    from transformers import AutoModelForImageTextToText

    policy = build_policy({"name": "tiny-qwen2-vl", "lora": LORA})
    assert policy.has_lora
    _perturb_adapters(policy)
    policy.save_pretrained(tmp_path / "vlm")
    AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm")
    loaded = load_policy(tmp_path / "vlm")
    kw = {"images": _images()}
    assert torch.allclose(_logits(loaded, **kw), _logits(policy, **kw), atol=1e-5)


def test_prefix_wrapped_lm_saves_as_prefix_vlm(tmp_path):
    tiny_causal_lm("qwen2").save_pretrained(tmp_path / "lm")
    policy = load_policy(tmp_path / "lm", image_dim=16, lora=LORA)
    assert policy.has_lora and policy.projector.weight.requires_grad
    _perturb_adapters(policy)
    policy.save_pretrained(tmp_path / "saved")
    meta = json.loads((tmp_path / "saved" / "prefix_vlm.json").read_text())
    assert meta == {"image_dim": 16, "num_prefix_tokens": 4}
    assert model_family(tmp_path / "saved") == "prefix-vlm"
    kw = {"image_embeds": torch.randn(3, 16, generator=torch.Generator().manual_seed(0))}
    loaded = load_policy(tmp_path / "saved")
    assert torch.allclose(_logits(loaded, **kw), _logits(policy, **kw), atol=1e-5)


def _unique_numel(module):
    return sum(p.numel() for p in module.parameters())  # tied weights count once


def _count(line):
    """The parameter count a describe_model_dir line states (e.g. '109K parameters')."""
    import re

    number, unit = re.search(r", ([\d.]+)([KMB]?) parameters", line).groups()
    return float(number) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[unit]


def test_describe_model_dir_states_family_type_and_size(tmp_path):
    from nodes.models.policy import describe_model_dir

    lm = tiny_causal_lm("gpt2")
    lm.save_pretrained(tmp_path / "lm")
    line = describe_model_dir(tmp_path / "lm")
    assert line.startswith("causal-lm gpt2 (GPT2LMHeadModel), ") and "(f32)" in line
    assert _count(line) == pytest.approx(_unique_numel(lm), rel=5e-3)
    vlm = tiny_qwen2_vl()
    vlm.save_pretrained(tmp_path / "vlm")
    line = describe_model_dir(tmp_path / "vlm")
    assert line.startswith("vlm qwen2_vl (Qwen2VLForConditionalGeneration), ")
    assert _count(line) == pytest.approx(_unique_numel(vlm), rel=5e-3)
    prefix = tiny_prefix_vlm()
    prefix.save_pretrained(tmp_path / "prefix")
    line = describe_model_dir(tmp_path / "prefix")
    assert line.startswith("prefix-vlm gpt2 (GPT2LMHeadModel) + projector 32 -> 2 tokens, ")
    assert _count(line) == pytest.approx(_unique_numel(prefix), rel=5e-3)
    build_policy({"name": "tiny-llama", "dtype": "bfloat16"}).save_pretrained(tmp_path / "bf")
    assert "(bf16)" in describe_model_dir(tmp_path / "bf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        describe_model_dir(tmp_path / "empty")


def test_a_type_in_both_mappings_is_a_vlm_only_with_a_vision_config(tmp_path):
    for name, config, family in [
        ("vision", {"model_type": "gemma3", "vision_config": {"hidden_size": 8}}, "vlm"),
        ("text", {"model_type": "gemma3"}, "causal-lm"),
        ("qwen2", {"model_type": "qwen2"}, "causal-lm"),
        ("qwen2_vl", {"model_type": "qwen2_vl"}, "vlm"),
        ("arch", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "causal-lm"),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert model_family(tmp_path / name) == family, name
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match=r"holds a 't5' model; yatt-graph loads causal LMs"):
        model_family(tmp_path / "odd")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_causal_export_round_trips_through_auto_classes(arch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = tiny_causal_lm(arch, seed=2, words=["red", "blue", "green"])
    policy.save_pretrained(tmp_path / arch)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / arch)
    assert tokenizer("red blue green").input_ids == policy.tokenizer("red blue green").input_ids
    again = HFCausalPolicy(AutoModelForCausalLM.from_pretrained(tmp_path / arch), tokenizer)
    ids, mask = _ids(policy, ["red", "green blue", "blue"])
    prompts = ["red blue", "green", "blue blue red"]
    with torch.no_grad():
        want = policy.forward_logits(policy.encode_prompts(prompts), ids, mask)
        got = again.forward_logits(again.encode_prompts(prompts), ids, mask)
    assert torch.equal(got, want)


def test_vlm_export_round_trips_through_auto_classes(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    policy = tiny_qwen2_vl(seed=3)
    policy.save_pretrained(tmp_path / "vlm")
    again = HFVisionLanguagePolicy(
        AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm"),
        AutoProcessor.from_pretrained(tmp_path / "vlm"),
    )
    kw = {"images": _images()}
    assert torch.equal(
        again.encode_prompts(PROMPTS, **kw).prompt_ids,
        policy.encode_prompts(PROMPTS, **kw).prompt_ids,
    )
    assert torch.equal(_logits(again, **kw), _logits(policy, **kw))


def test_vlm_honours_the_chat_template_flag(tmp_path):
    tiny_qwen2_vl().save_pretrained(tmp_path / "vlm")
    on = load_policy(tmp_path / "vlm")
    off = load_policy(tmp_path / "vlm", chat_template=False)
    kw = {"images": _images()[:1]}
    text_on = on.tokenizer.decode(on.encode_prompts(["hi"], **kw).prompt_ids[0])
    text_off = off.tokenizer.decode(off.encode_prompts(["hi"], **kw).prompt_ids[0])
    assert text_on.startswith("<|vision_start|><|image_pad|>") and text_on.endswith("hi")
    assert text_off.startswith("<|image_pad|>") and "<|vision_start|>" not in text_off
    named = build_policy({"name": "tiny-qwen2-vl", "chat_template": False})
    assert not named.use_chat_template
