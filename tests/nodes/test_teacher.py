"""On-policy distillation's parts: the teacher node, the tokenizer check, the reverse-KL loss
term and advantages against float64 hand computations, and the update taking them."""

from __future__ import annotations

import pytest
import torch

from nodes.data import task_vocabulary
from nodes.models.policy import build_policy
from nodes.reference import ReferenceLogprobs
from nodes.rl.losses import distill_advantages, kl_loss
from nodes.rollout import Rollout
from nodes.teacher import TeacherLogprobs, spec_tokenizer, tokenizer_problem
from nodes.update import GRPOUpdate, PPOUpdate

PROMPTS = ["what colour is the shape?", "name the shape", "how many shapes?"]
STUDENT = {"name": "tiny-prefix-vlm", "words": task_vocabulary(), "seed": 0}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads on a shared machine; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A saved tiny prefix-VLM with the student's vocabulary and other weights (seed 5)."""
    path = tmp_path_factory.mktemp("teacher") / "teacher"
    build_policy({**STUDENT, "seed": 5}).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def batch():
    """The student's sampled responses (text only: the tiny prefix-VLM without images)."""
    out = Rollout(policy=STUDENT, n=2, max_new_tokens=4, seed=0).run(prompts=PROMPTS)
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs")
    return {k: out[k] for k in keys}


def _ports(batch):
    return {k: batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}


def test_the_teacher_scores_as_a_reference_of_its_model_does(teacher_dir, batch):
    node = TeacherLogprobs(teacher_dir, micro_batch_tokens=8)
    assert set(node.outputs) == {"teacher_logprobs"} and node.kind == "reference"
    got = node.run(_ports(batch))["teacher_logprobs"]  # (B, R)
    same = ReferenceLogprobs(teacher_dir).run(_ports(batch))["ref_logprobs"]  # whole batch
    torch.testing.assert_close(got, same, atol=1e-5, rtol=0)
    real = batch["response_mask"] > 0
    assert bool((got[~real] == 0).all()) and bool((got[real] < 0).all())
    # another model than the student: its logprobs of the student's tokens differ
    assert (got - batch["logprobs"])[real].abs().max() > 1e-3
    with pytest.raises(ValueError, match="a teacher holds its own model"):
        TeacherLogprobs(teacher_dir, share="policy")


def test_a_teacher_must_read_the_students_token_ids_as_the_student_does(teacher_dir):
    student = spec_tokenizer(STUDENT)
    assert tokenizer_problem(student, spec_tokenizer(teacher_dir)) is None
    assert tokenizer_problem(student, spec_tokenizer("tiny-qwen2")) is not None  # characters
    other = spec_tokenizer({**STUDENT, "words": ["zebra", *task_vocabulary()]})
    why = tokenizer_problem(student, other)
    assert "token 'what' is id 3 to the policy and 4 to the teacher" in why  # lowest id first


def _hand_k2_seq_mean(lp, lpt, mask):
    """float64 loops: the mean over responses of the mean over their tokens of
    0.5 * (log pi - log pi_teacher)^2, and its gradient with respect to ``lp``."""
    B, T = lp.shape
    loss, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    rows = [i for i in range(B) if mask[i].sum() > 0]
    for i in rows:
        n = int(mask[i].sum())
        for t in range(T):
            if mask[i, t] > 0:
                d = float(lp[i, t] - lpt[i, t])
                loss += 0.5 * d * d / n / len(rows)
                grad[i, t] = d / n / len(rows)
    return loss, grad


def test_the_loss_term_is_the_mean_reverse_kl_in_float64():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    lpt = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    lpt[mask == 0] = float("nan")  # padding is never read
    lp.requires_grad_(True)
    loss = kl_loss(lp, lpt, mask, "k2", aggregation="seq-mean-token-mean")
    loss.backward()
    want, grad = _hand_k2_seq_mean(lp.detach(), lpt, mask)
    assert loss.dtype == torch.float64 and float(loss.detach()) == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(lp.grad, grad, rtol=1e-12, atol=1e-15)
    k1 = kl_loss(lp.detach(), lpt, mask, "k1", aggregation="token-mean")
    real = mask > 0
    assert float(k1) == pytest.approx(float((lp.detach() - lpt)[real].mean()), rel=1e-12)


def test_the_advantage_term_is_minus_the_coef_times_each_tokens_reverse_kl_in_float64():
    g = torch.Generator().manual_seed(1)
    adv, lp, lpt = (torch.randn(2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    got = distill_advantages(adv, lp, lpt, mask, distill_coef=0.5, reward_coef=2.0)
    for i in range(2):
        for t in range(4):
            want = 2.0 * adv[i, t] - 0.5 * (lp[i, t] - lpt[i, t]) if mask[i, t] else 0.0
            assert float(got[i, t]) == pytest.approx(float(want), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match=r"distill_advantages: distill_coef=-1.0; it must be"):
        distill_advantages(adv, lp, lpt, mask, distill_coef=-1.0)


def _grpo_inputs(batch, advantages, **more):
    return {**batch, "advantages": advantages, **more}


def test_the_update_adds_the_teachers_term_to_its_loss(teacher_dir, batch):
    """One pass, one micro-batch: the update's policy is the sampler, so its logprobs are the
    batch's, and the loss with the term exceeds the loss without by coef * the k2 mean."""
    teacher = TeacherLogprobs(teacher_dir).run(_ports(batch))["teacher_logprobs"]
    adv = torch.randn(batch["response_ids"].shape, generator=torch.Generator().manual_seed(2))
    plain = GRPOUpdate(STUDENT, lr=1e-3).run(_grpo_inputs(batch, adv))["metrics"]
    taught = GRPOUpdate(STUDENT, lr=1e-3, distill_coef=0.7).run(
        _grpo_inputs(batch, adv, teacher_logprobs=teacher)
    )["metrics"]
    lp, mask = batch["logprobs"].double(), batch["response_mask"].double()
    want, _ = _hand_k2_seq_mean(lp, teacher.double(), mask)
    assert taught["distill_loss"] == pytest.approx(want, rel=1e-4)
    assert taught["loss"] - plain["loss"] == pytest.approx(0.7 * want, rel=1e-3, abs=1e-6)
    real = mask > 0
    assert taught["distill/kl"] == pytest.approx(
        float((lp - teacher.double())[real].mean()), rel=1e-5
    )
    assert "distill/kl" not in plain and "distill_loss" not in plain


def test_advantage_mode_takes_the_step_of_the_teachers_advantages(teacher_dir, batch):
    """reward_coef=0 in advantage mode: the step a plain update takes on the advantages
    -coef * (log pi_old - log pi_teacher)."""
    teacher = TeacherLogprobs(teacher_dir).run(_ports(batch))["teacher_logprobs"]
    zeros = torch.zeros(batch["response_ids"].shape)
    taught = GRPOUpdate(STUDENT, lr=1e-3, distill_coef=2.0, distill_mode="advantage",
                        reward_coef=0.0)  # fmt: skip
    out = taught.run(_grpo_inputs(batch, zeros, teacher_logprobs=teacher))
    plain = GRPOUpdate(STUDENT, lr=1e-3)
    adv = torch.where(batch["response_mask"] > 0, -2.0 * (batch["logprobs"] - teacher), 0.0)
    plain.run(_grpo_inputs(batch, adv))
    for (name, a), (_, b) in zip(taught.policy.named_parameters(), plain.policy.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    assert "distill_loss" not in out["metrics"] and "distill/kl" in out["metrics"]


def test_distill_coef_needs_the_teachers_logprobs_and_checks_its_options(batch):
    adv = torch.zeros(batch["response_ids"].shape)
    with pytest.raises(ValueError, match=r"node 'grpo_update': distill_coef=0.5 needs the "):
        GRPOUpdate(STUDENT, distill_coef=0.5).run(_grpo_inputs(batch, adv))
    with pytest.raises(ValueError, match=r"node 'ppo_update': distill_coef=-1.0; it must be"):
        PPOUpdate(STUDENT, critic=STUDENT, distill_coef=-1.0)
    with pytest.raises(ValueError, match=r"distill_mode='kl'; choose one of loss, advantage"):
        GRPOUpdate(STUDENT, distill_mode="kl")
    with pytest.raises(ValueError, match=r"distill_estimator"):
        GRPOUpdate(STUDENT, distill_estimator="k9")
