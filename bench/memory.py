"""Peak memory of mm_ppo in one process, model sharing off vs on ("fewer copies").

Each mode runs in a fresh subprocess (so one's peak does not hide the other's): mm_ppo on the
in-process executor with a GPT-2-small sized prefix-VLM policy (768 dims, 12 heads; layers
set by ``--layers``, default 17 for ~120M parameters, since the task's word vocabulary is
tiny next to GPT-2's 50k tokens), a few steps at a small batch. "off" is an executor that
offers no registry (every node builds its own model); "on" is the
ordinary on-policy LocalExecutor (nodes/shared_models.py).

Reported per mode: parameters held per node (a node's modules; a tensor shared with a node
above it in the table counts there), full policy copies (distinct parameter storage over the
policy's size), RSS after setup and the peak RSS of the process (``ru_maxrss``), seconds.

    .venv/bin/python -m bench.memory                 # ~2-4 minutes on 2 cores
    .venv/bin/python -m bench.memory --steps 3 --batch-size 2 --layers 17
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

__all__ = ["main"]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _modules(node: Any) -> list[Any]:
    from torch import nn

    return [v for v in vars(node).values() if isinstance(v, nn.Module)]


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    import graphs.mm_ppo as mm_ppo
    from nodes.data import task_vocabulary
    from nodes.shared_models import Sharing
    from nodes.vision import TINY_OPEN_CLIP_CFG
    from runtime.engine.engine import LocalExecutor

    spec = {
        "name": "tiny-prefix-vlm",
        "seed": 0,
        "words": task_vocabulary(),
        "image_dim": int(TINY_OPEN_CLIP_CFG["embed_dim"]),
        "n_layer": args.layers,
        "n_embd": 768,
        "n_head": 12,
        "n_positions": 128,
    }
    graph = mm_ppo.build_graph(policy=spec, batch_size=args.batch_size, seed=0)
    if args.mode == "off":  # an executor that offers no registry: every node its own copy
        for node in graph.nodes.values():
            if isinstance(node, Sharing):
                node.bind_executor = lambda **_: None
    start = time.perf_counter()
    ex = LocalExecutor(graph)
    rss_setup = _rss_mib()
    seen: set[int] = set()
    per_node: dict[str, int] = {}
    for name in graph.topological_order():
        held = 0
        for module in _modules(graph.nodes[name]):
            for p in module.parameters():
                if p.data_ptr() not in seen:
                    seen.add(p.data_ptr())
                    held += p.numel()
        if held:
            per_node[name] = held
    policy_size = sum(p.numel() for p in graph.nodes["ppo"].policy.parameters())
    vision = per_node.get("vision", 0)
    results = ex.run(args.steps)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    last = results[-1]
    return {
        "mode": args.mode,
        "per_node": per_node,
        "policy_params": policy_size,
        "copies": (sum(per_node.values()) - vision) / policy_size,
        "rss_setup_mib": rss_setup,
        "peak_rss_mib": peak,
        "seconds": seconds,
        "scores": last.outputs["scores"].tolist(),
        "loss": last.outputs["metrics"]["loss"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=17)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=("off", "on"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return
    from bench._util import table

    runs = []
    for mode in ("off", "on"):
        cmd = [sys.executable, "-m", "bench.memory", "--mode", mode, "--steps", str(args.steps)]
        cmd += ["--batch-size", str(args.batch_size), "--layers", str(args.layers)]
        cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"mode {mode} failed ({out.returncode}):\n{out.stderr[-3000:]}")
        runs.append(json.loads(lines[-1][len("RESULT ") :]))
    off, on = runs
    print(
        f"mm_ppo in-process, policy {off['policy_params'] / 1e6:.1f}M parameters "
        f"({args.layers} layers x 768), {args.steps} steps, batch {args.batch_size}, "
        f"{args.threads} threads\n"
    )
    names = list(off["per_node"])
    rows = [
        [n, f"{off['per_node'].get(n, 0) / 1e6:.1f}M", f"{on['per_node'].get(n, 0) / 1e6:.1f}M"]
        for n in names
    ]
    rows += [
        ["full policy copies", f"{off['copies']:.2f}", f"{on['copies']:.2f}"],
        ["RSS after setup", f"{off['rss_setup_mib']:.0f} MiB", f"{on['rss_setup_mib']:.0f} MiB"],
        ["peak RSS", f"{off['peak_rss_mib']:.0f} MiB", f"{on['peak_rss_mib']:.0f} MiB"],
        ["seconds (setup + steps)", f"{off['seconds']:.1f}", f"{on['seconds']:.1f}"],
    ]
    print(table(["parameters held by", "sharing off", "sharing on"], rows))
    same = off["scores"] == on["scores"] and off["loss"] == on["loss"]
    saved = off["peak_rss_mib"] - on["peak_rss_mib"]
    print(f"\npeak RSS saved: {saved:.0f} MiB; last step's scores and loss equal: {same}")


if __name__ == "__main__":
    main()
