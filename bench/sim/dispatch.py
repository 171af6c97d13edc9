"""The batching scheduler's dispatcher: per-node queues fused by BatchPolicy and split into
cost-balanced micro-batches (steps 1 to 3 of :mod:`bench.sim.scheduler`)."""

from __future__ import annotations

import math
import time

from bench.sim.requests import SchedulerError, _Node, _Request, _Work
from runtime.sched.batching import cut_pieces, fuse, split

__all__: list[str] = []


class _Dispatch:
    """The queue half of :class:`~bench.sim.scheduler.Scheduler` (a mixin: the state is the
    scheduler's)."""

    # --- internals: queues (call with the lock held) -----------------------------------------
    def _enqueue(self, st: _Node, req: _Request) -> None:
        st.pending.append(req)
        st.pending_samples += len(req.rows)
        st.pending_cost += sum(req.costs)
        st.requests += 1
        self._cond.notify_all()

    def _caps(self, st: _Node) -> tuple[float, float]:
        per_call = len(st.devices) if st.policy.splittable else 1
        cap_n = st.policy.max_batch_size * per_call or float("inf")
        cap_c = st.policy.max_tokens * per_call or float("inf")
        return cap_n, cap_c

    def _due(self, st: _Node, now: float) -> float | None:
        """None if a batch should go now, else when it will be due (inf: when a device frees)."""
        cap_n, cap_c = self._caps(st)
        if st.flush or st.pending_samples >= cap_n or st.pending_cost >= cap_c:
            return None
        if self._blocked(st):
            # No device could start it now: keep fusing (as Triton's batcher does while every
            # model instance is busy); a worker's pick or finish wakes the dispatcher.
            return math.inf
        due = st.pending[0].arrived + st.max_queue_delay_s
        return None if now >= due else due

    def _blocked(self, st: _Node) -> bool:
        """Whether more micro-batches of ``st`` would only wait: its group is busy with another
        role, or it already has a micro-batch queued for each of its devices."""
        if st.group is not None and st.group in self._barrier_groups:
            active = self._active.get(st.group)
            if active is not None and active != st.name and self._nodes[active].busy():
                return True
        return len(st.ready) >= len(st.devices)

    def _take(self, st: _Node, now: float) -> list[_Request]:
        cap_n, cap_c = self._caps(st)
        taken: list[_Request] = []
        n = c = 0.0
        while st.pending:
            r = st.pending[0]
            rn, rc = len(r.rows), sum(r.costs)
            if taken and (n + rn > cap_n or c + rc > cap_c):
                break
            st.pending.popleft()
            taken.append(r)
            n, c = n + rn, c + rc
            st.pending_samples -= rn
            st.pending_cost -= rc
            st.delay_sum += now - r.arrived
            st.delay_n += 1
            st.delay_max = max(st.delay_max, now - r.arrived)
        st.batches += 1
        st.samples += int(n)
        if not st.pending:
            st.flush, st.pending_cost = False, 0.0
        return taken

    def _dispatch_loop(self) -> None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                wake: float | None = None
                batches: list[tuple[_Node, list[_Request]]] = []
                for st in self._nodes.values():
                    if st.pending and st.upstream and not st.flush and self._upstream_idle(st):
                        st.flush = True  # nothing more can come: do not wait the delay
                    while st.pending:
                        due = self._due(st, now)
                        if due is not None:
                            wake = due if wake is None else min(wake, due)
                            break
                        batches.append((st, self._take(st, now)))
                        st.staging += 1
                if not batches:
                    timed = wake is not None and wake != math.inf
                    self._cond.wait(max(0.0, wake - now) if timed else None)
                    continue
                # Fuse and split outside the lock: workers keep running meanwhile.
                self._cond.release()
                try:
                    made = [(st, self._make_work(st, reqs)) for st, reqs in batches]
                finally:
                    self._cond.acquire()
                for st, works in made:
                    st.ready.extend(works)
                    st.staging -= 1
                self._cond.notify_all()

    def _make_work(self, st: _Node, reqs: list[_Request]) -> list[_Work]:
        try:
            if len(reqs) == 1:
                batch = reqs[0].inputs
            else:
                batch, _ = fuse([r.inputs for r in reqs], st.shared, st.pad_values, st.left_pad)
            origin = [(r.root, row) for r in reqs for row in r.rows]
            arrivals = [r.arrived for r in reqs for _ in r.rows]
            costs = [c for r in reqs for c in r.costs]
            if st.policy.splittable:
                parts = cut_pieces(
                    costs,
                    workers=len(st.devices),
                    max_batch_size=st.policy.max_batch_size,
                    max_cost=st.policy.max_tokens,
                    method=self.partition,
                )
            else:
                parts = [list(range(len(costs)))]
            whole = len(parts) == 1 and parts[0] == list(range(len(costs)))
            micro = [batch] if whole else split(batch, parts, st.shared)
        except Exception as exc:
            err = SchedulerError(
                f"node {st.name!r}: could not fuse/split its batch: {exc}", st.name
            )
            err.__cause__ = exc
            for r in reqs:
                self._fail_root(r.root, err)
            return []
        return [
            _Work(
                st.name,
                mb,
                [origin[i] for i in p],
                [arrivals[i] for i in p],
                sum(costs[i] for i in p),
            )
            for mb, p in zip(micro, parts)
        ]

    def _upstream_idle(self, st: _Node) -> bool:
        return all(
            not self._nodes[u].busy() and self._upstream_idle(self._nodes[u]) for u in st.upstream
        )
