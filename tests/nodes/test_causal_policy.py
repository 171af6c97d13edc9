"""The text causal-LM family (tiny GPT-2 / Llama / Qwen2), spec options and LoRA."""

from __future__ import annotations

import pytest
import torch
from policy_helpers import PROMPTS, _ids, _logits, _perturb_adapters

from nodes.models.hf_causal import HFCausalPolicy, tiny_causal_lm
from nodes.models.policy import (
    PrefixVLM,
    build_policy,
    char_tokenizer,
    check_policy_spec,
    load_policy,
)
from yatt_graph import UsageError

ATOL = 1e-5  # cached generation vs teacher-forced forward, float32 on CPU (seen: ~5e-7)
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2"])
def causal(request):
    return build_policy({"name": f"tiny-{request.param}", "seed": 0})


def test_generate_matches_teacher_forced_logprobs(causal):
    batch = causal.encode_prompts(PROMPTS)
    assert (batch.prompt_mask[:, 0] == 0).any()  # left padding is exercised
    gen = causal.generate(batch, max_new_tokens=12, temperature=1.3, top_p=0.9)
    with torch.no_grad():
        tf = causal.response_logprobs(batch, gen.response_ids, gen.response_mask, 1.3)
    assert torch.allclose(tf, gen.logprobs, atol=ATOL)
    rebuilt = causal.prepare(batch.prompt_ids, batch.prompt_mask)
    with torch.no_grad():
        again = causal.response_logprobs(rebuilt, gen.response_ids, gen.response_mask, 1.3)
    assert torch.equal(again, tf)


def test_row_alone_equals_row_in_batch(causal):
    ids, mask = _ids(causal, ["ab", "cde", "f"])
    with torch.no_grad():
        full = causal.response_logprobs(causal.encode_prompts(PROMPTS), ids, mask)
        one = causal.response_logprobs(causal.encode_prompts(PROMPTS[2:]), ids[2:], mask[2:])
    assert torch.allclose(full[2:], one, atol=1e-5)


def test_text_only_and_spec_errors(causal):
    with pytest.raises(ValueError, match="reads text only"):
        causal.encode_prompts(["a"], image_embeds=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="reads text only"):
        causal.prepare(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), images=[None])
    with pytest.raises(ValueError, match=r"takes no key\(s\) \['colour'\]; valid keys: .*lora"):
        check_policy_spec({"name": "tiny-qwen2", "colour": 1})
    with pytest.raises(ValueError, match="dtype='float8'; choose one of float32, bfloat16"):
        check_policy_spec({"name": "tiny-llama", "dtype": "float8"})
    with pytest.raises(ValueError, match="lora r=0"):
        check_policy_spec({"name": "tiny-gpt2", "lora": {"r": 0}})
    with pytest.raises(ValueError, match=r"unknown lora key\(s\) \['rank'\]"):
        check_policy_spec({"name": "tiny-gpt2", "lora": {"rank": 4}})
    with pytest.raises(ValueError, match="arch='bert'"):
        tiny_causal_lm("bert")


def test_pad_token_defaults_to_eos_and_words():
    tok = char_tokenizer()
    tok.pad_token = None
    policy = HFCausalPolicy(tiny_causal_lm("gpt2").model, tok)
    assert policy.pad_token_id == policy.eos_token_id
    assert policy.tokenizer.padding_side == "left"
    worded = build_policy({"name": "tiny-qwen2", "seed": 0, "words": ["red", "blue"]})
    assert worded.encode_prompts(["red blue"]).prompt_ids.tolist() == [[3, 4]]


def test_same_spec_same_weights_other_seed_differs():
    a = build_policy({"name": "tiny-llama", "seed": 3})
    b = build_policy({"name": "tiny-llama", "seed": 3})
    c = build_policy({"name": "tiny-llama", "seed": 4})
    key = "model.model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[key], b.state_dict()[key])
    assert not torch.equal(a.state_dict()[key], c.state_dict()[key])


def test_bfloat16_spec_builds_and_generates(tmp_path):
    policy = build_policy({"name": "tiny-qwen2", "dtype": "bfloat16"})
    assert next(policy.parameters()).dtype == torch.bfloat16
    policy.save_pretrained(tmp_path / "lm")
    loaded = build_policy({"path": str(tmp_path / "lm"), "dtype": "bfloat16"})
    assert next(loaded.parameters()).dtype == torch.bfloat16
    gen = loaded.generate(loaded.encode_prompts(PROMPTS), max_new_tokens=4)
    assert gen.response_ids.shape[0] == 3 and torch.isfinite(gen.logprobs).all()


def test_chat_template_on_and_off_changes_prompt_ids(tmp_path):
    policy = tiny_causal_lm("qwen2")
    policy.tokenizer.chat_template = (
        "{% for m in messages %}U:{{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    policy.save_pretrained(tmp_path / "lm")
    on = build_policy({"path": str(tmp_path / "lm")})
    off = build_policy({"path": str(tmp_path / "lm"), "chat_template": False})
    ids_on = on.encode_prompts(["hi"]).prompt_ids[0].tolist()
    ids_off = off.encode_prompts(["hi"]).prompt_ids[0].tolist()
    assert on.tokenizer.decode(ids_on) == "U:hi;A:"
    assert ids_off == on.tokenizer("hi").input_ids


def test_lora_trains_only_adapters_and_disables_to_base():
    base = build_policy({"name": "tiny-qwen2", "seed": 0})
    spec = {"name": "tiny-qwen2", "seed": 0, "lora": LORA}
    policy = build_policy(spec)
    assert policy.has_lora and not base.has_lora
    trainable = {n: p.numel() for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # q,k,v,o,gate,up,down per layer, 2 layers, each r * (in + out)
    h, i, kv, r = 64, 128, 32, 4
    per_layer = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3)
    assert sum(trainable.values()) == 2 * per_layer
    _perturb_adapters(policy)
    with policy.adapter_disabled() as frozen:
        assert torch.equal(_logits(frozen), _logits(base))
    assert not torch.allclose(_logits(policy), _logits(base))
    other = build_policy(spec)
    assert list(other.state_dict()) == list(policy.state_dict())
    other.load_weights(policy.state_dict(), strict=True)
    assert torch.equal(_logits(other), _logits(policy))
    with pytest.raises(ValueError, match="has no LoRA adapters"), base.adapter_disabled():
        pass


def test_gradient_checkpointing_backward_with_and_without_lora():
    for extra in ({}, {"lora": LORA}):
        policy = build_policy({"name": "tiny-llama", "gradient_checkpointing": True, **extra})
        assert policy.model.is_gradient_checkpointing
        policy.train()
        ids, mask = _ids(policy, ["abc", "de", "f"])
        lp = policy.response_logprobs(policy.encode_prompts(PROMPTS), ids, mask)
        lp.sum().backward()
        grads = [p.grad for p in policy.parameters() if p.requires_grad]
        assert grads and all(g is not None for g in grads)


def test_causal_lm_dir_with_image_dim_is_a_prefix_vlm(tmp_path):
    tiny_causal_lm("llama").save_pretrained(tmp_path / "lm")
    spec = {"path": str(tmp_path / "lm"), "image_dim": 16, "seed": 2}
    policy = build_policy({**spec, "num_prefix_tokens": 2})
    assert isinstance(policy, PrefixVLM) and policy.num_prefix_tokens == 2
    again = load_policy(tmp_path / "lm", image_dim=16, num_prefix_tokens=2, seed=2)
    assert torch.equal(policy.projector.weight, again.projector.weight)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(3, 16, generator=g)
    batch = policy.encode_prompts(PROMPTS, image_embeds=embeds)
    gen = policy.generate(batch, max_new_tokens=6)
    ids, mask = gen.response_ids, gen.response_mask
    with torch.no_grad():
        out = policy.forward_response(batch, ids, mask, hidden=True)
        tf = policy.response_logprobs(batch, ids, mask)
        other = policy.forward_logits(
            policy.prepare(batch.prompt_ids, batch.prompt_mask), ids, mask
        )
    assert out.logits.shape[:2] == ids.shape and out.hidden.shape[-1] == policy.hidden_size
    assert torch.allclose(tf, gen.logprobs, atol=ATOL)
    assert not torch.allclose(out.logits, other)  # the images are read


def test_gradient_checkpointing_gives_the_same_grads_and_a_step_trains():
    def loss_and_grads(policy):
        policy.train()
        ids, mask = _ids(policy, ["abc", "de", "f"])
        lp = policy.response_logprobs(policy.encode_prompts(PROMPTS), ids, mask)  # (B, R)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        return loss, {n: p.grad.clone() for n, p in policy.named_parameters()}

    plain = build_policy({"name": "tiny-qwen2", "seed": 5})
    checkpointed = build_policy({"name": "tiny-qwen2", "seed": 5, "gradient_checkpointing": True})
    assert checkpointed.model.is_gradient_checkpointing
    assert not plain.model.is_gradient_checkpointing
    loss, grads = loss_and_grads(plain)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed)
    assert torch.allclose(loss, loss_ckpt, atol=1e-6)
    assert grads.keys() == grads_ckpt.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, grads_ckpt[name], atol=1e-6), name
    before = {n: p.detach().clone() for n, p in checkpointed.named_parameters()}
    torch.optim.SGD(checkpointed.parameters(), lr=0.1).step()
    changed = [n for n, p in checkpointed.named_parameters() if not torch.equal(p, before[n])]
    assert "model.model.layers.0.self_attn.q_proj.weight" in changed


TEMPLATE = (
    "{% for m in messages %}U:{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def test_chat_template_strings_from_builder_and_spec(tmp_path):
    built = tiny_causal_lm("llama", chat_template=TEMPLATE)
    from_spec = build_policy({"name": "tiny-llama", "chat_template": TEMPLATE})
    for policy in (built, from_spec):
        ids = policy.encode_prompts(["hi"]).prompt_ids[0].tolist()
        assert policy.tokenizer.decode(ids) == "U:hi;A:"
    built.save_pretrained(tmp_path / "lm")  # the template is saved with the tokenizer
    loaded = load_policy(tmp_path / "lm")
    assert loaded.tokenizer.decode(loaded.encode_prompts(["hi"]).prompt_ids[0]) == "U:hi;A:"
    other = "{% for m in messages %}Q={{ m['content'] }}{% endfor %}"
    override = load_policy(tmp_path / "lm", chat_template=other)
    assert override.tokenizer.decode(override.encode_prompts(["hi"]).prompt_ids[0]) == "Q=hi"
    with pytest.raises(ValueError, match="chat_template=''; give true"):
        check_policy_spec({"name": "tiny-gpt2", "chat_template": ""})
    with pytest.raises(ValueError, match="chat_template=3; give true"):
        check_policy_spec({"path": str(tmp_path / "lm"), "chat_template": 3})
    with pytest.raises(ValueError, match="PrefixVLM: chat_template=True, but this family"):
        build_policy({"name": "tiny-prefix-vlm", "chat_template": True})
    with pytest.raises(ValueError, match="give a Jinja template string"):
        tiny_causal_lm("gpt2", chat_template=True)


def test_a_prompt_of_chat_messages_is_formatted_by_the_template():
    policy = tiny_causal_lm("llama", chat_template=TEMPLATE)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    got = policy.encode_prompts([chat, "q"])
    ids = [row[mask.bool()].tolist() for row, mask in zip(got.prompt_ids, got.prompt_mask)]
    want = [policy.tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("U:s;U:q;A:", "U:q;A:")]  # fmt: skip
    assert ids == want
    plain = tiny_causal_lm("llama")
    plain.use_chat_template = False
    with pytest.raises(UsageError, match="chat messages needs the policy's chat template"):
        plain.encode_prompts([chat])
