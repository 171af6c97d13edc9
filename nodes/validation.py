"""Validation on a held-out dataset, every K steps, with the policy being trained.

:class:`GreedyValidation` keeps its own copy of the policy, loads every weight update the
rollout loads (same ``weights`` edge, same delay), and on every ``every``-th call decodes the
first ``rows`` rows of its dataset greedily (temperature 0) and scores them with the run's
reward. Its output ``val`` is ``{"reward": mean, "samples": n, "response_length": mean}`` on
those calls and ``{}`` on the others, so the metrics hold ``val/reward`` every K steps.

With ``samples`` k > 1 each row also gets k sampled responses (at ``temperature`` and
``top_p``), and ``val`` is ``{"greedy": the greedy responses' mean reward, "avg@k": the mean
reward of the k samples averaged over the rows, "pass@k": the share of rows where a sample
succeeds (a reward >= ``pass_threshold``), "samples": rows, "response_length": the samples'
mean}``, named with the actual k (``avg@4``). pass@k is the unbiased estimator of Chen et al.
2021 (:func:`pass_at_k`) with n = k samples, where it is exactly "any of the k succeeds".

Validation reads its data in file order and never touches the training data's position. Its
samples are drawn from one random stream seeded by ``seed`` on every pass, so its figures are
the same for the same weights, and two passes differ by the weights alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nodes.models.policy import build_policy, check_policy_spec
from nodes.models.prompts import fit_prompts
from nodes.models.sampling import sampling_problem
from nodes.seeding import seeded
from nodes.sync import decode_weights
from yatt_graph import ANY, Node, Port
from yatt_graph.node import Built

__all__ = ["GreedyValidation", "pass_at_k"]

_IMAGES = ("none", "images", "image_embeds")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` succeed (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code"): ``1 - C(n - c, k) / C(n, k)``,
    the chance that k of the n samples drawn without replacement hold a success."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class GreedyValidation(Node):
    """Every ``every`` calls: greedy responses to the first ``rows`` rows of ``data``, scored;
    with ``samples`` > 1 also that many sampled responses a row (avg@k and pass@k).

    Args:
        policy: the policy spec the rollout was built from (same spec: same initial weights).
        data: a local dataset (the forms :class:`nodes.datasets.DatasetSource` reads).
        reward: the run's reward, in the spellings of :func:`nodes.rewards.reward_from_option`.
        every: validate on calls 0, every, 2 * every, ...
        rows: how many rows (the first ones) each pass scores; fewer if the set is smaller.
        batch_size: rows decoded together.
        max_new_tokens: the longest response.
        max_prompt_tokens: as the rollout's (a longer prompt keeps its last this many tokens).
        stop: stop strings, as the rollout's (a response ends with the token that completes one).
        micro_batch_tokens: the reward's token budget, as the run's reward node has it.
        image_input: ``"none"`` (text), ``"images"`` (an HF VLM reads them) or
            ``"image_embeds"`` (a prefix-VLM: ``vision`` encodes them).
        vision: :class:`nodes.vision.VisionEncoder` keyword arguments (with image_embeds).
        keys: ``{"prompt_key": ..., "image_key": ..., "answer_key": ...}`` of the data.
        on_bad_sample: passed to the reward and the data (raise or skip).
        device: where the policy runs.
        samples: k, the sampled responses a row (>= 1); 1: the greedy response alone.
        temperature, top_p: how those k are sampled (temperature 0: greedily).
        pass_threshold: a sampled response succeeds (pass@k) when its reward is at least this.
        seed: the seed of every pass's samples.
    """

    kind = "validation"
    inputs = {"weights": Port(ANY, required=False, doc="a WeightUpdate, as the rollout loads")}  # noqa: RUF012
    outputs = {  # noqa: RUF012
        "val": Port(
            ANY,
            doc="{'reward', 'samples', 'response_length'}, with samples k > 1 "
            "{'greedy', 'avg@k', 'pass@k', 'samples', 'response_length'}; or {}",
        )
    }
    policy = Built("the policy copy that decodes the validation rows")
    encoder = Built("the vision tower (image_embeds), or None")

    def __init__(
        self,
        policy: str | Mapping[str, Any],
        data: str,
        reward: str,
        *,
        every: int = 10,
        rows: int = 64,
        batch_size: int = 16,
        max_new_tokens: int = 16,
        max_prompt_tokens: int | None = None,
        stop: Sequence[str] = (),
        micro_batch_tokens: int = 0,
        image_input: str = "none",
        vision: Mapping[str, Any] | None = None,
        keys: Mapping[str, str] | None = None,
        on_bad_sample: str = "raise",
        device: str = "cpu",
        samples: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        pass_threshold: float = 1.0,
        seed: int = 0,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        counts = (
            ("every", every),
            ("rows", rows),
            ("batch_size", batch_size),
            ("samples", samples),
        )
        for option, value in counts:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"node {self.name!r}: {option} must be an int >= 1, got {value!r}")
        if why := sampling_problem(temperature, top_p, 0):
            raise ValueError(f"node {self.name!r}: the samples' {why}")
        if not math.isfinite(pass_threshold):
            raise ValueError(
                f"node {self.name!r}: pass_threshold must be a finite reward, got {pass_threshold}"
            )
        if image_input not in _IMAGES:
            raise ValueError(f"node {self.name!r}: image_input must be one of {_IMAGES}")
        if image_input == "image_embeds" and not vision:
            raise ValueError(f"node {self.name!r}: image_input='image_embeds' needs vision=")
        check_policy_spec(policy)
        self.policy_spec = dict(policy) if isinstance(policy, Mapping) else policy
        self.every, self.rows, self.batch_size = every, rows, batch_size
        self.max_new_tokens, self.image_input = max_new_tokens, image_input
        self.max_prompt_tokens = max_prompt_tokens
        if isinstance(stop, str):
            raise ValueError(f"node {self.name!r}: stop must be a list of strings, got {stop!r}")
        self.stop = [str(x) for x in stop]
        self.vision = dict(vision or {})
        self.device = device
        self.samples, self.temperature, self.top_p = samples, float(temperature), float(top_p)
        self.pass_threshold, self.seed = float(pass_threshold), int(seed)
        self.calls = 0
        from nodes.datasets import DatasetSource
        from nodes.rewards import reward_from_option

        self.source = DatasetSource(
            data,
            batch_size=rows,
            seed=0,
            shuffle=False,
            images="auto" if image_input != "none" else False,
            on_bad_sample=on_bad_sample,
            name=f"{self.name}_data",
            **dict(keys or {}),
        )
        self.reward = reward_from_option(
            reward, on_bad_sample=on_bad_sample, name=f"{self.name}_reward",
            micro_batch_tokens=micro_batch_tokens, device=device,
        )  # fmt: skip

    def build(self) -> None:
        self.policy = build_policy(self.policy_spec).to(self.device).eval()
        self.source.setup()
        self.reward.setup()
        self.encoder = None
        if self.image_input == "image_embeds":
            from nodes.vision import VisionEncoder

            self.encoder = VisionEncoder(
                **self.vision, device=self.device, name=f"{self.name}_vision"
            )
            self.encoder.setup()
        self._start = self.source.state_dict()

    def forward(self, weights: Any = None) -> dict[str, Any]:
        if weights is not None:
            update = decode_weights(weights)
            self.policy.load_weights(
                update.weights, strict=update.complete, who=f"node {self.name!r}"
            )
        call, self.calls = self.calls, self.calls + 1
        if call % self.every:
            return {"val": {}}
        return {"val": self.evaluate()}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Score the first ``rows`` rows: the figures of one pass."""
        self.source.load_state_dict(self._start)
        data = self.source.forward()
        prompts, images, meta = data["prompts"], data["images"], data["meta"]
        n = len(prompts)
        texts, lengths = self._decode(prompts, images, temperature=0.0, top_p=1.0)
        scores = self._score(texts, prompts, images, meta)  # (n,)
        greedy = float(scores.float().mean()) if n else 0.0
        if self.samples == 1:
            return {
                "reward": greedy,
                "samples": float(n),
                "response_length": sum(lengths) / n if n else 0.0,
            }
        k = self.samples
        rows = [i for i in range(n) for _ in range(k)]  # each row k times, in a row
        many_prompts = [prompts[i] for i in rows]
        many_images = None if images is None else [images[i] for i in rows]
        with seeded(self.seed, self.device):
            texts, lengths = self._decode(many_prompts, many_images, self.temperature, self.top_p)
        scores = self._score(texts, many_prompts, many_images, [meta[i] for i in rows])
        scores = scores.float().reshape(n, k)  # (n, k)
        successes = (scores >= self.pass_threshold).sum(1).tolist()  # (n,) per row
        passed = [pass_at_k(k, int(c), k) for c in successes]
        return {
            "greedy": greedy,
            f"avg@{k}": float(scores.mean(1).mean()) if n else 0.0,
            f"pass@{k}": sum(passed) / n if n else 0.0,
            "samples": float(n),
            "response_length": sum(lengths) / len(lengths) if lengths else 0.0,
        }

    def _decode(
        self, prompts: list[str], images: Any, temperature: float, top_p: float
    ) -> tuple[list[str], list[int]]:
        """Responses to ``prompts`` (and their ``images``), ``batch_size`` at a time: the texts
        and their lengths in tokens."""
        texts: list[str] = []
        lengths: list[int] = []
        for start in range(0, len(prompts), self.batch_size):
            part = slice(start, start + self.batch_size)
            image_kwargs: dict[str, Any] = {}
            if self.image_input == "images":
                image_kwargs["images"] = images[part]
            elif self.image_input == "image_embeds":
                image_kwargs["image_embeds"] = self.encoder.encode(images[part])
            batch = self.policy.encode_prompts(prompts[part], **image_kwargs)
            batch = fit_prompts(
                self.policy, batch, prompts[part], max_new_tokens=self.max_new_tokens,
                max_prompt_tokens=self.max_prompt_tokens, who=f"node {self.name!r}",
            )  # fmt: skip
            out = self.policy.generate(
                batch, max_new_tokens=self.max_new_tokens, temperature=temperature,
                top_p=top_p, stop_strings=self.stop,
            )  # fmt: skip
            texts += out.texts
            lengths += out.response_lengths.tolist()
        return texts, lengths

    def _score(self, texts: list[str], prompts: list[str], images: Any, meta: list[Any]) -> Any:
        """The run's reward of each response: a (len(texts),) tensor."""
        score_kwargs: dict[str, Any] = {"texts": texts, "meta": meta}
        if getattr(self.reward, "needs_prompts", False):
            score_kwargs["prompts"] = prompts
        if getattr(self.reward, "needs_images", False):
            score_kwargs["images"] = images
        return self.reward.forward(**score_kwargs)["scores"]

    def state_dict(self) -> dict[str, Any]:
        """The call counter; the weights come from ``policy`` and the ``weights`` edge, as the
        rollout's do."""
        return {"calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.calls = int(state["calls"])
