"""The toy RLHF graph: a CPU-only workflow with the shape of the real ones, runs in seconds.

yatt-graph run graphs/toy.py --steps 30
yatt-graph viz graphs/toy.py -o toy.svg
"""

from __future__ import annotations

from nodes.toy import FakeEncoder, MatchReward, ToyRollout, ToySource, ToyUpdate, normalize
from yatt_graph import Graph

__all__ = ["build_graph"]


def build_graph(batch_size: int = 16, vocab: int = 8, seed: int = 0) -> Graph:
    """source -> encoder -> rollout -> reward -> advantage -> update, weights fed back next step."""
    with Graph("toy_rlhf") as g:
        batch = ToySource(batch_size=batch_size, classes=4, seed=seed, name="source")()
        emb = FakeEncoder(seed=seed, name="encoder")(batch.images)
        rollout = ToyRollout(vocab=vocab, seed=seed, name="rollout")
        sample = rollout(emb)
        scores = MatchReward(vocab=vocab, name="reward")(sample.tokens, batch.labels)
        adv = normalize(scores, name="advantage")
        update = ToyUpdate(vocab=vocab, seed=seed, name="update")(
            emb, sample.tokens, sample.logprobs, adv
        )
        g.connect(update.weights, rollout, "weights", delay=1)
        g.output("scores", scores)
        g.output("metrics", update.metrics)
    return g
