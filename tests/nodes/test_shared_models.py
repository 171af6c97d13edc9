"""One policy / value model for nodes with the same share key (nodes/shared_models.py):
exact (bitwise) on an on-policy in-process run, off when the executor lets weights lag."""

from __future__ import annotations

import math

import torch

import graphs.mm_grpo as mm_grpo
import graphs.mm_ppo as mm_ppo
import graphs.text_grpo as text_grpo
from nodes.shared_models import Sharing, same_storage
from runtime.engine.engine import LocalExecutor


def _run(module, steps: int, *, share: bool, max_staleness: int = 0, **options):
    graph = module.build_graph(batch_size=4, **options)
    if not share:  # as an executor that never offers a registry: every node its own copy
        for node in graph.nodes.values():
            if isinstance(node, Sharing):
                node.bind_executor = lambda **_: None
    ex = LocalExecutor(graph, max_staleness=max_staleness)
    results = ex.run(steps)
    return ex.graph.nodes, [(r.outputs["scores"], r.outputs["metrics"]) for r in results]


def _assert_same(a, b) -> None:
    assert len(a) == len(b)
    for (scores_a, metrics_a), (scores_b, metrics_b) in zip(a, b):
        assert torch.equal(scores_a, scores_b)
        assert metrics_a.keys() == metrics_b.keys()
        for k, v in metrics_a.items():
            w = metrics_b[k]
            assert v == w or (math.isnan(v) and math.isnan(w)), (k, v, w)


def test_mm_ppo_shares_policy_and_critic_bitwise_equal():
    nodes, shared = _run(mm_ppo, 3, share=True)
    own, separate = _run(mm_ppo, 3, share=False)
    assert nodes["rollout"].policy is nodes["ppo"].policy
    assert nodes["critic"].value_model is nodes["ppo"].value_model
    assert nodes["reference"].policy is not nodes["ppo"].policy  # no LoRA: a frozen copy
    assert own["rollout"].policy is not own["ppo"].policy
    assert own["critic"].value_model is not own["ppo"].value_model
    _assert_same(shared, separate)
    # the weight edge still counts versions, though nothing was copied
    assert nodes["rollout"].weights_version == own["rollout"].weights_version == 2
    assert nodes["critic"].weights_version == own["critic"].weights_version == 2


def test_mm_grpo_shares_policy_bitwise_equal():
    nodes, shared = _run(mm_grpo, 3, share=True, group_size=2)
    own, separate = _run(mm_grpo, 3, share=False, group_size=2)
    assert nodes["rollout"].policy is nodes["grpo"].policy
    assert own["rollout"].policy is not own["grpo"].policy
    _assert_same(shared, separate)
    assert nodes["rollout"].weights_version == 2


def test_staleness_turns_sharing_off():
    nodes, lagged = _run(mm_grpo, 3, share=True, max_staleness=1, group_size=2)
    assert nodes["rollout"].policy is not nodes["grpo"].policy
    _, own = _run(mm_grpo, 3, share=False, max_staleness=1, group_size=2)
    _assert_same(lagged, own)


def test_lora_reference_reads_the_shared_base():
    """A causal LM with LoRA trains only its adapters: the reference is its frozen base."""
    options = {"policy": "tiny-gpt2", "group_size": 2, "lora_r": 4, "lora_targets": "c_attn"}
    nodes, shared = _run(text_grpo, 2, share=True, **options)
    own, separate = _run(text_grpo, 2, share=False, **options)
    assert nodes["grpo"].policy.has_lora
    assert nodes["reference"].policy is nodes["grpo"].policy and nodes["reference"].base_shared
    assert own["reference"].policy is not own["grpo"].policy
    _assert_same(shared, separate)


def test_lora_prefix_vlm_reference_keeps_a_copy():
    """A prefix-VLM's projector trains beside its adapters: the base drifts, so no."""
    options = {"group_size": 2, "lora_r": 4, "lora_targets": "c_attn"}
    nodes, shared = _run(mm_grpo, 2, share=True, **options)
    _, separate = _run(mm_grpo, 2, share=False, **options)
    assert nodes["rollout"].policy is nodes["grpo"].policy
    assert nodes["reference"].policy is not nodes["grpo"].policy
    assert not nodes["reference"].base_shared
    _assert_same(shared, separate)


def test_same_storage():
    lin = torch.nn.Linear(2, 2)
    live = {k: v.detach() for k, v in lin.state_dict().items()}
    assert same_storage(lin, live)
    assert not same_storage(lin, {k: v.clone() for k, v in live.items()})
    assert not same_storage(lin, {})
