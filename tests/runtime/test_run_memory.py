"""A run of many steps holds none of its steps' outputs once they are recorded: its memory
does not grow with its length (each result goes to the training loop's ``on_step`` and is
let go), in process and on controllers alike."""

from __future__ import annotations

import gc
import weakref

import pytest

from runtime import LocalExecutor
from runtime.train.loop import Accounting, train
from yatt_graph.refs import load_graph


class Watched:
    """An executor whose every step's ``scores`` (a tensor) is watched through a weak
    reference: ``most_alive`` is the most of them alive at once, seen before each step."""

    def __init__(self, executor):
        self.executor, self.refs, self.most_alive = executor, [], 0

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def look(self, result) -> None:
        gc.collect()
        alive = sum(ref() is not None for ref in self.refs)
        self.most_alive = max(self.most_alive, alive)
        self.refs.append(weakref.ref(result.outputs["scores"]))


def test_a_training_run_holds_no_earlier_steps_outputs(tmp_path):
    watched = Watched(LocalExecutor(load_graph("graphs.toy", seed=2)))
    step = watched.executor.step

    def watched_step():
        result = step()
        watched.look(result)
        return result

    watched.executor.step = watched_step
    rows = train(Accounting(watched.executor), 15, tmp_path, progress=False)
    assert len(rows) == 15
    # The step being recorded may be alive when the next one starts; none before it (a run
    # that kept its results had 14 alive by its last step).
    assert watched.most_alive <= 1, watched.most_alive


@pytest.mark.timeout(120)
def test_a_run_on_controllers_hands_each_result_on_and_keeps_none():
    from runtime.zmq.driver import ZmqExecutor

    with ZmqExecutor(load_graph("graphs.toy", seed=2).plan(2)) as ex:
        watched = Watched(ex)
        seen = []

        def on_step(result):
            watched.look(result)
            seen.append(result.step)

        assert ex.run(8, on_step=on_step) == []
        assert seen == list(range(8))
        assert watched.most_alive <= 1, watched.most_alive
        kept = ex.run(2)  # without on_step, the results are returned
        assert [r.step for r in kept] == [8, 9]
