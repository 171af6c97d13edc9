"""The floor: the two end-to-end workloads of ``bench/e2e.py`` as one hand-written training loop,
with no framework at all (no Graph, no executor, no node calls): plain torch + transformers, the
same models built by the same constructors, the same HF ``generate``, the same losses and
optimizers. Its step time is the baseline of the end-to-end ratios (framework step time / floor
step time).

    .venv/bin/python -m bench.floor --workload a --steps 30 --warmup 5
    .venv/bin/python -m bench.floor --workload b --steps 8 --warmup 2

One JSON line goes to stdout (what ``run_floor`` returns; ``bench/e2e.py`` can run this module
in a subprocess and read it) and a table of the phases' median seconds to stderr. torch runs
one thread per usable core unless ``--threads`` says otherwise; the OpenMP wait policy is the
environment's (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``; unset: libgomp's default, a bounded
spin), reported in the JSON as ``openmp``, so a caller gives the floor and the framework the same.

Work per step, in the order the graphs run it:

- (a) ``graphs/mm_ppo.py`` with its defaults. Data: 32 shapes-task samples (color). Vision: the
  tiny open_clip ViT encodes the 32 images (no grad). Rollout: the tiny GPT-2 prefix-VLM samples
  up to 2 tokens per prompt with HF ``generate`` (temperature 1, seeded per step as the Rollout
  node seeds it) and keeps the logprobs of the sampled tokens. Reward: ``answer_reward`` per
  response. Reference: a frozen copy of the initial policy scores the responses (one forward).
  Critic: a value head on a second prefix-VLM trunk (spec seed + 1) gives V(s_t) (one forward).
  Advantages: k1 KL to the reference folded into the reward (coef 0.05), token-level GAE
  (gamma 1, lam 0.95), whitened. Update: 2 epochs, each one forward of the policy and one of the
  value model over the whole batch, loss = PPO clip (0.2) + 0.5 * clipped value loss (0.2)
  - 0.01 * entropy, one backward, each model's gradient clipped to norm 1, one AdamW step each
  (lr 1e-3, no weight decay). The policy trained in place is the one the next rollout samples.
- (b) ``graphs/mm_grpo.py --set max_new_tokens=64 --set batch_size=8 --judge tiny``. Data and
  vision: 8 samples. Rollout: 4 samples per prompt (32 responses) of up to 64 tokens. Reward: the
  tiny GPT-2 judge reads "Question: {prompt} Answer: {response} ..." (longest first, 16 per
  forward) and scores p(yes) over {yes, no}. Reference: as in (a). Advantages: GRPO (group mean
  and unbiased std). Update: 2 epochs, each one policy forward, loss = GRPO clip (0.2) + 0.05 *
  k3 KL to the reference - 0.01 * entropy (both seq-mean-token-mean), clip to norm 1, AdamW.

Models come from the project's constructors (``build_policy`` with the spec ``policy_spec``
makes, ``build_value_model``, open_clip with the tiny config, ``tiny_judge``), the data from
``make_sample`` and the rule reward from ``answer_reward``; defaults come from the graphs'
configs. Everything else, the step itself, is written out here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import string
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from transformers import GenerationConfig

from bench._util import load_average, machine, table
from graphs.common import policy_spec, vision_kwargs
from graphs.config import GRPOConfig, MultimodalPPOConfig, RLConfig
from nodes.data import answer_reward, make_sample
from nodes.models.policy import PrefixVLM, build_policy
from nodes.reference import ValueModel, build_value_model
from nodes.rewards.judge import DEFAULT_JUDGE_TEMPLATE, tiny_judge

__all__ = ["WORKLOADS", "main", "run_floor"]

#: The options ``bench/e2e.py`` passes each workload's graph (its ``WORKLOADS``).
WORKLOADS: dict[str, dict[str, Any]] = {
    "a": {"config": MultimodalPPOConfig, "options": {}, "group_size": 1, "judge": False},
    "b": {
        "config": GRPOConfig,
        "options": {"max_new_tokens": 64, "batch_size": 8},
        "group_size": 4,
        "judge": True,
    },
}

CLIP_EPS = 0.2  # PPOUpdate / GRPOUpdate clip_eps
VALUE_CLIP_EPS = 0.2  # PPOUpdate value_clip_eps
VF_COEF = 0.5  # PPOUpdate vf_coef
MAX_GRAD_NORM = 1.0  # both updates' max_grad_norm
JUDGE_BATCH = 16  # JudgeReward max_batch
JUDGE_WORDS = {"yes": 1.0, "no": 0.0}  # JudgeReward score_words


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------


@dataclass
class Judge:
    model: nn.Module
    tokenizer: Any
    word_ids: Tensor  # (W,)
    word_values: Tensor  # (W,)
    max_length: int


@dataclass
class Models:
    tower: nn.Module  # open_clip image tower, frozen
    preprocess: Any  # PIL image -> float32[3, H, W]
    policy: PrefixVLM  # trained; the rollout samples from it
    reference: PrefixVLM  # frozen copy of the initial policy
    value_model: ValueModel | None  # (a) critic trunk + head
    optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer | None
    judge: Judge | None  # (b)
    generation: GenerationConfig


def build_vision(vision: str, seed: int) -> tuple[nn.Module, Any]:
    """The graph's VisionEncoder tower: open_clip, seeded, image tower only, frozen."""
    import open_clip

    kwargs = vision_kwargs(vision, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(kwargs["seed"])
        model, _, preprocess = open_clip.create_model_and_transforms(
            kwargs["model_name"], pretrained=kwargs.get("pretrained"), **kwargs.get("model_cfg", {})
        )
    tower = model.visual.eval().requires_grad_(False)
    return tower, preprocess


def build_judge(seed: int) -> Judge:
    """The tiny judge as ``JudgeReward("tiny")`` builds it (its vocabulary holds the score
    words and the template's words)."""
    literal = [
        w for text, *_ in string.Formatter().parse(DEFAULT_JUDGE_TEMPLATE) for w in text.split()
    ]
    model, tokenizer = tiny_judge([*JUDGE_WORDS, *literal], seed)
    tokenizer.padding_side = tokenizer.truncation_side = "left"
    word_ids = torch.tensor(tokenizer.convert_tokens_to_ids(list(JUDGE_WORDS)))  # (W,)
    values = torch.tensor(list(JUDGE_WORDS.values()), dtype=torch.float32)  # (W,)
    return Judge(model.eval(), tokenizer, word_ids, values, model.config.n_positions)


def build_models(config: RLConfig, judge: bool) -> Models:
    tower, preprocess = build_vision(config.vision, config.seed)
    spec = policy_spec(config, image_dim=tower.output_dim)
    policy = build_policy(spec).eval()
    reference = build_policy(spec).eval().requires_grad_(False)
    value_model = critic_optimizer = None
    if isinstance(config, MultimodalPPOConfig):
        critic_spec = {**spec, "seed": config.seed + 1}
        value_model = build_value_model(critic_spec, head_seed=config.seed).eval()
        critic_optimizer = torch.optim.AdamW(
            value_model.parameters(), lr=config.critic_lr, weight_decay=0.0
        )
    tokenizer = policy.tokenizer
    generation = GenerationConfig(
        do_sample=True,
        temperature=config.temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=config.max_new_tokens,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        return_dict_in_generate=True,
        output_logits=True,
        use_cache=True,
    )
    return Models(
        tower=tower,
        preprocess=preprocess,
        policy=policy,
        reference=reference,
        value_model=value_model,
        optimizer=torch.optim.AdamW(policy.parameters(), lr=config.lr, weight_decay=0.0),
        critic_optimizer=critic_optimizer,
        judge=build_judge(config.seed) if judge else None,
        generation=generation,
    )


# ---------------------------------------------------------------------------------------------
# data, vision, rollout
# ---------------------------------------------------------------------------------------------


def sample_batch(config: RLConfig, step: int) -> tuple[list[Any], list[str], list[dict]]:
    """ShapesSource's batch at ``step``: images, prompts, meta."""
    start = step * config.batch_size
    samples = [make_sample(config.seed, start + i, config.task) for i in range(config.batch_size)]
    images, prompts, meta = (list(x) for x in zip(*samples))
    return images, prompts, meta


@torch.no_grad()
def encode_images(models: Models, images: list[Any]) -> Tensor:
    pixels = torch.stack([models.preprocess(im) for im in images])  # (N, 3, H, W)
    return models.tower(pixels).float()  # (N, D)


def prompt_embeds(
    policy: PrefixVLM, prompt_ids: Tensor, prompt_mask: Tensor, image_embeds: Tensor
) -> tuple[Tensor, Tensor]:
    """``[projected image prefix | left-padded prompt]``: float[B, k+P, H], int64[B, k+P]."""
    B = prompt_ids.shape[0]
    tokens = policy.lm.get_input_embeddings()(prompt_ids)  # (B, P, H)
    prefix = policy.projector(image_embeds)  # (B, k*H)
    prefix = prefix.view(B, policy.num_prefix_tokens, policy.hidden_size)  # (B, k, H)
    ones = prompt_mask.new_ones(B, policy.num_prefix_tokens)  # (B, k)
    return torch.cat([prefix, tokens], 1), torch.cat([ones, prompt_mask], 1)


@dataclass
class Rollout:
    prompt_ids: Tensor  # (B, P) left-padded
    prompt_mask: Tensor  # (B, P)
    image_embeds: Tensor  # (B, D), one row per response
    response_ids: Tensor  # (B, R) right-padded
    response_mask: Tensor  # (B, R) float, 1 on real tokens (EOS included)
    logprobs: Tensor  # (B, R) sampling-policy logprobs, 0 at padding
    texts: list[str]


@torch.no_grad()
def rollout(
    models: Models, prompts: list[str], image_embeds: Tensor, n: int, seed: int, step: int
) -> Rollout:
    """``n`` samples per prompt with HF generate, seeded per step as the Rollout node seeds it."""
    policy, tokenizer = models.policy, models.policy.tokenizer
    prompts = [p for p in prompts for _ in range(n)]  # B = N * n, grouped
    image_embeds = image_embeds.repeat_interleave(n, 0)  # (B, D)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]  # (B, P), (B, P)
    embeds, mask = prompt_embeds(policy, prompt_ids, prompt_mask, image_embeds)  # (B, L, H)
    torch.random.default_generator.manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
    out = policy.lm.generate(
        inputs_embeds=embeds, attention_mask=mask, generation_config=models.generation
    )
    tokens = out.sequences  # (B, R): only the new tokens, with inputs_embeds
    logits = torch.stack(out.logits, dim=1).float()  # (B, R, V) raw logits of each step
    temperature = models.generation.temperature
    step_logprobs = torch.log_softmax(logits / temperature, -1)  # (B, R, V)
    step_logprobs = step_logprobs.gather(-1, tokens[..., None]).squeeze(-1)  # (B, R)
    # a response ends at its first EOS (kept); generate pads the rows that ended before others
    R = tokens.shape[1]
    is_eos = tokens == tokenizer.eos_token_id  # (B, R)
    lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, R)  # (B,)
    R = int(lengths.max())
    real = torch.arange(R)[None, :] < lengths[:, None]  # (B, R)
    response_ids = torch.where(real, tokens[:, :R], tokenizer.pad_token_id)  # (B, R)
    logprobs = torch.where(real, step_logprobs[:, :R], 0.0)  # (B, R)
    rows = [row[:k] for row, k in zip(tokens.tolist(), lengths.tolist())]
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    return Rollout(
        prompt_ids, prompt_mask, image_embeds, response_ids, real.float(), logprobs, texts
    )


# ---------------------------------------------------------------------------------------------
# rewards
# ---------------------------------------------------------------------------------------------


def rule_scores(texts: list[str], meta: list[dict], n: int) -> Tensor:
    meta = [m for m in meta for _ in range(n)]
    return torch.tensor([answer_reward(t, m) for t, m in zip(texts, meta)])  # (B,)


@torch.inference_mode()
def judge_scores(judge: Judge, texts: list[str], prompts: list[str], n: int) -> Tensor:
    """p(yes) renormalised over the score words, after the filled template; longest first."""
    prompts = [p for p in prompts for _ in range(n)]
    inputs = [DEFAULT_JUDGE_TEMPLATE.format(prompt=p, response=t) for p, t in zip(prompts, texts)]
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    scores = torch.zeros(len(inputs))  # (B,)
    for start in range(0, len(order), JUDGE_BATCH):
        rows = order[start : start + JUDGE_BATCH]
        enc = judge.tokenizer(
            [inputs[i] for i in rows],
            padding=True,
            truncation=True,
            max_length=judge.max_length,
            return_tensors="pt",
        )
        mask = enc["attention_mask"]  # (b, L) left-padded
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, L)
        out = judge.model(
            input_ids=enc["input_ids"],
            attention_mask=mask,
            position_ids=positions,
            logits_to_keep=1,
        )
        probs = out.logits[:, -1, judge.word_ids].float().softmax(-1)  # (b, W)
        scores[rows] = probs @ judge.word_values  # (b,)
    return scores  # (B,)


# ---------------------------------------------------------------------------------------------
# teacher-forced forwards: policy logits, reference logprobs, critic values
# ---------------------------------------------------------------------------------------------


def sequence(policy: PrefixVLM, ro: Rollout) -> tuple[Tensor, Tensor, Tensor]:
    """``[prefix | prompt | response]`` embeddings, mask and positions (padding skipped)."""
    prompt_emb, prompt_mask = prompt_embeds(
        policy, ro.prompt_ids, ro.prompt_mask, ro.image_embeds
    )  # (B, L, H), (B, L)
    real = ro.response_mask > 0  # (B, R)
    ids = torch.where(real, ro.response_ids, policy.pad_token_id)  # (B, R)
    embeds = torch.cat([prompt_emb, policy.lm.get_input_embeddings()(ids)], 1)  # (B, L+R, H)
    mask = torch.cat([prompt_mask, real.long()], 1)  # (B, L+R)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L+R)
    return embeds, mask, positions


def response_logits(policy: PrefixVLM, ro: Rollout) -> Tensor:
    """Logits that score each response token: ``logits[:, t]`` predicts ``response_ids[:, t]``."""
    embeds, mask, positions = sequence(policy, ro)
    R = ro.response_ids.shape[1]
    out = policy.lm(
        inputs_embeds=embeds,
        attention_mask=mask,
        position_ids=positions,
        logits_to_keep=R + 1,
        use_cache=False,
    )
    return out.logits[:, :-1]  # (B, R, V)


def token_logprobs(logits: Tensor, ro: Rollout, temperature: float) -> Tensor:
    if temperature != 1.0:
        logits = logits / temperature  # (B, R, V)
    real = ro.response_mask > 0  # (B, R)
    ids = torch.where(real, ro.response_ids, 0)  # (B, R)
    chosen = logits.gather(-1, ids[..., None]).squeeze(-1)  # (B, R)
    return torch.where(real, chosen - torch.logsumexp(logits, -1), 0.0)  # (B, R)


def token_entropy(logits: Tensor, ro: Rollout) -> Tensor:
    log_p = torch.log_softmax(logits, -1)  # (B, R, V)
    entropy = -(log_p.exp() * log_p).sum(-1)  # (B, R)
    return torch.where(ro.response_mask > 0, entropy, 0.0)  # (B, R)


@torch.no_grad()
def reference_logprobs(models: Models, ro: Rollout, temperature: float) -> Tensor:
    return token_logprobs(response_logits(models.reference, ro), ro, temperature)  # (B, R)


def critic_values(value_model: ValueModel, ro: Rollout) -> Tensor:
    """V(s_t): the value head on the trunk's last hidden state before each response token (the
    trunk alone: the LM head's logits are not needed)."""
    trunk = value_model.trunk
    embeds, mask, positions = sequence(trunk, ro)
    R = ro.response_ids.shape[1]
    hidden = trunk.lm.base_model(
        inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False
    ).last_hidden_state  # (B, L+R, H)
    values = value_model.head(hidden[:, -(R + 1) : -1]).squeeze(-1)  # (B, R)
    return torch.where(ro.response_mask > 0, values, 0.0)  # (B, R)


# ---------------------------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, 0.0).sum() / mask.sum()  # ()


def compute_gae(
    rewards: Tensor, values: Tensor, real: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Token-level GAE over right-padded responses; no bootstrap after the last token."""
    B, T = rewards.shape
    next_value = values.new_zeros(B)  # (B,)
    next_advantage = values.new_zeros(B)  # (B,)
    reversed_advantages = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        advantage = torch.where(real[:, t], delta + gamma * lam * next_advantage, 0.0)  # (B,)
        next_advantage = torch.where(real[:, t], advantage, next_advantage)  # (B,)
        next_value = torch.where(real[:, t], values[:, t], next_value)  # (B,)
        reversed_advantages.append(advantage)
    advantages = torch.stack(reversed_advantages[::-1], 1)  # (B, T)
    return advantages, torch.where(real, advantages + values, 0.0)  # (B, T), (B, T)


@torch.no_grad()
def gae_advantages(
    config: MultimodalPPOConfig, scores: Tensor, values: Tensor, ro: Rollout, ref: Tensor
) -> tuple[Tensor, Tensor]:
    """KL-shaped rewards (k1, score on the last token), GAE, whitened advantages."""
    real = ro.response_mask > 0  # (B, R)
    kl = torch.where(real, ro.logprobs - ref, 0.0)  # (B, R)
    positions = torch.arange(real.shape[1]).expand_as(real)  # (B, R)
    last = torch.where(real, positions, -1).amax(1)  # (B,)
    rewards = torch.where(real, -config.kl_coef * kl, 0.0)  # (B, R)
    rewards = rewards + torch.where(positions == last[:, None], scores[:, None], 0.0)  # (B, R)
    values = torch.where(real, values, 0.0)  # (B, R)
    advantages, returns = compute_gae(rewards, values, real, config.gamma, config.lam)
    mean = masked_mean(advantages, real)  # ()
    var = torch.where(real, (advantages - mean) ** 2, 0.0).sum() / (real.sum() - 1)  # ()
    advantages = torch.where(real, (advantages - mean) * torch.rsqrt(var + 1e-8), 0.0)  # (B, R)
    return advantages, returns


@torch.no_grad()
def group_advantages(scores: Tensor, ro: Rollout, group_size: int) -> Tensor:
    """GRPO: each score against its group's mean and unbiased std, spread over its tokens."""
    grouped = scores.view(-1, group_size)  # (N, G)
    deviation = grouped - grouped.sum(1, keepdim=True) / group_size  # (N, G)
    std = torch.sqrt((deviation**2).sum(1, keepdim=True) / (group_size - 1))  # (N, 1)
    advantages = (deviation / (std + 1e-6)).view(-1)  # (B,)
    return torch.where(ro.response_mask > 0, advantages[:, None], 0.0)  # (B, R)


# ---------------------------------------------------------------------------------------------
# updates
# ---------------------------------------------------------------------------------------------


def clipped_surrogate(logprobs: Tensor, old: Tensor, advantages: Tensor, real: Tensor) -> Tensor:
    """Per-token PPO clip loss: max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))."""
    ratio = torch.exp(torch.where(real, logprobs - old, 0.0))  # (B, R)
    unclipped = -advantages * ratio  # (B, R)
    clipped = -advantages * torch.clamp(ratio, 1.0 - CLIP_EPS, 1.0 + CLIP_EPS)  # (B, R)
    return torch.maximum(unclipped, clipped)  # (B, R)


def seq_mean_token_mean(x: Tensor, real: Tensor) -> Tensor:
    tokens = real.sum(1)  # (B,)
    per_seq = torch.where(real, x, 0.0).sum(1) / tokens.clamp(min=1)  # (B,)
    return per_seq.sum() / (tokens > 0).sum()  # ()


def optimizer_step(
    pairs: list[tuple[torch.optim.Optimizer, list[nn.Parameter]]],
) -> None:
    for optimizer, params in pairs:
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()


def ppo_update(
    config: MultimodalPPOConfig,
    models: Models,
    ro: Rollout,
    advantages: Tensor,
    returns: Tensor,
    old_values: Tensor,
) -> None:
    """``epochs`` AdamW steps on the policy and the value model, the whole batch each."""
    policy, value_model = models.policy, models.value_model
    assert value_model is not None and models.critic_optimizer is not None
    real = ro.response_mask > 0  # (B, R)
    pairs = [
        (models.optimizer, list(policy.parameters())),
        (models.critic_optimizer, list(value_model.parameters())),
    ]
    for _ in range(config.epochs):
        models.optimizer.zero_grad(set_to_none=True)
        models.critic_optimizer.zero_grad(set_to_none=True)
        logits = response_logits(policy, ro)  # (B, R, V)
        if config.temperature != 1.0:
            logits = logits / config.temperature  # (B, R, V)
        logprobs = token_logprobs(logits, ro, 1.0)  # (B, R)
        pg_loss = masked_mean(clipped_surrogate(logprobs, ro.logprobs, advantages, real), real)
        entropy = masked_mean(token_entropy(logits, ro), real)  # ()
        values = critic_values(value_model, ro)  # (B, R)
        clipped = old_values + torch.clamp(values - old_values, -VALUE_CLIP_EPS, VALUE_CLIP_EPS)
        vf_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
        vf_loss = masked_mean(vf_token, real)  # ()
        loss = pg_loss + VF_COEF * vf_loss - config.entropy_coef * entropy  # ()
        loss.backward()
        optimizer_step(pairs)
    models.optimizer.zero_grad(set_to_none=True)
    models.critic_optimizer.zero_grad(set_to_none=True)


def grpo_update(
    config: GRPOConfig, models: Models, ro: Rollout, advantages: Tensor, ref: Tensor
) -> None:
    """``epochs`` AdamW steps on the policy: clip loss + k3 KL to the reference - entropy."""
    policy = models.policy
    real = ro.response_mask > 0  # (B, R)
    pairs = [(models.optimizer, list(policy.parameters()))]
    for _ in range(config.epochs):
        models.optimizer.zero_grad(set_to_none=True)
        logits = response_logits(policy, ro)  # (B, R, V)
        if config.temperature != 1.0:
            logits = logits / config.temperature  # (B, R, V)
        logprobs = token_logprobs(logits, ro, 1.0)  # (B, R)
        pg_loss = seq_mean_token_mean(
            clipped_surrogate(logprobs, ro.logprobs, advantages, real), real
        )  # ()
        log_ratio = torch.where(real, logprobs - ref, 0.0)  # (B, R) log pi/pi_ref
        kl = seq_mean_token_mean(torch.exp(-log_ratio) - 1 + log_ratio, real)  # () k3
        entropy = seq_mean_token_mean(token_entropy(logits, ro), real)  # ()
        loss = pg_loss + config.kl_coef * kl - config.entropy_coef * entropy  # ()
        loss.backward()
        optimizer_step(pairs)
    models.optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------


class Phases:
    """Seconds per phase of the current step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


def train_step(
    config: RLConfig, models: Models, step: int, group_size: int, phase: Phases
) -> Tensor:
    """One step of the workload; returns the scores (B,)."""
    with phase("data"):
        images, prompts, meta = sample_batch(config, step)
    with phase("vision"):
        image_embeds = encode_images(models, images)  # (N, D)
    with phase("rollout"):
        ro = rollout(models, prompts, image_embeds, group_size, config.seed, step)
    with phase("reward"):
        if models.judge is not None:
            scores = judge_scores(models.judge, ro.texts, prompts, group_size)  # (B,)
        else:
            scores = rule_scores(ro.texts, meta, group_size)  # (B,)
    with phase("reference"):
        ref = reference_logprobs(models, ro, config.temperature)  # (B, R)
    if isinstance(config, MultimodalPPOConfig):
        assert models.value_model is not None
        with phase("critic"), torch.no_grad():
            values = critic_values(models.value_model, ro)  # (B, R)
        with phase("advantage"):
            advantages, returns = gae_advantages(config, scores, values, ro, ref)  # (B, R)
        with phase("update"):
            ppo_update(config, models, ro, advantages, returns, values)
    else:
        assert isinstance(config, GRPOConfig)
        with phase("advantage"):
            advantages = group_advantages(scores, ro, group_size)  # (B, R)
        with phase("update"):
            grpo_update(config, models, ro, advantages, ref)
    return scores


def openmp_setting() -> str:
    """The OpenMP variables in this process's environment (libgomp read them at torch's load)."""
    names = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    found = [f"{k}={os.environ[k]}" for k in names if k in os.environ]
    return ", ".join(found) or "libgomp defaults"


def run_floor(
    workload: str, steps: int, warmup: int, seed: int = 0, threads: int | None = None
) -> dict[str, Any]:
    """Train ``workload`` ("a" or "b") for ``steps`` steps; the figures ``main`` prints.

    ``threads``: torch's thread count; None takes one per core this process may use.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: choose one of {sorted(WORKLOADS)}")
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup={warmup}, steps={steps}: need 0 <= warmup < steps")
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    spec = WORKLOADS[workload]
    config = spec["config"](**spec["options"], seed=seed)
    models = build_models(config, spec["judge"])
    step_seconds: list[float] = []
    rewards: list[float] = []
    phases: dict[str, list[float]] = defaultdict(list)
    samples = 0
    for step in range(steps):
        phase = Phases()
        start = time.perf_counter()
        scores = train_step(config, models, step, spec["group_size"], phase)
        step_seconds.append(time.perf_counter() - start)
        rewards.append(float(scores.mean()))
        samples = len(scores)
        for name, seconds in phase.seconds.items():
            phases[name].append(seconds)
    step_s = statistics.median(step_seconds[warmup:])
    window = max(1, steps // 4)
    return {
        "workload": workload,
        "steps": steps,
        "warmup": warmup,
        "seed": seed,
        "step_s": step_s,
        "rollout_s": statistics.median(phases["rollout"][warmup:]),
        "samples_per_s": samples / step_s,
        "reward_first": statistics.mean(rewards[:window]),
        "reward_last": statistics.mean(rewards[-window:]),
        "threads": torch.get_num_threads(),
        "openmp": openmp_setting(),
        "load_average": load_average(),
        "phases_s": {name: statistics.median(v[warmup:]) for name, v in phases.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="a")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as bench/e2e.py runs the CLI
    transformers.logging.set_verbosity_error()  # stdout carries the JSON; keep stderr short
    result = run_floor(args.workload, args.steps, args.warmup, args.seed, args.threads)
    rows = [[name, f"{1000 * s:.2f}"] for name, s in result["phases_s"].items()]
    rows.append(["step", f"{1000 * result['step_s']:.2f}"])
    print(f"machine: {machine()}", file=sys.stderr)
    print(table(["phase", "median ms"], rows), file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
