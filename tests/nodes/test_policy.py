"""The policy interface, on both families: tiny PrefixVLM (GPT-2) and tiny Qwen2-VL."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from nodes.models.policy import (
    HFVisionLanguagePolicy,
    Policy,
    PrefixVLM,
    build_policy,
    char_tokenizer,
    load_policy,
    tiny_prefix_vlm,
    tiny_qwen2_vl,
)

PROMPTS = ["hi", "what colour is it?", "x"]
ATOL = 1e-4  # cached generation vs teacher-forced forward, float32 on CPU (seen: ~5e-7)


def _ids(policy: Policy, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded response ids of ordinary characters and their mask."""
    rows = [policy.tokenizer(t).input_ids for t in texts]
    R = max(len(r) for r in rows)
    ids = torch.tensor([r + [policy.pad_token_id] * (R - len(r)) for r in rows])
    mask = (torch.arange(R)[None] < torch.tensor([[len(r)] for r in rows])).float()
    return ids, mask


def _images(n: int = 3) -> list[Image.Image]:
    colours = [(220, 20, 20), (20, 200, 40), (30, 40, 210), (128, 128, 0)]
    sizes = [(32, 32), (24, 40), (64, 48), (32, 16)]
    return [Image.new("RGB", sizes[i], colours[i]) for i in range(n)]


@pytest.fixture(scope="module")
def prefix() -> PrefixVLM:
    return tiny_prefix_vlm(seed=0)


@pytest.fixture(scope="module")
def qwen() -> HFVisionLanguagePolicy:
    return tiny_qwen2_vl(seed=0)


@pytest.fixture(params=["prefix", "qwen"])
def family(request, prefix, qwen):
    """(policy, image kwargs for 3 prompts, other image kwargs) for each family."""
    if request.param == "prefix":
        g = torch.Generator().manual_seed(0)
        return (
            prefix,
            {"image_embeds": torch.randn(3, 32, generator=g)},
            {"image_embeds": torch.randn(3, 32, generator=g)},
        )
    return qwen, {"images": _images()}, {"images": _images()[::-1]}


def test_char_tokenizer_roundtrip_and_specials():
    tok = char_tokenizer(["<x>"])
    text = "Hello, world! 42\n"
    ids = tok(text).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok("a<x>b").input_ids == [tok.convert_tokens_to_ids(t) for t in ["a", "<x>", "b"]]
    assert tok.padding_side == "left"


def test_encode_prompts_left_pads(family):
    policy, kw, _ = family
    batch = policy.encode_prompts(PROMPTS, **kw)
    ids, mask = batch.prompt_ids, batch.prompt_mask
    assert ids.dtype == mask.dtype == torch.int64 and ids.shape == mask.shape and len(batch) == 3
    lengths = mask.sum(1)
    assert lengths[1] == mask.shape[1] > lengths[2]  # the longest prompt fills the row
    for b in range(3):
        pad = mask.shape[1] - int(lengths[b])
        assert (mask[b, :pad] == 0).all() and (mask[b, pad:] == 1).all()
        assert (ids[b, :pad] == policy.pad_token_id).all()
    # prepare() rebuilds the same batch from the tensors on the rollout's ports
    again = policy.prepare(ids, mask, **kw)
    assert again.model_inputs.keys() == batch.model_inputs.keys()
    for key, value in batch.model_inputs.items():
        assert torch.equal(again.model_inputs[key], value), key


def test_generate_matches_teacher_forced_logprobs(family):
    policy, kw, _ = family
    batch = policy.encode_prompts(PROMPTS, **kw)
    torch.manual_seed(0)
    gen = policy.generate(batch, max_new_tokens=10, temperature=1.0, top_p=1.0)
    B, R = gen.response_ids.shape
    assert B == 3 and 1 <= R <= 10
    lp = policy.response_logprobs(batch, gen.response_ids, gen.response_mask)
    real = gen.response_mask > 0
    assert torch.allclose(lp, gen.logprobs, atol=ATOL, rtol=0)
    assert (lp[real] < 0).all() and (lp[~real] == 0).all()
    # temperature and top-p: logprobs are those of the temperature-scaled, untruncated policy
    gen = policy.generate(batch, max_new_tokens=10, temperature=0.7, top_p=0.8, top_k=20)
    lp = policy.response_logprobs(batch, gen.response_ids, gen.response_mask, temperature=0.7)
    assert torch.allclose(lp, gen.logprobs, atol=ATOL, rtol=0)


def test_teacher_forced_shapes_grad_and_padding(family):
    policy, kw, _ = family
    batch = policy.encode_prompts(PROMPTS, **kw)
    ids, mask = _ids(policy, ["abcd", "ef", "g"])
    logits = policy.forward_logits(batch, ids, mask)
    assert logits.shape == (3, 4, policy.vocab_size)
    hidden = policy.response_hidden_states(batch, ids, mask)
    assert hidden.shape == (3, 4, policy.hidden_size)
    lp = policy.response_logprobs(batch, ids, mask)
    assert lp.dtype == torch.float32 and (lp[mask == 0] == 0).all()
    lp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    policy.zero_grad(set_to_none=True)
    # what sits in padded response slots never changes the real tokens' logprobs
    junk = torch.where(mask > 0, ids, policy.tokenizer.convert_tokens_to_ids("z"))
    with torch.no_grad():
        assert torch.allclose(policy.response_logprobs(batch, junk, mask), lp.detach(), atol=1e-6)


def test_row_alone_equals_row_in_batch(family):
    """Left padding and prefix placement do not change a row's logprobs."""
    policy, kw, _ = family
    batch = policy.encode_prompts(PROMPTS, **kw)
    ids, mask = _ids(policy, ["abc", "def", "ghi"])
    with torch.no_grad():
        full = policy.response_logprobs(batch, ids, mask)
        one_kw = {k: v[2:3] for k, v in kw.items()}
        alone = policy.response_logprobs(
            policy.encode_prompts(PROMPTS[2:], **one_kw), ids[2:], mask[2:]
        )
    assert torch.allclose(alone, full[2:], atol=1e-5)


def test_image_inputs_change_logprobs(family):
    policy, kw, other = family
    ids, mask = _ids(policy, ["abc"] * 3)
    with torch.no_grad():
        a = policy.response_logprobs(policy.encode_prompts(PROMPTS, **kw), ids, mask)
        b = policy.response_logprobs(policy.encode_prompts(PROMPTS, **other), ids, mask)
    assert not torch.allclose(a, b, atol=1e-4)


def test_qwen_never_emits_image_placeholders(qwen):
    assert qwen.processor.image_token_id in qwen.suppressed_token_ids
    batch = qwen.encode_prompts(PROMPTS, images=_images())
    ids, mask = _ids(qwen, ["ab"] * 3)
    with torch.no_grad():
        logits = qwen.forward_logits(batch, ids, mask)
    assert torch.isneginf(logits[..., list(qwen.suppressed_token_ids)]).all()
    bad = ids.clone()
    bad[1, 1] = qwen.processor.image_token_id
    with pytest.raises(ValueError, match=r"response_ids\[1, 1\] .* placeholder"):
        qwen.forward_logits(batch, bad, mask)
    gen = qwen.generate(batch, max_new_tokens=20, temperature=1.5)
    assert not torch.isin(gen.response_ids, torch.tensor(qwen.suppressed_token_ids)).any()


def test_save_and_load_roundtrip(family, tmp_path):
    policy, kw, _ = family
    policy.save_pretrained(tmp_path / "ckpt")
    loaded = load_policy(tmp_path / "ckpt")
    assert type(loaded) is type(policy)
    ids, mask = _ids(policy, ["abc", "de", "f"])
    with torch.no_grad():
        a = policy.response_logprobs(policy.encode_prompts(PROMPTS, **kw), ids, mask)
        b = loaded.response_logprobs(loaded.encode_prompts(PROMPTS, **kw), ids, mask)
    assert torch.equal(a, b)
    assert build_policy({"path": str(tmp_path / "ckpt")}).hidden_size == policy.hidden_size


def test_build_policy_specs_and_seeds():
    a, b = build_policy("tiny-prefix-vlm"), build_policy({"name": "tiny-prefix-vlm", "seed": 0})
    c = build_policy({"name": "tiny-prefix-vlm", "seed": 1})
    key = "lm.transformer.h.0.attn.c_attn.weight"
    assert torch.equal(a.state_dict()[key], b.state_dict()[key])
    assert not torch.equal(a.state_dict()[key], c.state_dict()[key])
    built = build_policy({"builder": "nodes.models.policy:tiny_qwen2_vl", "seed": 2})
    assert isinstance(built, HFVisionLanguagePolicy) and isinstance(built, Policy)
    with pytest.raises(ValueError, match="unknown name 'tiny-gpt9'"):
        build_policy({"name": "tiny-gpt9"})
    with pytest.raises(ValueError, match="not a local directory"):
        build_policy("/no/such/model")
    with pytest.raises(ValueError, match="needs one of"):
        build_policy({"seed": 1})


def test_load_weights_checks_names_and_shapes(prefix):
    other = tiny_prefix_vlm(seed=5)
    part = {k: v for k, v in prefix.state_dict().items() if k.startswith("projector.")}
    other.load_weights(part)  # a partial sync
    assert torch.equal(other.projector.weight, prefix.projector.weight)
    with pytest.raises(ValueError, match="not in this model"):
        other.load_weights({"nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="expected shape"):
        other.load_weights({"projector.bias": torch.zeros(3)})


def test_bad_inputs_say_what(prefix, qwen):
    with pytest.raises(ValueError, match=r"image_embeds has shape \(3, 7\)"):
        prefix.encode_prompts(PROMPTS, image_embeds=torch.zeros(3, 7))
    with pytest.raises(ValueError, match="takes image_embeds"):
        prefix.encode_prompts(PROMPTS, images=_images())
    with pytest.raises(ValueError, match="2 images for 3 prompts"):
        qwen.encode_prompts(PROMPTS, images=_images(2))
    batch = prefix.encode_prompts(PROMPTS)
    with pytest.raises(ValueError, match="2 responses for 3 prompts"):
        prefix.forward_logits(batch, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        prefix.generate(batch, max_new_tokens=0)


def test_word_tokenizer_makes_one_answer_one_token():
    from nodes.models.policy import tiny_prefix_vlm, word_tokenizer

    tok = word_tokenizer(["what", "color", "?", "red", "blue"])
    ids = tok("what color ? red")["input_ids"]
    assert ids == [3, 4, 5, 6] and tok.decode([6], skip_special_tokens=True) == "red"
    assert tok("green")["input_ids"] == [tok.unk_token_id]
    with pytest.raises(ValueError, match="'two words' is not a single word"):
        word_tokenizer(["two words"])
    policy = tiny_prefix_vlm(words=["red", "blue"])
    assert policy.vocab_size == 5
