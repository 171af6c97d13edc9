"""The ready graphs really learn: a short seeded run on the CPU, last window vs first window.

A seeded run's trajectory differs from CPU to CPU (their float kernels round differently), so
each bar is at most half the smallest rise measured over seeds 0-4 on two CPUs (150 steps,
20-step windows, one torch thread, the default kl_coef=0.05):

* mm_ppo: AMD EPYC first 0.16-0.17 -> last 0.75-0.92; Intel Xeon 0.156-0.170 -> 0.731-0.943
  (rises 0.561-0.783): the bar is a rise of 0.25;
* mm_grpo: AMD EPYC 0.21-0.23 -> 0.62-0.91 (rises from 0.39); Intel Xeon 0.212-0.233 ->
  0.707-0.840 (rises 0.474-0.616): the bar is 0.19.

An image-blind policy that always names a colour scores 0.4; every last window measured was
at least 0.62, so the last window must also beat 0.5.

text_agent (300 steps, the look task: an answer counts only after a look), AMD EPYC, seeds
0-4: the first window 0.002-0.005 -> the last 0.917-0.938 (rises from 0.91), the share of
trajectories that look 0.059-0.087 -> 0.953-0.968: the bars are a rise of 0.45 and a look rate
above 0.5.
"""

import pytest

from runtime import LocalExecutor
from yatt_graph.refs import load_graph

STEPS, WINDOW = 150, 20


def window_means(graph: str, seed: int) -> tuple[float, float]:
    executor = LocalExecutor(load_graph(graph, seed=seed))
    rewards = [float(executor.step().outputs["scores"].mean()) for _ in range(STEPS)]
    return sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("graph", "rise"), [("graphs.mm_ppo", 0.25), ("graphs.mm_grpo", 0.19)])
def test_reward_of_the_last_window_beats_the_first(graph, rise):
    first, last = window_means(graph, seed=0)
    assert first < 0.3  # measured at most 0.233
    assert last > first + rise
    assert last > 0.5  # above the 0.4 of a policy that ignores the image


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_agent_learns_to_use_its_tool():
    executor = LocalExecutor(load_graph("graphs.text_agent", seed=0))
    steps = [executor.step().outputs for _ in range(300)]
    reward = [float(out["scores"].mean()) for out in steps]
    looks = [out["agent"]["tool_use_rate"] for out in steps]
    first, last = sum(reward[:WINDOW]) / WINDOW, sum(reward[-WINDOW:]) / WINDOW
    assert first < 0.1  # measured at most 0.005: a guess scores 0
    assert last > first + 0.45
    assert sum(looks[-WINDOW:]) / WINDOW > 0.5 > sum(looks[:WINDOW]) / WINDOW
