"""PPOUpdate and GRPOUpdate on the tiny prefix-VLM: learning direction, micro-batching, weight
sync to Rollout/Critic, non-finite guards, resume, input errors."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch

from nodes.advantage import GroupAdvantage
from nodes.reference import Critic, ReferenceLogprobs
from nodes.rl.advantages import broadcast_to_tokens
from nodes.rollout import Rollout
from nodes.sync import WeightUpdate
from nodes.update import GRPOUpdate, PPOUpdate
from yatt_graph import NodeInputError

PROMPTS = ["hi", "what colour is it?", "x", "name the shape"]
N_SAMPLES = 4  # per prompt: B = 16
# A few epochs at lr 1e-3 move the mean token logprob of a response by ~0.4 nats (observed
# +0.41 / -0.51 for PPO, +0.45 / -0.51 for GRPO at 4 epochs); the tests ask for 0.1.
MARGIN = 0.1


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two
    threads per process made each update call 5-40x slower; restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def embeds():
    return torch.randn(len(PROMPTS), 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def batch(embeds):
    """Rollout outputs, +1 for even rows and -1 for odd rows (two of each per group), the
    critic's old values and the reference logprobs; image embeddings one per prompt."""
    out = Rollout(n=N_SAMPLES, max_new_tokens=8, seed=0).run(prompts=PROMPTS, image_embeds=embeds)
    B = out["response_ids"].shape[0]
    scores = torch.tensor([1.0, -1.0] * (B // 2))  # (B,)
    ports = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    values = Critic().run(ports, image_embeds=embeds)["values"]
    ref = ReferenceLogprobs().run(ports, image_embeds=embeds)["ref_logprobs"]
    return {
        **ports,
        "logprobs": out["logprobs"],
        "group_ids": out["group_ids"],
        "scores": scores,
        "values": values,
        "ref_logprobs": ref,
        "image_embeds": embeds,
    }


def _ppo_inputs(b, **over):
    adv = broadcast_to_tokens(b["scores"], b["response_mask"])  # (B, R)
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs", "values")
    return {**{k: b[k] for k in keys}, "advantages": adv, "returns": adv, **over}


def _grpo_inputs(b, advantages, **over):
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs")
    return {**{k: b[k] for k in keys}, "advantages": advantages, **over}


def _seq_logprob(policy, b):
    """Mean token logprob of each response under ``policy`` (teacher-forced): (B,)."""
    pb = policy.prepare(
        b["prompt_ids"], b["prompt_mask"], image_embeds=b["image_embeds"].repeat_interleave(4, 0)
    )
    mask = b["response_mask"]
    with torch.no_grad():
        lp = policy.response_logprobs(pb, b["response_ids"], mask)  # (B, R)
    return lp.sum(1) / mask.sum(1)


def _params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same_params(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- learning direction ---------------------------------------------------------------------


def test_ppo_raises_rewarded_and_lowers_penalized(batch):
    node = PPOUpdate(lr=1e-3, epochs=4)
    assert node.kind == "update"
    before = _seq_logprob(node.policy, batch)
    # the update's copy starts as the rollout's policy: old logprobs are reproduced
    old = batch["logprobs"].sum(1) / batch["response_mask"].sum(1)
    assert torch.allclose(before, old, atol=1e-4)
    out = node.run(_ppo_inputs(batch, image_embeds=batch["image_embeds"]))
    change = _seq_logprob(node.policy, batch) - before  # (B,)
    up, down = batch["scores"] > 0, batch["scores"] < 0
    assert change[up].mean() > MARGIN, change
    assert change[down].mean() < -MARGIN, change
    m = out["metrics"]
    expected = {"loss", "pg_loss", "vf_loss", "entropy", "clip_fraction", "approx_kl"}
    expected |= {"grad_norm", "critic_grad_norm", "value_clip_fraction", "lr", "critic_lr"}
    assert set(m) == expected | {"skipped_nonfinite"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
    assert m["skipped_nonfinite"] == 0.0 and m["lr"] == 1e-3 and m["approx_kl"] > 0
    assert isinstance(out["weights"], WeightUpdate) and out["weights"].version == 1
    assert out["critic_weights"].version == 1


def test_grpo_raises_rewarded_and_lowers_penalized(batch):
    adv = GroupAdvantage().run(
        scores=batch["scores"], group_ids=batch["group_ids"], response_mask=batch["response_mask"]
    )["advantages"]
    node = GRPOUpdate(lr=1e-3, epochs=4)
    before = _seq_logprob(node.policy, batch)
    out = node.run(_grpo_inputs(batch, adv, image_embeds=batch["image_embeds"]))
    change = _seq_logprob(node.policy, batch) - before
    assert change[batch["scores"] > 0].mean() > MARGIN, change
    assert change[batch["scores"] < 0].mean() < -MARGIN, change
    assert set(out) == {"weights", "metrics"} and out["weights"].version == 1
    assert "kl_ref" not in out["metrics"] and out["metrics"]["skipped_nonfinite"] == 0.0


# --- micro-batching -------------------------------------------------------------------------

# Accumulated micro-batch gradients vs one full-batch gradient, float32 on CPU: observed max
# |diff| 5e-8 (policy) and 5e-7 (value model, gradients up to ~2). Adam's first step moves a
# weight by lr * g / (|g| + eps), eps = 1e-8, so where a gradient is itself ~1e-8 the step turns
# rounding into a sizeable difference (a gradient of 5.7e-9 vs 7.9e-9 moved one weight by 3.6e-5
# vs 4.4e-5 at lr 1e-4, on one machine). Parameters are therefore compared where the full-batch
# gradient is above GRAD_ATOL (where the gradients are equal in the relative sense too), at 5% of
# lr; the step moves them by up to lr, and the test checks that it did.
LR = 1e-4
GRAD_ATOL, GRAD_RTOL, PARAM_ATOL = 1e-6, 1e-4, 0.05 * LR


def _record_grads(node):
    """Sum each parameter's gradient over all backward passes of ``node`` (the accumulated
    gradient of a step, before clipping; the node frees ``.grad`` after stepping)."""
    grads = {}
    for model in ("policy", "value_model"):
        for name, p in getattr(node, model, torch.nn.Module()).named_parameters():
            key = f"{model}.{name}"

            def add(g, key=key):
                grads[key] = grads[key] + g if key in grads else g.clone()

            p.register_hook(add)
    return grads


def _assert_same_step(full, split, inputs, models=("policy", "value_model")):
    """One call of ``full`` and of ``split`` on ``inputs`` takes the same step: equal
    accumulated gradients, equal weights where the gradient is clear of Adam's eps (see the
    note above LR), a step of ~lr, equal metrics."""
    initial = {m: _params(getattr(full, m)) for m in models}
    g_full, g_split = _record_grads(full), _record_grads(split)
    m_full, m_split = full.run(inputs)["metrics"], split.run(inputs)["metrics"]
    assert g_full.keys() == g_split.keys() and len(g_full) > 20
    for name in g_full:
        assert torch.allclose(g_full[name], g_split[name], atol=GRAD_ATOL, rtol=GRAD_RTOL), name
    for model in models:
        p_full, p_split = _params(getattr(full, model)), _params(getattr(split, model))
        trained = [n for n, _ in getattr(full, model).named_parameters()]  # no tied aliases
        compared = 0
        for name in trained:
            clear = g_full[f"{model}.{name}"].abs() > GRAD_ATOL
            compared += int(clear.sum())
            assert torch.allclose(p_full[name][clear], p_split[name][clear], atol=PARAM_ATOL), name
        assert compared > 0.5 * sum(p_full[n].numel() for n in trained)  # most weights compared
        moved = max((p_full[k] - initial[model][k]).abs().max() for k in p_full)
        assert moved > 0.9 * LR  # the step did move the parameters, by ~lr
    for key in m_full:
        assert m_split[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-6), key
    return g_full


@pytest.mark.parametrize("micro", [3, 5])
def test_ppo_micro_batches_equal_full_batch(batch, micro):
    kw = {"lr": LR, "kl_coef": 0.1, "entropy_coef": 0.01, "max_grad_norm": 0}
    # per-row embeddings: micro-batches of 3 or 5 rows, the last one ragged
    inputs = _ppo_inputs(
        batch,
        ref_logprobs=batch["ref_logprobs"] + 0.05,
        image_embeds=batch["image_embeds"].repeat_interleave(4, 0),
    )
    grads = _assert_same_step(PPOUpdate(**kw), PPOUpdate(micro_batch_size=micro, **kw), inputs)
    assert any(k.startswith("value_model.trunk") for k in grads)


def test_grpo_micro_batches_equal_full_batch_seq_mean(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    kw = {"lr": LR, "kl_coef": 0.04, "max_grad_norm": 0}
    split = GRPOUpdate(micro_batch_size=6, **kw)
    # per-prompt embeddings (4 responses each): micro-batches round up to whole groups (8 rows)
    assert split.trainer.slices(16, 4) == [slice(0, 8), slice(8, 16)]
    inputs = _grpo_inputs(
        batch, adv, ref_logprobs=batch["ref_logprobs"], image_embeds=batch["image_embeds"]
    )
    _assert_same_step(GRPOUpdate(**kw), split, inputs, ("policy",))


def _padded_sizes(node, inputs):
    """Each micro-batch's rows and padded width (prompt + response columns) for ``inputs``."""
    micros, _ = node.trainer.micro_batches(node.trainer.view(inputs))
    return [(m.view.real.shape[0], m.view.t["prompt_ids"].shape[1] + m.view.real.shape[1]) for m in micros]  # fmt: skip


BUDGET = 60  # padded tokens per micro-batch: the 16-row batch (widths ~10 + 8) needs 5 or more


def test_a_token_budget_cuts_by_length_and_trims_the_padding(batch):
    inputs = _ppo_inputs(batch, image_embeds=batch["image_embeds"].repeat_interleave(4, 0))
    sizes = _padded_sizes(PPOUpdate(micro_batch_tokens=BUDGET), inputs)
    assert len(sizes) >= 4 and sum(rows for rows, _ in sizes) == 16
    assert all(rows * width <= BUDGET or rows == 1 for rows, width in sizes), sizes
    whole = batch["prompt_ids"].shape[1] + batch["response_ids"].shape[1]
    assert min(width for _, width in sizes) < whole  # short rows went without the long padding
    grouped = _grpo_inputs(batch, batch["response_mask"], image_embeds=batch["image_embeds"])
    assert all(rows % 4 == 0 for rows, _ in _padded_sizes(GRPOUpdate(micro_batch_tokens=BUDGET), grouped))  # fmt: skip


def test_ppo_token_budget_equals_full_batch(batch):
    kw = {"lr": LR, "kl_coef": 0.1, "entropy_coef": 0.01, "max_grad_norm": 0}
    inputs = _ppo_inputs(
        batch,
        ref_logprobs=batch["ref_logprobs"] + 0.05,
        image_embeds=batch["image_embeds"].repeat_interleave(4, 0),
    )
    _assert_same_step(PPOUpdate(**kw), PPOUpdate(micro_batch_tokens=BUDGET, **kw), inputs)


@pytest.mark.parametrize(
    "aggregation",
    ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"],
)
def test_grpo_token_budget_equals_full_batch(batch, aggregation):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    kw = {"lr": LR, "kl_coef": 0.04, "max_grad_norm": 0, "aggregation": aggregation}
    kw["horizon"] = 16 if aggregation == "seq-mean-token-sum-norm" else 0  # > the width (8)
    inputs = _grpo_inputs(
        batch, adv, ref_logprobs=batch["ref_logprobs"], image_embeds=batch["image_embeds"]
    )
    split = GRPOUpdate(micro_batch_tokens=BUDGET, **kw)
    _assert_same_step(GRPOUpdate(**kw), split, inputs, ("policy",))


def _text_batch(n: int = 2) -> dict:
    """A text causal LM's batch: 4 prompts of different lengths, n ragged responses each."""
    from nodes.models.policy import build_policy

    policy = build_policy("tiny-qwen2")
    enc = policy.encode_prompts(["what color is it", "a", "the shape is round and red", "b c"])
    g = torch.Generator().manual_seed(0)
    B, R = 4 * n, 7
    lengths = torch.randint(1, R + 1, (B,), generator=g)  # (B,)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()  # (B, R)
    scores = torch.randn(B, generator=g)
    return {
        "prompt_ids": enc.prompt_ids.repeat_interleave(n, 0),
        "prompt_mask": enc.prompt_mask.repeat_interleave(n, 0),
        "response_ids": torch.randint(3, policy.vocab_size, (B, R), generator=g) * mask.long(),
        "response_mask": mask,
        "logprobs": -torch.rand(B, R, generator=g) * mask - 2 * mask,
        "advantages": broadcast_to_tokens(scores, mask),
    }


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])  # fmt: skip
def test_packed_rows_take_the_padded_step(aggregation):
    """pack_sequences: each micro-batch's rows in one sequence with no padding (position ids
    restart a row) give the padded forward's gradients and step."""
    inputs = _text_batch()
    kw = {"policy": "tiny-qwen2", "lr": LR, "max_grad_norm": 0, "aggregation": aggregation,
          "entropy_coef": 0.01, "micro_batch_tokens": 48}  # fmt: skip
    _assert_same_step(GRPOUpdate(**kw), GRPOUpdate(pack_sequences=True, **kw), inputs, ("policy",))


def test_packed_rows_take_the_padded_step_in_ppo():
    inputs = _text_batch(n=1)
    inputs |= {"returns": inputs["advantages"], "values": torch.zeros_like(inputs["logprobs"])}
    kw = {"policy": "tiny-qwen2", "critic": "tiny-qwen2", "lr": LR, "max_grad_norm": 0}
    # (packing is the policy's forward; the critic's is the padded one either way)
    _assert_same_step(PPOUpdate(**kw), PPOUpdate(pack_sequences=True, **kw), inputs, ("policy",))


def test_packing_is_refused_where_it_is_not_built(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    node = GRPOUpdate(pack_sequences=True)  # the tiny prefix-VLM
    with pytest.raises(ValueError, match="pack_sequences=True needs a text causal LM"):
        node.run(_grpo_inputs(batch, adv, image_embeds=batch["image_embeds"]))


def test_mini_batches_are_that_many_optimizer_steps_on_parts_of_the_batch(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    per_row = batch["image_embeds"].repeat_interleave(4, 0)  # one unit a row
    inputs = _grpo_inputs(batch, adv, image_embeds=per_row)
    kw = {"lr": 1e-3, "max_grad_norm": 0, "kl_coef": 0.0}
    node = GRPOUpdate(mini_batches=2, **kw)
    parts = node.trainer.mini_batches(node.trainer.view(inputs), 0)
    rows = [p.t["response_ids"] for p in parts]
    assert len(parts) == 2 and sum(len(r) for r in rows) == 16
    steps = GRPOUpdate(**kw)  # the same two steps, one call each
    for part in parts:
        taken = {k: v[_rows_of(v, part, inputs)] for k, v in inputs.items()}
        steps.run(taken)
    node.run(inputs)
    mine, theirs = _params(node.policy), _params(steps.policy)
    assert all(torch.allclose(mine[k], theirs[k], atol=1e-6) for k in mine)
    assert not _same_params(mine, _params(GRPOUpdate(**kw).policy))  # it did step


def _rows_of(value, part, inputs):
    """The rows of ``inputs`` that mini-batch ``part`` holds (matched by response ids)."""
    ids = inputs["response_ids"]
    picked = [int((ids == row).all(1).nonzero()[0]) for row in part.t["response_ids"]]
    return torch.tensor(picked)


def test_a_bf16_mixed_precision_step_stays_near_the_float32_step(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    kw = {"lr": LR, "max_grad_norm": 0, "kl_coef": 0.0}
    fp32, mixed = GRPOUpdate(**kw), GRPOUpdate(mixed_precision="bf16", **kw)
    start = _params(fp32.policy)
    m_mixed, m_fp32 = mixed.run(inputs)["metrics"], fp32.run(inputs)["metrics"]
    a, b = _params(fp32.policy), _params(mixed.policy)
    assert all(v.dtype == torch.float32 for v in b.values())  # the master weights
    state = mixed.optimizer.state[next(iter(mixed.policy.parameters()))]
    assert state["exp_avg"].dtype == torch.float32  # and the AdamW state
    step_a = torch.cat([(a[k] - start[k]).flatten() for k in a])
    step_b = torch.cat([(b[k] - start[k]).flatten() for k in a])
    # Adam's first step moves a weight by ~lr * sign(gradient): bf16 compute changes the
    # gradients by ~1% relative, which flips the sign only where a gradient is near 0 (the
    # mean difference was 0.004 lr here, the grad norms 2e-4 apart relative)
    assert (step_a - step_b).abs().mean() < 0.05 * LR, (step_a - step_b).abs().mean()
    assert m_mixed["grad_norm"] == pytest.approx(m_fp32["grad_norm"], rel=0.02)


def test_the_learning_rate_warms_up_then_decays(batch):
    from nodes.update.schedule import lr_factor

    assert [lr_factor(s, "linear", 2, 4) for s in range(7)] == [0.5, 1, 1, 0.75, 0.5, 0.25, 0]
    assert [lr_factor(s, "constant", 0, 0) for s in (0, 100)] == [1, 1]
    assert lr_factor(3, "cosine", 1, 4) == pytest.approx(0.5)  # half-way down the cosine
    node = GRPOUpdate(lr=1e-3, lr_warmup_steps=2)
    inputs = _grpo_inputs(batch, batch["response_mask"], image_embeds=batch["image_embeds"])
    lrs = [node.run(inputs)["metrics"]["lr"] for _ in range(3)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="lr_decay_steps"):
        GRPOUpdate(lr_schedule="cosine")


def test_responses_cut_at_max_new_tokens_can_leave_the_loss(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    cut = torch.zeros(16)
    cut[:8] = 1.0  # the first two prompts' responses were cut
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    kw = {"lr": LR, "max_grad_norm": 0}
    masked = GRPOUpdate(mask_truncated=True, **kw)
    m = masked.run({**inputs, "truncated": cut})["metrics"]
    lengths = batch["response_mask"].sum(1)
    assert m["truncated"] == 0.5 and m["ended_length"] == pytest.approx(float(lengths[8:].mean()))
    # the same step as an update that never saw those rows
    rest = {k: v[8:] for k, v in inputs.items() if k != "image_embeds"}
    alone = GRPOUpdate(**kw)
    alone.run({**rest, "image_embeds": batch["image_embeds"][2:]})
    a, b = _params(masked.policy), _params(alone.policy)
    assert all(torch.allclose(a[k], b[k], atol=PARAM_ATOL) for k in a)
    kept = GRPOUpdate(**kw).run({**inputs, "truncated": cut})["metrics"]  # reported, not masked
    assert kept["truncated"] == 0.5 and kept["loss"] != m["loss"]


def test_truncated_importance_sampling_weighs_each_token_by_the_capped_gap(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    kw = {"lr": LR, "max_grad_norm": 0}
    plain = GRPOUpdate(**kw)
    plain.run(inputs)
    same = GRPOUpdate(tis_cap=2.0, **kw)  # the sampler agrees with the trainer: weights 1
    m = same.run({**inputs, "rollout_logprobs": inputs["logprobs"]})["metrics"]
    assert (m["logprob_gap_max"], m["tis_weight_mean"]) == (0.0, 1.0)
    a, b = _params(plain.policy), _params(same.policy)
    assert all(torch.allclose(a[k], b[k], atol=PARAM_ATOL) for k in a)
    # the sampler's logprobs 0.3 lower on the first prompt's rows and 1.0 on the second's: the
    # weights are e^0.3 and e^1 capped at 2, so the step is that of advantages scaled by them
    gap = torch.zeros(16, 1)
    gap[:4], gap[4:8] = 0.3, 1.0
    sampled = inputs["logprobs"] - gap * batch["response_mask"]
    tis = GRPOUpdate(tis_cap=2.0, **kw)
    m = tis.run({**inputs, "rollout_logprobs": sampled})["metrics"]
    assert m["logprob_gap_max"] == pytest.approx(1.0)
    scale = torch.ones(16, 1)
    scale[:4], scale[4:8] = math.exp(0.3), 2.0
    scaled = GRPOUpdate(**kw)
    expected = scaled.run({**inputs, "advantages": adv * scale})["metrics"]
    assert m["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    a, b = _params(tis.policy), _params(scaled.policy)
    assert all(torch.allclose(a[k], b[k], atol=PARAM_ATOL) for k in a)
    assert not all(torch.allclose(a[k], _params(plain.policy)[k], atol=PARAM_ATOL) for k in a)
    with pytest.raises(ValueError, match="needs the 'rollout_logprobs' input"):
        GRPOUpdate(tis_cap=2.0, **kw).run(inputs)
    with pytest.raises(ValueError, match="tis_cap=-1"):
        GRPOUpdate(tis_cap=-1)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_level_importance_weights_scale_each_response_whole(batch, mode):
    """The sampler 0.6 nats lower on the first token of the first prompt's responses and 1.0
    lower on every token of the second prompt's: per sequence the weights are exp(0.6 / |o|)
    and e (truncated to 2, or masked to 0 with cap 2), the step that of advantages scaled so."""
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    mask = batch["response_mask"]
    gap = torch.zeros_like(mask)
    gap[:4, 0] = 0.6
    gap[4:8] = 1.0
    sampled = inputs["logprobs"] - gap * mask
    kw = {"lr": LR, "max_grad_norm": 0}
    node = GRPOUpdate(tis_cap=2.0, tis_level="sequence", tis_mode=mode, **kw)
    m = node.run({**inputs, "rollout_logprobs": sampled})["metrics"]
    scale = torch.ones(16, 1)
    scale[:4, 0] = torch.exp(0.6 / mask[:4].sum(1))
    scale[4:8] = 2.0 if mode == "truncate" else 0.0
    scaled = GRPOUpdate(**kw)
    expected = scaled.run({**inputs, "advantages": adv * scale})["metrics"]
    assert m["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    a, b = _params(node.policy), _params(scaled.policy)
    assert all(torch.allclose(a[k], b[k], atol=PARAM_ATOL) for k in a)
    if mode == "mask":  # the second prompt's tokens are dropped
        assert m["tis_masked"] == pytest.approx(float(mask[4:8].sum() / mask.sum()))
    with pytest.raises(ValueError, match="tis_mode='mask': cap is 1.0; it must be a finite"):
        GRPOUpdate(tis_cap=1.0, tis_mode="mask")


def test_gspo_is_chosen_by_name_in_both_updates_and_takes_ppos_step_on_policy(batch):
    """One pass over a batch: the ratio is 1, and GSPO's gradient is PPO's with the
    per-response token mean (GRPO's default); a second pass clips whole responses."""
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    kw = {"lr": LR, "max_grad_norm": 0}
    ppo, gspo = GRPOUpdate(**kw), GRPOUpdate(policy_loss="gspo", **kw)
    assert (ppo.hp.policy_loss, gspo.hp.policy_loss) == ("ppo", "gspo")
    m_ppo, m_gspo = ppo.run(inputs)["metrics"], gspo.run(inputs)["metrics"]
    assert m_gspo["loss"] == pytest.approx(m_ppo["loss"], abs=1e-6)
    a, b = _params(ppo.policy), _params(gspo.policy)
    assert all(torch.allclose(a[k], b[k], atol=PARAM_ATOL) for k in a)
    # two passes at lr 1e-3 with GSPO's clip range: responses move beyond 4e-4 and are clipped
    kw = {"lr": 1e-3, "epochs": 2, "clip_eps": 3e-4, "clip_eps_high": 4e-4}
    two = GRPOUpdate(policy_loss="gspo", **kw).run(inputs)["metrics"]
    assert two["clip_fraction"] > 0
    m = PPOUpdate(policy_loss="gspo", **kw).run(
        {**_ppo_inputs(batch), "image_embeds": batch["image_embeds"]}
    )
    assert m["metrics"]["clip_fraction"] > 0 and math.isfinite(m["metrics"]["loss"])
    with pytest.raises(ValueError, match="policy_loss is 'gpso'.*choose one of ppo, gspo"):
        GRPOUpdate(policy_loss="gpso")


# --- weight sync ----------------------------------------------------------------------------


def test_weights_sync_rollout_and_critic_exactly(batch):
    node = PPOUpdate(lr=1e-3, epochs=2)
    out = node.run(_ppo_inputs(batch, image_embeds=batch["image_embeds"]))
    rollout, critic = Rollout(n=1, max_new_tokens=2), Critic()
    ports = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    values_before = critic.run(ports, image_embeds=batch["image_embeds"])["values"]
    rollout.run(prompts=PROMPTS, image_embeds=batch["image_embeds"], weights=out["weights"])
    values = critic.run(ports, image_embeds=batch["image_embeds"], weights=out["critic_weights"])[
        "values"
    ]

    assert torch.equal(_seq_logprob(rollout.policy, batch), _seq_logprob(node.policy, batch))
    pb = node.value_model.trunk.prepare(
        batch["prompt_ids"],
        batch["prompt_mask"],
        image_embeds=batch["image_embeds"].repeat_interleave(4, 0),
    )
    with torch.no_grad():
        expected = node.value_model(pb, batch["response_ids"], batch["response_mask"])
    assert torch.equal(values, expected)
    assert not torch.equal(values, values_before)  # the sync did change the critic
    # the payload is a snapshot: a later update does not change an already published version
    published = {k: v.clone() for k, v in out["weights"].weights.items()}
    out2 = node.run(_ppo_inputs(batch, image_embeds=batch["image_embeds"]))
    assert _same_params(published, out["weights"].weights)
    assert out2["weights"].version == 2 and out2["critic_weights"].version == 2


# --- non-finite -----------------------------------------------------------------------------


def test_nan_advantage_at_real_token_is_an_error_but_padding_is_ignored(batch):
    node = PPOUpdate()
    inputs = _ppo_inputs(batch, image_embeds=batch["image_embeds"])
    mask = batch["response_mask"]
    bad = inputs["advantages"].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"node 'ppo_update': input 'advantages'.*non-finite"):
        node.run({**inputs, "advantages": bad})
    mask = mask.clone()
    mask[:, -1] = 0  # padding at the end of every row, whatever the rollout sampled
    padded = inputs["advantages"].masked_fill(mask == 0, float("nan"))
    metrics = node.run({**inputs, "response_mask": mask, "advantages": padded})["metrics"]
    assert metrics["skipped_nonfinite"] == 0.0 and math.isfinite(metrics["loss"])


def test_nan_gradient_skips_the_step(batch):
    node = PPOUpdate(lr=1e-2, epochs=3, name="ppo")
    before, critic_before = _params(node.policy), _params(node.value_model)
    param = node.policy.projector.weight
    hook = param.register_hook(lambda g: torch.full_like(g, float("nan")))
    out = node.run(_ppo_inputs(batch, image_embeds=batch["image_embeds"]))
    assert out["metrics"]["skipped_nonfinite"] == 1.0
    assert math.isnan(out["metrics"]["grad_norm"])
    assert _same_params(before, _params(node.policy))
    assert _same_params(critic_before, _params(node.value_model))  # no model steps alone
    assert _same_params(before, out["weights"].weights)
    assert all(p.grad is None for p in node.policy.parameters())  # gradients zeroed
    assert node.optimizer.state_dict()["state"] == {}  # Adam never stepped

    strict = PPOUpdate(on_nonfinite="raise", name="strict_ppo")
    strict.policy.projector.weight.register_hook(lambda g: g * float("inf"))
    with pytest.raises(ValueError, match=r"node 'strict_ppo': non-finite gradient of the policy"):
        strict.run(_ppo_inputs(batch, image_embeds=batch["image_embeds"]))
    hook.remove()


def test_nan_parameter_skips_grpo_step_and_names_logprobs(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    node = GRPOUpdate(name="grpo")
    with torch.no_grad():
        node.policy.projector.bias[0] = float("nan")  # a poisoned weight: NaN logits
    before = _params(node.policy)
    out = node.run(_grpo_inputs(batch, adv, image_embeds=batch["image_embeds"]))
    assert out["metrics"]["skipped_nonfinite"] == 1.0
    after = _params(node.policy)
    assert all(torch.allclose(before[k], after[k], rtol=0, atol=0, equal_nan=True) for k in before)
    node.trainer.hp = msgspec.structs.replace(node.hp, on_nonfinite="raise")
    with pytest.raises(ValueError, match=r"node 'grpo': non-finite policy logprobs"):
        node.run(_grpo_inputs(batch, adv, image_embeds=batch["image_embeds"]))


@pytest.mark.parametrize(
    ("lr", "found"),
    [
        (1e30, "non-finite weights after the optimizer step in update 1, epoch 1"),  # ~1e30: w*w
        (1e15, "non-finite policy logprobs in update 1, epoch 2"),  # finite, but logits overflow
    ],
)
def test_a_step_that_makes_the_policy_diverge_is_undone_and_names_the_lr(batch, caplog, lr, found):
    """A step whose weights are too large to square is caught at once; one whose weights are
    finite but whose logits overflow, at the next epoch's forward. Either way the step is
    undone, so the weights published are the ones before it."""
    from yatt_graph import UsageError

    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    node = GRPOUpdate(lr=lr, epochs=2, name="grpo")
    before = _params(node.policy)
    with caplog.at_level("WARNING"):
        out = node.run(inputs)
    assert out["metrics"]["skipped_nonfinite"] == 1.0
    assert _same_params(before, _params(node.policy))
    assert _same_params(before, out["weights"].weights)
    assert f"{found}; the optimizer step that led to it (lr {lr:g}) was undone" in caplog.text
    node.trainer.hp = msgspec.structs.replace(node.hp, on_nonfinite="raise")
    with pytest.raises(UsageError, match=found.replace("update 1", "update 2")):
        node.run(inputs)
    assert _same_params(before, _params(node.policy))


def test_a_step_that_leaves_weights_not_finite_is_undone_before_anything_reads_them(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    node = GRPOUpdate(epochs=1, name="grpo")
    before = _params(node.policy)
    step = node.optimizer.step

    def overflowing_step(*args, **kwargs):  # as a float16 weight that overflows
        step(*args, **kwargs)
        with torch.no_grad():
            node.policy.projector.weight[0, 0] = float("inf")

    node.optimizer.step = overflowing_step
    out = node.run(inputs)
    assert out["metrics"]["skipped_nonfinite"] == 1.0
    assert _same_params(before, _params(node.policy))
    assert _same_params(before, out["weights"].weights)
    node.optimizer.step = step
    assert node.run(inputs)["metrics"]["skipped_nonfinite"] == 0.0
    assert not _same_params(before, _params(node.policy))


def test_a_float16_policy_is_refused_for_training_with_the_reason():
    spec = {"name": "tiny-prefix-vlm", "dtype": "float16"}
    with pytest.raises(ValueError, match=r"float16 weights; AdamW on float16 .* no loss scaler"):
        GRPOUpdate(policy=spec, name="grpo").setup()
    GRPOUpdate(policy={**spec, "dtype": "bfloat16"}, name="grpo").setup()


# --- state ----------------------------------------------------------------------------------


def test_state_round_trip_continues_identically(batch):
    inputs = _ppo_inputs(batch, image_embeds=batch["image_embeds"])
    a = PPOUpdate(lr=1e-3, epochs=2, micro_batch_size=8)
    a.run(inputs)
    saved = a.state_dict()
    runs_a = [a.run(inputs) for _ in range(2)]
    b = PPOUpdate(lr=1e-3, epochs=2, micro_batch_size=8)
    b.load_state_dict(saved)
    runs_b = [b.run(inputs) for _ in range(2)]
    for ra, rb in zip(runs_a, runs_b):
        assert ra["metrics"] == rb["metrics"]
        assert ra["weights"].version == rb["weights"].version
        assert _same_params(ra["weights"].weights, rb["weights"].weights)
        assert _same_params(ra["critic_weights"].weights, rb["critic_weights"].weights)
    assert runs_b[-1]["weights"].version == 3
    assert set(saved) == {
        "policy",
        "optimizer",
        "value_model",
        "critic_optimizer",
        "version",
        "critic_version",
        "updates",
    }
    with pytest.raises(ValueError, match="expected state keys"):
        b.load_state_dict({"policy": saved["policy"]})


def test_grpo_state_round_trip(batch):
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    a = GRPOUpdate(lr=1e-3)
    a.run(inputs)
    b = GRPOUpdate(lr=1e-3)
    b.load_state_dict(a.state_dict())
    wa, wb = a.run(inputs)["weights"], b.run(inputs)["weights"]
    assert wa.version == wb.version == 2 and _same_params(wa.weights, wb.weights)


def test_weights_include_and_dtype_send_a_partial_cast_update_a_rollout_loads(batch):
    from runtime.codec import decode_value, encode_value

    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    inputs = _grpo_inputs(batch, adv, image_embeds=batch["image_embeds"])
    node = GRPOUpdate(lr=1e-3, weights_include=[r"^projector\."], weights_dtype="bfloat16")
    sent = node.run(inputs)["weights"]
    trained = node.policy.state_dict()
    assert sorted(sent.weights) == sorted(k for k in trained if k.startswith("projector."))
    assert sent.version == 1 and not sent.complete
    back = decode_value([bytes(memoryview(f).cast("B")) for f in encode_value(sent)])
    assert isinstance(back, WeightUpdate) and back.version == 1 and back.complete is False
    for k, t in back.weights.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, trained[k].to(torch.bfloat16)), k
    rollout = Rollout(n=N_SAMPLES, max_new_tokens=8, seed=0)
    rollout.run(prompts=PROMPTS, image_embeds=batch["image_embeds"], weights=back)
    assert rollout.weights_version == 1
    loaded = rollout.policy.state_dict()
    assert all(torch.equal(loaded[k], back.weights[k].float()) for k in back.weights)
    untouched = next(k for k in trained if not k.startswith("projector."))
    assert not torch.equal(loaded[untouched], trained[untouched])  # not sent: not loaded
    whole = GRPOUpdate(lr=1e-3, weights_dtype="bfloat16").run(inputs)["weights"]
    assert whole.complete and list(whole.weights) == list(trained)
    with pytest.raises(ValueError, match="weights_dtype='int8' is not a floating torch dtype"):
        GRPOUpdate(weights_dtype="int8")
    with pytest.raises(ValueError, match=r"node 'p': weights_include=\['\('\]"):
        PPOUpdate(weights_include=["("], name="p")


# --- input errors and config ----------------------------------------------------------------


def test_kl_coef_needs_ref_logprobs(batch):
    with pytest.raises(
        ValueError, match=r"node 'ppo_update': kl_coef=0.1 needs the 'ref_logprobs'"
    ):
        PPOUpdate(kl_coef=0.1).run(_ppo_inputs(batch, image_embeds=batch["image_embeds"]))
    adv = broadcast_to_tokens(batch["scores"], batch["response_mask"])
    with pytest.raises(ValueError, match=r"node 'grpo_update': kl_coef=0.04 needs"):
        GRPOUpdate(kl_coef=0.04).run(_grpo_inputs(batch, adv, image_embeds=batch["image_embeds"]))
    out = PPOUpdate(kl_coef=0.1).run(
        _ppo_inputs(batch, image_embeds=batch["image_embeds"], ref_logprobs=batch["ref_logprobs"])
    )
    assert out["metrics"]["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference


def test_bad_inputs_name_node_and_field(batch):
    node = PPOUpdate()
    inputs = _ppo_inputs(batch, image_embeds=batch["image_embeds"])
    longer = torch.zeros(inputs["advantages"].shape[0], inputs["advantages"].shape[1] + 1)
    with pytest.raises(NodeInputError, match=r"node 'ppo_update': input 'advantages'.*R="):
        node.run({**inputs, "advantages": longer})
    empty = {
        k: v[:0] if torch.is_tensor(v) and k != "image_embeds" else v for k, v in inputs.items()
    }
    with pytest.raises(ValueError, match=r"node 'ppo_update': input 'response_ids' is empty"):
        node.run({**empty, "image_embeds": None})
    with pytest.raises(ValueError, match=r"input 'image_embeds' has 3 rows for 16 responses"):
        node.run({**inputs, "image_embeds": batch["image_embeds"][:3]})
    with pytest.raises(ValueError, match=r"node 'ppo_update': input 'response_mask' has no real"):
        node.run({**inputs, "response_mask": torch.zeros_like(inputs["response_mask"])})
    with pytest.raises(ValueError, match="on_nonfinite"):
        PPOUpdate(on_nonfinite="ignore")
    with pytest.raises(ValueError, match="clip_eps"):
        GRPOUpdate(clip_eps=1.5)


def test_config_is_json_and_rebuilds():
    node = GRPOUpdate(lr=3e-4, aggregation="token-mean", name="g")
    config = node.config()
    json.dumps(config)
    again = type(node)(**config)
    assert again.name == "g" and again.hp.aggregation == "token-mean" and again.hp.lr == 3e-4
    assert _same_params(_params(node.policy), _params(again.policy))
    assert not node.batch_policy.splittable


@pytest.mark.parametrize("cls", [GRPOUpdate, PPOUpdate, ReferenceLogprobs, Critic])
def test_an_unknown_option_names_the_node_class_and_the_nearest_option(cls):
    """Their shared options come from one base's __init__; a typo still names the node."""
    match = rf"^{cls.__name__}\(\) .* 'devise' \(did you mean 'device'\?\)"
    with pytest.raises(TypeError, match=match):
        cls(devise="cpu")
