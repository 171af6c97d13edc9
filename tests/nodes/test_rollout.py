"""Rollout node: sampling, logprobs vs teacher-forced recomputation, stops, groups, seeds."""

from __future__ import annotations

import logging

import pytest
import torch
from PIL import Image

from nodes.models.policy import tiny_prefix_vlm, tiny_qwen2_vl
from nodes.rollout import Rollout, vllm_unavailable_reason

PROMPTS = ["hi", "what colour is it?", "x"]
# Cached generation vs a teacher-forced forward, float32 on CPU: observed max |diff| ~5e-7.
ATOL = 1e-4


@pytest.fixture(scope="module")
def policy():
    return tiny_prefix_vlm(seed=0)


@pytest.fixture(scope="module")
def embeds():
    return torch.randn(3, 32, generator=torch.Generator().manual_seed(0))


def _recompute(node, out, embeds=None, images=None, temperature=1.0):
    batch = node.policy.prepare(
        out["prompt_ids"], out["prompt_mask"], image_embeds=embeds, images=images
    )
    with torch.no_grad():
        return node.policy.response_logprobs(
            batch, out["response_ids"], out["response_mask"], temperature=temperature
        )


def _check_layout(node, out):
    """Masks, padding and lengths follow the data conventions."""
    ids, mask, lp, lengths = (
        out[k] for k in ("response_ids", "response_mask", "logprobs", "response_lengths")
    )
    R = ids.shape[1]
    assert mask.dtype == lp.dtype == torch.float32 and lengths.dtype == torch.int64
    assert int(lengths.max()) == R
    assert torch.equal(mask, (torch.arange(R)[None] < lengths[:, None]).float())
    pad = mask == 0
    assert (ids[pad] == node.policy.pad_token_id).all()
    assert (lp[pad] == 0).all() and (lp[~pad] < 0).all()
    assert len(out["texts"]) == ids.shape[0]


def test_logprobs_equal_teacher_forced(policy, embeds):
    node = Rollout(model=policy, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=0)
    out = node.run(prompts=PROMPTS, image_embeds=embeds)
    _check_layout(node, out)
    ref = _recompute(node, out, embeds)
    assert (out["logprobs"] - ref).abs().max() <= ATOL


def test_logprobs_are_temperature_scaled_untruncated(policy, embeds):
    sampling = {"max_new_tokens": 12, "temperature": 0.6, "top_p": 0.7, "top_k": 30, "seed": 1}
    node = Rollout(model=policy, **sampling)
    out = node.run(prompts=PROMPTS, image_embeds=embeds)
    assert (out["logprobs"] - _recompute(node, out, embeds, temperature=0.6)).abs().max() <= ATOL
    exact = Rollout(model=policy, recompute_logprobs=True, **sampling).run(
        prompts=PROMPTS, image_embeds=embeds
    )
    assert torch.equal(exact["response_ids"], out["response_ids"])
    assert (exact["logprobs"] - out["logprobs"]).abs().max() <= ATOL
    # the sampler's own logprobs travel beside the recomputed ones; without a recompute they
    # are the logprobs themselves
    assert torch.equal(exact["rollout_logprobs"], out["logprobs"])
    assert torch.equal(out["rollout_logprobs"], out["logprobs"])


def test_ragged_lengths(policy, embeds):
    # many stop tokens, so rows end at different places
    stops = policy.tokenizer.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
    node = Rollout(model=policy, n=4, max_new_tokens=16, stop_token_ids=stops, seed=3)
    out = node.run(prompts=PROMPTS, image_embeds=embeds)
    _check_layout(node, out)
    lengths = out["response_lengths"]
    assert len(set(lengths.tolist())) >= 3, lengths
    for row, n in zip(out["response_ids"], lengths.tolist()):
        if n < 16:  # ended by a stop token: it is the last real token, and the first stop
            assert int(row[n - 1]) in stops
            assert not set(row[: n - 1].tolist()) & set(stops)
    repeated = embeds.repeat_interleave(4, 0)  # (B, D): rows follow the rollout's grouping
    assert (out["logprobs"] - _recompute(node, out, repeated)).abs().max() <= ATOL


def test_stop_token_and_stop_string_end_responses(policy, embeds):
    greedy = Rollout(model=policy, max_new_tokens=10, temperature=0.0)
    free = greedy.run(prompts=PROMPTS[:1], image_embeds=embeds[:1])
    tokens = free["response_ids"][0].tolist()
    assert len(tokens) == 10  # no EOS within 10 greedy steps for this seed
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    out = Rollout(model=policy, max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id]).run(
        prompts=PROMPTS[:1], image_embeds=embeds[:1]
    )
    assert out["response_ids"][0].tolist() == tokens[: first + 1]
    assert int(out["response_lengths"][0]) == first + 1
    assert free["truncated"].tolist() == [1.0] and out["truncated"].tolist() == [0.0]

    text = free["texts"][0]
    stop = text[4:6]
    out = Rollout(model=policy, max_new_tokens=10, temperature=0.0, stop=[stop]).run(
        prompts=PROMPTS[:1], image_embeds=embeds[:1]
    )
    cut = text.index(stop) + len(stop)
    assert out["texts"][0] == text[:cut] and out["texts"][0].endswith(stop)
    assert out["truncated"].tolist() == [0.0]  # a stop string ends it too


def test_n_samples_are_grouped(policy, embeds):
    node = Rollout(model=policy, n=3, max_new_tokens=6, seed=0)
    out = node.run(prompts=PROMPTS[:2], image_embeds=embeds[:2])
    assert out["response_ids"].shape[0] == 6
    assert out["group_ids"].tolist() == [0, 0, 0, 1, 1, 1]
    ids = out["prompt_ids"]
    assert torch.equal(ids[0], ids[2]) and torch.equal(ids[3], ids[5])
    assert not torch.equal(ids[0], ids[3])
    assert len({tuple(r) for r in out["response_ids"][:3].tolist()}) > 1  # samples differ
    again = node.run(prompts=PROMPTS[:2], image_embeds=embeds[:2])
    assert again["group_ids"].tolist() == [2, 2, 2, 3, 3, 3]  # unique across calls


def test_seeded_per_step_determinism(policy, embeds):
    a, b = (
        Rollout(model=policy, max_new_tokens=8, seed=7),
        Rollout(model=policy, max_new_tokens=8, seed=7),
    )
    before = torch.random.get_rng_state()
    first_a, first_b = (
        a.run(prompts=PROMPTS, image_embeds=embeds),
        b.run(prompts=PROMPTS, image_embeds=embeds),
    )
    assert torch.equal(torch.random.get_rng_state(), before)  # global RNG untouched
    assert torch.equal(first_a["response_ids"], first_b["response_ids"])
    second = a.run(prompts=PROMPTS, image_embeds=embeds)
    assert not torch.equal(second["response_ids"][:, :4], first_a["response_ids"][:, :4])
    # resume: a fresh node given the saved step repeats the second call
    c = Rollout(model=policy, max_new_tokens=8, seed=7)
    c.load_state_dict({"step": 1, "next_group": 3})
    resumed = c.run(prompts=PROMPTS, image_embeds=embeds)
    assert torch.equal(resumed["response_ids"], second["response_ids"])
    assert torch.equal(resumed["group_ids"], second["group_ids"])
    assert a.state_dict() == {"step": 2, "next_group": 6, "weights_version": 0}
    # greedy ignores the seed
    g1 = Rollout(model=policy, max_new_tokens=6, temperature=0.0, seed=1).run(
        prompts=PROMPTS, image_embeds=embeds
    )
    g2 = Rollout(model=policy, max_new_tokens=6, temperature=0.0, seed=2).run(
        prompts=PROMPTS, image_embeds=embeds
    )
    assert torch.equal(g1["response_ids"], g2["response_ids"])


def test_weights_input_is_loaded_before_sampling(embeds):
    target = tiny_prefix_vlm(seed=4)
    synced = Rollout(model=tiny_prefix_vlm(seed=0), max_new_tokens=8, seed=0)
    out = synced.run(prompts=PROMPTS, image_embeds=embeds, weights=target.state_dict())
    expected = Rollout(model=target, max_new_tokens=8, seed=0).run(
        prompts=PROMPTS, image_embeds=embeds
    )
    assert torch.equal(out["response_ids"], expected["response_ids"])
    assert torch.allclose(out["logprobs"], expected["logprobs"])
    with pytest.raises(ValueError, match="input 'weights'.*not in this model"):
        synced.run(prompts=PROMPTS, image_embeds=embeds, weights={"bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="input 'weights'.*cannot read weights from a str"):
        synced.run(prompts=PROMPTS, image_embeds=embeds, weights="latest")


def test_published_weights_are_versioned(embeds):
    from runtime.codec import decode_value, encode_value
    from yatt_graph import WeightUpdate

    def published(model, version):
        return WeightUpdate({k: v.clone() for k, v in model.state_dict().items()}, version)

    def ship(update, mode):
        if mode == "local":
            return update
        return decode_value([bytes(memoryview(f).cast("B")) for f in encode_value(update)])

    target, stale = tiny_prefix_vlm(seed=4), tiny_prefix_vlm(seed=6)
    expected = Rollout(model=target, max_new_tokens=8, seed=0).run(
        prompts=PROMPTS, image_embeds=embeds
    )
    for mode in ("local", "across the codec"):
        node = Rollout(model=tiny_prefix_vlm(seed=0), max_new_tokens=8, seed=0)
        v1 = ship(published(target, 1), mode)
        out = node.run(prompts=PROMPTS, image_embeds=embeds, weights=v1)
        assert torch.equal(out["response_ids"], expected["response_ids"]), mode
        assert node.weights_version == 1
        # resumed at version 2: version 2 arriving again is skipped, version 3 is loaded
        v2 = ship(published(stale, 2), mode)
        node.load_state_dict({"step": 0, "next_group": 0, "weights_version": 2})
        again = node.run(prompts=PROMPTS, image_embeds=embeds, weights=v2)
        assert torch.equal(again["response_ids"], expected["response_ids"]), mode
        v3 = ship(published(stale, 3), mode)
        node.load_state_dict({"step": 0, "next_group": 0, "weights_version": 2})
        newer = node.run(prompts=PROMPTS, image_embeds=embeds, weights=v3)
        assert node.weights_version == 3
        assert not torch.equal(newer["logprobs"], expected["logprobs"]), mode


def test_text_only_prompts(policy):
    node = Rollout(model=policy, max_new_tokens=6)
    out = node.run(prompts=PROMPTS)
    assert (out["logprobs"] - _recompute(node, out)).abs().max() <= ATOL


def test_qwen2_vl_with_images():
    images = [Image.new("RGB", (32, 32), (200, 10, 10)), Image.new("RGB", (24, 40), (10, 200, 10))]
    node = Rollout(policy="tiny-qwen2-vl", n=2, max_new_tokens=10, seed=0)
    out = node.run(prompts=PROMPTS[:2], images=images)
    _check_layout(node, out)
    assert out["group_ids"].tolist() == [0, 0, 1, 1]
    repeated = [im for im in images for _ in range(2)]
    assert (out["logprobs"] - _recompute(node, out, images=repeated)).abs().max() <= ATOL
    with pytest.raises(ValueError, match="list of 2 images"):
        node.run(prompts=PROMPTS[:2], images=images[:1])
    with pytest.raises(ValueError, match="reads 'images', not 'image_embeds'"):
        node.run(prompts=PROMPTS[:2], image_embeds=torch.zeros(2, 32))


def test_bad_inputs_and_config(policy, embeds):
    node = Rollout(model=policy, max_new_tokens=4)
    with pytest.raises(ValueError, match="'rollout': input 'prompts' must be a non-empty list"):
        node.run(prompts="hello")
    with pytest.raises(
        ValueError, match=r"prompts\[1\]: a prompt is text or a list of chat messages.*got 3"
    ):
        node.run(prompts=["a", 3])
    with pytest.raises(ValueError, match="reads 'image_embeds'"):
        node.run(prompts=["a"], images=[Image.new("RGB", (8, 8))])
    with pytest.raises(ValueError, match="2 rows for 3 prompts"):
        node.run(prompts=PROMPTS, image_embeds=embeds[:2])
    with pytest.raises(ValueError, match="backend='tgi'"):
        Rollout(model=policy, backend="tgi")
    with pytest.raises(ValueError, match="top_p=0"):
        Rollout(model=policy, top_p=0)
    with pytest.raises(ValueError, match="list of strings"):
        Rollout(model=policy, stop="\n")
    for t in (1e-30, 0.009, float("inf"), float("nan"), -1.0):  # logits / T would overflow
        with pytest.raises(ValueError, match=f"temperature={t}; it must be 0 .greedy. or a fini"):
            Rollout(model=policy, temperature=t)
    Rollout(model=policy, temperature=0.01)
    from nodes.reference import ReferenceLogprobs

    with pytest.raises(ValueError, match="temperature=0; it must be a finite number >= 0.01"):
        ReferenceLogprobs(model=policy, temperature=0)


def test_config_rebuilds_the_node(embeds):
    node = Rollout(policy={"name": "tiny-prefix-vlm", "seed": 2}, max_new_tokens=5, seed=9)
    twin = type(node)(**node.config())
    a, b = (
        node.run(prompts=PROMPTS, image_embeds=embeds),
        twin.run(prompts=PROMPTS, image_embeds=embeds),
    )
    assert torch.equal(a["response_ids"], b["response_ids"])


@pytest.mark.skipif(vllm_unavailable_reason() is None, reason="vllm and CUDA are present")
def test_vllm_backend_refused_with_reason(policy):
    with pytest.raises(ValueError, match="backend='vllm' is unavailable: vllm"):
        Rollout(model=policy, backend="vllm")


@pytest.mark.gpu
@pytest.mark.skipif(
    vllm_unavailable_reason() is not None,
    reason=f"vllm backend unavailable: {vllm_unavailable_reason()}",
)
def test_vllm_backend_samples_and_logprobs_match(tmp_path):
    tiny_qwen2_vl(seed=0).save_pretrained(tmp_path / "ckpt")
    node = Rollout(policy=str(tmp_path / "ckpt"), backend="vllm", max_new_tokens=8, device="cuda")
    images = [Image.new("RGB", (32, 32), (200, 10, 10))]
    out = node.run(prompts=PROMPTS[:1], images=images)
    _check_layout(node, out)
    assert (out["logprobs"].cuda() - _recompute(node, out, images=images)).abs().max() <= 1e-3


def test_an_empty_prompt_is_answered_from_the_image_prefix_alone():
    rollout = Rollout(max_new_tokens=3, seed=0, name="rollout")
    out = rollout.run(prompts=["", "what color ?"], image_embeds=torch.randn(2, 32))
    assert len(out["texts"]) == 2
    assert out["response_lengths"].tolist()[0] >= 1 and out["prompt_mask"][0].sum() == 0


def _mask_warnings(policy, stream: bool) -> list[str]:
    """transformers' messages about a missing attention mask while a rollout of equal-length
    prompts runs (an all-ones prompt mask; rows that stop early, which generate then pads)."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # it warns once per process otherwise
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("transformers.modeling_utils")
    handler = Catch()
    logger.addHandler(handler)
    try:
        embeds = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
        rollout = Rollout(
            model=policy,
            max_new_tokens=12,
            seed=1,
            stop_token_ids=list(range(3, 40)),
            stream=stream,
        )
        inputs = {"prompts": ["same"] * 4, "image_embeds": embeds}
        out = list(rollout.run_stream(**inputs)) if stream else rollout.run(**inputs)
        assert out
    finally:
        logger.removeHandler(handler)
    return [s for s in seen if "attention_mask" in s]


@pytest.mark.parametrize("stream", [False, True])
def test_no_false_attention_mask_warning(policy, stream):
    """transformers warns that input_ids 'may be padded' inside our generate, where the mask
    was passed (it leaves an all-ones mask out, then sees the pad id of finished rows); the
    rollout's filter drops that warning there."""
    from nodes.models import sampling

    assert _mask_warnings(policy, stream) == []
    logger = logging.getLogger("transformers.modeling_utils")
    (flt,) = [f for f in logger.filters if isinstance(f, sampling._DroppedMaskWarning)]
    logger.removeFilter(flt)
    try:  # the same run without the filter does warn: the check above can fail
        assert len(_mask_warnings(policy, stream)) == 1
    finally:
        logger.addFilter(flt)


def test_weights_that_diverged_are_named_when_the_rollout_cannot_sample():
    """A learning rate far too high leaves finite but huge weights; sampling then meets
    non-finite probabilities, and the error says whose weights they are."""
    from nodes.sync import WeightUpdate

    node = Rollout(n=1, max_new_tokens=2, seed=0)
    embeds = torch.zeros(2, 32)
    huge = {
        k: v * 1e30 if v.is_floating_point() else v for k, v in node.policy.state_dict().items()
    }
    with pytest.raises(
        ValueError, match=r"weights \(version 3, the newest the update sent\) have diverged"
    ):
        node.run(prompts=["a", "b"], image_embeds=embeds, weights=WeightUpdate(huge, 3))


def test_a_prompt_too_long_for_the_context_is_one_error_with_the_fixes(policy, embeds):
    from yatt_graph import UsageError

    node = Rollout(model=policy, max_new_tokens=8)
    room = policy.context_length - policy.num_prefix_tokens - 8  # text tokens beside the image
    fits = ["a" * room, "hi", "x"]  # a character per token
    node.run(prompts=fits, image_embeds=embeds)
    with pytest.raises(UsageError) as info:
        node.run(prompts=["b" * (room + 1), "hi", "x"], image_embeds=embeds)
    message = str(info.value)
    assert f"takes {room + 1 + policy.num_prefix_tokens} positions" in message
    assert f"the model takes {policy.context_length} (1 of 3 rows" in message
    assert f"--set max_prompt_tokens=N (N <= {room})" in message
    without_images = Rollout(model=policy, max_new_tokens=8)
    without_images.run(prompts=["c" * (room + 2), "hi"])  # no prefix: two more tokens fit


def test_max_prompt_tokens_keeps_the_end_of_a_longer_prompt(policy, embeds):
    keep = 5
    node = Rollout(model=policy, max_new_tokens=4, max_prompt_tokens=keep)
    prompts = ["0123456789", "hi", "what"]
    out = node.run(prompts=prompts, image_embeds=embeds)
    whole = policy.encode_prompts(prompts)
    assert out["prompt_ids"].shape[1] == keep
    assert out["prompt_ids"][0].tolist() == whole.prompt_ids[0, -keep:].tolist()  # "56789"
    assert out["prompt_mask"].sum(1).tolist() == [5, 2, 4]
    # what was sampled read the cut prompt: the teacher-forced logprobs agree
    assert (out["logprobs"] - _recompute(node, out, embeds)).abs().max() <= ATOL
    with pytest.raises(ValueError, match="max_prompt_tokens=0; each must be >= 1"):
        Rollout(model=policy, max_prompt_tokens=0)


def test_max_prompt_tokens_never_cuts_an_images_tokens():
    from yatt_graph import UsageError

    image = Image.new("RGB", (32, 32), (200, 10, 10))
    node = Rollout(policy="tiny-qwen2-vl", max_new_tokens=4, max_prompt_tokens=8)
    node.run(prompts=["ab"], images=[image])  # 8 tokens: the image's 6 and the text's 2
    with pytest.raises(UsageError, match="would cut its image's tokens"):
        node.run(prompts=["abcdefgh"], images=[image])


def test_stop_strings_work_with_a_word_level_tokenizer():
    """HF's own stop-string criterion scans the vocabulary and fails on word-level tokenizers
    ("substring not found"); the rollout's ends rows itself."""
    from graphs.common import policy_spec
    from graphs.config import TextGRPOConfig

    spec = policy_spec(TextGRPOConfig(), None)
    node = Rollout(policy=spec, n=8, max_new_tokens=8, stop=["."], temperature=2.0, seed=0)
    out = node.run(prompts=["what color is the shape ?"])
    for text, cut in zip(out["texts"], out["truncated"].tolist()):
        if "." in text:  # it ended at the stop string, which it keeps
            assert text.index(".") == len(text) - 1 and cut == 0.0, text


def test_a_precision_that_is_not_one_of_the_choices_is_refused_naming_the_node(policy):
    from nodes.models.sampling import generate
    from nodes.reference import Critic, ReferenceLogprobs

    for make, where in (
        (lambda: Rollout(model=policy, precision="fp8"), "node 'rollout'"),
        (lambda: ReferenceLogprobs(precision="fp8"), "node 'reference"),
        (lambda: Critic(precision="fp8"), "node 'critic"),
        (lambda: generate(policy, policy.encode_prompts(["a"]), precision="fp8"), "generate"),
    ):
        with pytest.raises(ValueError, match=rf"{where}.*precision='fp8'; choose one of no, bf16"):
            make()
