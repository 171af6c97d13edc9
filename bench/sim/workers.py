"""The batching scheduler's device workers: which micro-batch a device takes next (placement
groups and their barrier), switch costs, running a node call, streaming its chunks downstream
and gathering them back in order (steps 4 and 5 of :mod:`bench.sim.scheduler`)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterable, Mapping
from typing import Any

from bench.sim.requests import (
    Chunk,
    SchedulerError,
    _Link,
    _merge_outputs,
    _Node,
    _oldest,
    _per_sample,
    _Request,
    _Root,
    _Work,
)
from runtime.sched.batching import batch_size, sample_costs, take
from runtime.sched.devices import Slot

__all__: list[str] = []


class _Workers:
    """The device half of :class:`~bench.sim.scheduler.Scheduler` (a mixin: the state is the
    scheduler's)."""

    # --- internals: workers ------------------------------------------------------------------
    def _pick(self, dev: Slot) -> _Work | None:
        served = [self._nodes[n] for n in self._served[dev.name]]
        ready = [st for st in served if st.ready]
        if not ready:
            return None
        group = self._barrier_of[dev.name]
        if group is not None:
            active = self._active[group]
            if active is None or not self._nodes[active].busy():
                active = self._active[group] = _oldest(ready).name
            st = self._nodes[active]
            return st.ready.popleft() if st.ready else None
        role = self._role[dev.name]
        mine = [st for st in ready if st.name == role]
        return (mine[0] if mine else _oldest(ready)).ready.popleft()

    def _worker_loop(self, dev: Slot) -> None:
        self._init_worker(dev)
        while True:
            with self._cond:
                work = None
                while not self._stopping and (work := self._pick(dev)) is None:
                    self._cond.wait()
                if work is None:
                    return
                self._cond.notify_all()  # the dispatcher may be holding a batch for a free device
                st = self._nodes[work.node]
                st.running += 1
                st.calls += 1
                start = time.monotonic()
                for t in work.arrivals:
                    st.wait_sum += start - t
                    st.wait_max = max(st.wait_max, start - t)
                st.wait_n += len(work.arrivals)
                old, self._role[dev.name] = self._role[dev.name], work.node
            try:
                if old is not None and old != work.node:
                    self._switch(dev, old, work.node)
                with self.pool.busy(dev, work.node):
                    self._execute(st, dev, work)
            except Exception as exc:
                err = SchedulerError(
                    f"node {work.node!r} failed on {dev.name} for {len(work.origin)} sample(s) "
                    f"(requests {sorted({r.id for r, _ in work.origin})}): {type(exc).__name__}: "
                    f"{exc}\n--- original traceback ---\n{traceback.format_exc()}",
                    work.node,
                    dev.name,
                )
                err.__cause__ = exc
                for root, _ in work.origin:
                    self._fail_root(root, err)
            finally:
                with self._cond:
                    st.running -= 1
                    self._cond.notify_all()

    def _init_worker(self, dev: Slot) -> None:
        import torch

        if dev.kind == "cuda":
            torch.cuda.set_device(dev.index)
        elif self.threads_per_worker:
            torch.set_num_threads(self.threads_per_worker)

    def _switch(self, dev: Slot, old: str, new: str) -> None:
        cost = self.placement.switch_cost_s if self.placement is not None else 0.0
        if not cost and self.on_switch is None:
            return
        with self.pool.switching(dev, new):
            if self.on_switch is not None:
                self.on_switch(dev, old, new)
            if cost:
                time.sleep(cost)  # a modelled offload/reload: the device can do nothing else

    def _fail_root(self, root: _Root, exc: BaseException) -> None:
        root.fail(exc)
        with self._cond:
            self._live.pop(root.id, None)

    def _execute(self, st: _Node, dev: Slot, work: _Work) -> None:
        n = len(work.origin)
        result = st.fn(work.inputs, dev)
        if not st.streaming:
            self._publish(st, work, list(range(n)), result)
            return
        if isinstance(result, Mapping) or not isinstance(result, Iterable):
            raise TypeError(
                f"node {st.name!r} is streaming but returned {type(result).__name__}; yield "
                "(rows, outputs) pairs, or add it with streaming=False"
            )
        done: set[int] = set()
        for item in result:
            try:
                rows, outputs = item
                rows = [int(r) for r in rows]
            except (TypeError, ValueError):
                raise TypeError(
                    f"node {st.name!r} yielded {type(item).__name__}; a streaming node yields "
                    "(rows, outputs) with rows = positions in its input batch"
                ) from None
            bad = [r for r in rows if not 0 <= r < n or r in done]
            if bad:
                raise ValueError(
                    f"node {st.name!r} yielded rows {bad}: out of range 0..{n - 1} or yielded twice"
                )
            done.update(rows)
            self._publish(st, work, rows, outputs)
        if len(done) != n:
            missing = sorted(set(range(n)) - done)
            raise ValueError(
                f"node {st.name!r} finished without yielding rows {missing[:10]} of its {n}"
            )

    def _publish(self, st: _Node, work: _Work, rows: list[int], outputs: Any) -> None:
        if not isinstance(outputs, Mapping):
            raise TypeError(
                f"node {st.name!r} returned {type(outputs).__name__}; return a dict of outputs"
            )
        outputs = dict(outputs)
        # Outputs with nothing per sample (metrics only) are fine; per-sample ones must match.
        got = (
            batch_size(outputs, where=f"node {st.name!r}: outputs")
            if any(_per_sample(v) for v in outputs.values())
            else len(rows)
        )
        if got != len(rows):
            raise ValueError(
                f"node {st.name!r} returned outputs for {got} samples, expected {len(rows)}"
            )
        by_root: dict[int, tuple[_Root, list[int], list[int]]] = {}
        for pos, r in enumerate(rows):
            root, row = work.origin[r]
            by_root.setdefault(root.id, (root, [], []))
            by_root[root.id][1].append(pos)
            by_root[root.id][2].append(row)
        for root, positions, root_rows in by_root.values():
            if root.failed is not None:
                continue
            whole = len(positions) == len(rows)
            chunk_out = outputs if whole else take(outputs, positions)
            chunk_in = (
                take(work.inputs, [rows[p] for p in positions], st.shared)
                if self._subscribers.get(st.name) or any(link.carry for link in st.downstream)
                else {}
            )
            chunk = Chunk(st.name, root.id, root_rows, chunk_out, chunk_in)
            for cb in self._subscribers.get(st.name, ()):
                cb(chunk)
            if st.name in root.futures:
                self._gather(st, root, chunk)
            for link in st.downstream:
                self._forward(st, link, chunk, root)

    def _forward(self, st: _Node, link: _Link, chunk: Chunk, root: _Root) -> None:
        dst = self._nodes[link.dst]
        try:
            ports = link.ports or {p: p for p in chunk.outputs}
            inputs = {d: chunk.outputs[s] for s, d in ports.items()}
            inputs.update({d: chunk.inputs[s] for s, d in link.carry.items()})
            inputs.update(link.constants)
            costs = sample_costs(inputs, dst.cost, where=f"node {dst.name!r}")
        except KeyError as exc:
            raise ValueError(
                f"connect {st.name!r} -> {dst.name!r}: port {exc} is not among "
                f"{st.name!r}'s outputs {sorted(chunk.outputs)} / inputs {sorted(chunk.inputs)}"
            ) from None
        with self._cond:
            self._enqueue(dst, _Request(root, chunk.rows, inputs, costs, time.monotonic()))

    def _gather(self, st: _Node, root: _Root, chunk: Chunk) -> None:
        with self._cond:
            root.chunks[st.name].append((chunk.rows, chunk.outputs))
            root.count[st.name] += len(chunk.rows)
            if root.count[st.name] < root.size:
                return
            chunks = root.chunks.pop(st.name, None)
        if chunks is None:
            return
        try:
            merged = _merge_outputs(chunks, st)
        except Exception as exc:
            self._fail_root(
                root,
                SchedulerError(
                    f"node {st.name!r}: could not reassemble request {root.id}: {exc}", st.name
                ),
            )
            return
        fut = root.futures[st.name]
        if not fut.done():
            fut.set_result(merged)
        if all(f.done() for f in root.futures.values()):
            with self._cond:
                self._live.pop(root.id, None)
