"""A GRPO update as a 2-rank FSDP2 (or DDP) group against 1 rank ("Sharded training").

Each configuration runs in a fresh subprocess, so one's peak memory cannot hide another's.
The policy is a GPT-2-small-sized prefix-VLM built from a config (768 dims, 12 heads;
``--layers`` 17 by default, for ~120M parameters with the task's small vocabulary; nothing
is downloaded). The batch is synthetic: B responses of R tokens (lengths vary, so the
token-cost split has work to do) after P prompt tokens, with image embeddings one per prompt.
One warm-up call, then ``--calls`` timed calls, each one AdamW step over the whole batch.

Reported per configuration:
* seconds per update call (median);
* bytes per rank of parameters, gradients and Adam state, *measured*. On rank 0 the
  parameters are the local shards of the FSDP DTensors, the gradients are those shards'
  ``.grad`` (read when the node takes the gradient norm, before it frees them), and the
  Adam state is its moment tensors. With one rank they are the whole tensors;
* peak RSS of rank 0 and of rank 1 (``VmHWM``, which also counts the full weights rank 0
  gathers for the rollout, the batch and the activations);
* publishing the weights: with one rank, the snapshot the node publishes; in a group, the
  full state gathered on rank 0 (``time/weight_gather``), median per call.

    .venv/bin/python -m bench.train_ranks             # ~3-6 minutes on 2 busy cores
    .venv/bin/python -m bench.train_ranks --layers 2 --calls 2 --batch 8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["main"]

# (name, ranks, backend, torch threads per rank): the 2 cores either way, and 1 rank on 1
CONFIGS = [
    ("1 rank, 2 threads", 1, "fsdp", 2),
    ("1 rank, 1 thread", 1, "fsdp", 1),
    ("2 ranks FSDP2, 1 thread each", 2, "fsdp", 1),
    ("2 ranks DDP, 1 thread each", 2, "ddp", 1),
]


def _batch(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    B, P, R, n = args.batch, args.prompt, args.response, 4
    lengths = torch.randint(1, R + 1, (B,), generator=g)  # (B,)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()  # (B, R)
    return {
        "prompt_ids": torch.randint(3, 90, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "response_ids": torch.randint(3, 90, (B, R), generator=g),
        "response_mask": mask,
        "logprobs": -torch.rand(B, R, generator=g) * mask - 4.0 * mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, R) * mask,
        "image_embeds": torch.randn(B // n, 32, generator=g),
    }


def _bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        total += local.numel() * local.element_size()
    return total


def _hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from nodes.update import GRPOUpdate
    from nodes.update.trainer import snapshot
    from runtime.engine.calls import node_op
    from runtime.ranks.group import start_groups

    torch.set_num_threads(args.threads)
    spec = {"name": "tiny-prefix-vlm", "seed": 0, "n_layer": args.layers, "n_embd": 768}
    spec |= {"n_head": 12, "n_positions": 256}
    node = GRPOUpdate(
        policy=spec, lr=1e-5, ranks=args.ranks, train_backend=args.backend, name="grpo"
    )
    start = time.perf_counter()
    start_groups({"grpo": node})
    node.setup()
    setup_s = time.perf_counter() - start
    params = list(node.policy.parameters())
    grads: dict[str, int] = {}

    def at_backward_end(*_: Any) -> None:  # the gradients' bytes, before the node frees them
        grads["bytes"] = _bytes(p.grad for p in params if p.grad is not None)

    hook = torch.nn.utils.get_total_norm
    torch.nn.utils.get_total_norm = lambda g, *a, **k: (at_backward_end(), hook(g, *a, **k))[1]
    inputs = _batch(args)
    node_op(node, "run", inputs)  # warm-up: first all-gathers, Adam's state appears
    times, gathers, snapshots = [], [], []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        out = node_op(node, "run", inputs)  # every rank runs it
        times.append(time.perf_counter() - t0)
        if args.ranks > 1:
            gathers.append(out["metrics"]["time/weight_gather"])
        else:
            t0 = time.perf_counter()
            snapshot(node.policy)
            snapshots.append(time.perf_counter() - t0)
    optim = [v for s in node.optimizer.state.values() for v in s.values() if v.dim() > 0]
    result = {
        "params": sum(p.numel() for p in out["weights"].weights.values()),
        "setup_s": setup_s,
        "call_s": statistics.median(times),
        "param_bytes": _bytes(params),
        "grad_bytes": grads.get("bytes", 0),
        "adam_bytes": _bytes(optim),
        "publish_s": statistics.median(gathers or snapshots),
        "rss0_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss1_mib": _hwm_mib(node.trainer.group.procs[0].pid) if args.ranks > 1 else None,
        "loss": out["metrics"]["loss"],
    }
    node.close()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=17, help="GPT-2 blocks (17: ~120M parameters)")
    p.add_argument("--batch", type=int, default=16, help="responses per call (4 per prompt)")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    p.add_argument("--response", type=int, default=16, help="longest response, tokens")
    p.add_argument("--calls", type=int, default=3, help="timed update calls")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="fsdp", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return
    from bench._util import load_average, machine, table

    shape = ["--layers", str(args.layers), "--batch", str(args.batch), "--calls", str(args.calls)]
    shape += ["--prompt", str(args.prompt), "--response", str(args.response)]
    print(f"# machine: {machine()}; load {load_average()} (shared with other work)")
    rows, got = [], {}
    for name, ranks, backend, threads in CONFIGS:
        cmd = [sys.executable, "-m", "bench.train_ranks", "--child", *shape]
        cmd += ["--ranks", str(ranks), "--backend", backend, "--threads", str(threads)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{name}: failed:\n{out.stderr[-3000:]}")
        r = got[name] = json.loads(out.stdout.strip().splitlines()[-1])
        base = got[CONFIGS[0][0]]
        mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
        rows.append([
            name, f"{r['call_s']:.2f}", f"{r['call_s'] / base['call_s']:.2f}",
            mib(r["param_bytes"]), mib(r["grad_bytes"]), mib(r["adam_bytes"]),
            f"{r['rss0_mib']:.0f}", "-" if r["rss1_mib"] is None else f"{r['rss1_mib']:.0f}",
            f"{r['publish_s']:.3f}", f"{r['loss']:.6f}",
        ])  # fmt: skip
    params = got[CONFIGS[0][0]]["params"]
    print(
        f"# policy: {params / 1e6:.1f}M parameters ({args.layers} GPT-2 blocks of 768); batch "
        f"{args.batch} responses x <= {args.response} tokens after {args.prompt}; median of "
        f"{args.calls} calls after one warm-up"
    )
    print(
        table(
            [
                "configuration", "s / update", "vs 1 rank, 2 threads", "params MiB / rank",
                "grads MiB / rank", "Adam MiB / rank", "peak RSS rank 0 MiB",
                "peak RSS rank 1 MiB", "publish weights s", "loss",
            ],
            rows,
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
