"""docs/SCALE_OUT.md's worked plan (a 7B VLM on 2 hosts x 8 GPUs) is what the code prints: its
``yatt-graph show --memory`` command, run as a user types it on a folder of that model's
shape, prints the table the doc gives, row for row, and its GPU lines. The command runs
in this process (``main``, in that folder) with torch told that CUDA is there: the graph
refuses ``--device cuda`` otherwise, and planning touches no GPU.

The model folder is a stand-in built without weights: Qwen2-VL-7B-Instruct's published
``config.json`` (``tests/data/qwen2_vl_7b_config.json``), a ``model.safetensors`` holding the
checkpoint's tensor names and shapes (a sparse file of zeros: its header is what the plan
reads), and a processor with the model's image patching and a character tokenizer (the plan's
prompts are cut at ``max_prompt_tokens``, so the tokenizer does not set their length)."""

from __future__ import annotations

import json
import math
import re
import shlex
import struct
from pathlib import Path

import pytest
from cli_helpers import yatt_here

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "SCALE_OUT.md"
CONFIG = Path(__file__).parent / "data" / "qwen2_vl_7b_config.json"
SECTION = "## A worked plan: a 7B VLM on 2 hosts x 8 GPUs"
PARAMS = 8_291_375_616
"""Qwen2-VL-7B-Instruct's parameters, as its model card and checkpoint count them."""
PARTS = ["weights", "optimizer", "snapshots", "gradients", "activations", "kv cache", "images"]


def _section() -> str:
    text = DOC.read_text()
    assert SECTION in text, f"docs/SCALE_OUT.md has no section {SECTION!r}"
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def _commands(section: str, program: str) -> list[list[str]]:
    """The commands of ``section``'s code blocks that start with ``program``, as argv."""
    found = []
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        lines = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
        joined = " ".join(ln.rstrip("\\").strip() for ln in lines)
        if joined.startswith(program):
            found.append(shlex.split(joined))
    return found


def _expand(cell: str) -> list[str]:
    """``"`a 1` ... `a 15`"`` -> a 1, ..., a 15; ``"`x`"`` -> x."""
    ranged = re.fullmatch(r"`(.*?)(\d+)` \.\.\. `\1(\d+)`", cell)
    if ranged:
        stem, first, last = ranged.group(1), int(ranged.group(2)), int(ranged.group(3))
        return [f"{stem}{k}" for k in range(first, last + 1)]
    return [cell.strip("`")]


def _doc_rows(section: str) -> dict[str, tuple[str, str, list[str]]]:
    """The doc's plan table: node -> (process, device, the parts' figures)."""
    lines = section.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| node | process |"))
    assert [c.strip() for c in lines[start].strip("|").split("|")][3:] == PARTS
    rows: dict[str, tuple[str, str, list[str]]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        cut = zip(_expand(cells[0]), _expand(cells[1]), _expand(cells[2]), strict=True)
        for node, process, device in cut:
            rows[node] = (process, device, cells[3:])
    return rows


def _printed(out: str) -> tuple[str, dict[str, tuple[str, str, list[str]]]]:
    """The printed plan's first line and its rows: node -> (process, device, figures)."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("memory plan (estimates)"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("  "):
            break
        node, process, device, *figures = re.split(r" {2,}", line.strip())
        rows[node] = (process, device, figures)
    return lines[start], rows


def _tensors(c: dict) -> dict[str, list[int]]:
    """The names and shapes of a Qwen2-VL checkpoint's tensors for config ``c``."""
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    v = c["vision_config"]
    e, p, t = v["embed_dim"], v["patch_size"], v["temporal_patch_size"]
    merged = e * v["spatial_merge_size"] ** 2
    out = {"model.embed_tokens.weight": [vocab, h], "model.norm.weight": [h],
           "lm_head.weight": [vocab, h]}  # fmt: skip
    for i in range(c["num_hidden_layers"]):
        at = f"model.layers.{i}."
        out |= {at + "self_attn.q_proj.weight": [h, h], at + "self_attn.q_proj.bias": [h],
                at + "self_attn.k_proj.weight": [kv, h], at + "self_attn.k_proj.bias": [kv],
                at + "self_attn.v_proj.weight": [kv, h], at + "self_attn.v_proj.bias": [kv],
                at + "self_attn.o_proj.weight": [h, h], at + "mlp.gate_proj.weight": [inter, h],
                at + "mlp.up_proj.weight": [inter, h], at + "mlp.down_proj.weight": [h, inter],
                at + "input_layernorm.weight": [h], at + "post_attention_layernorm.weight": [h]}  # fmt: skip
    out["visual.patch_embed.proj.weight"] = [e, v["in_chans"], t, p, p]
    m = e * v["mlp_ratio"]
    for i in range(v["depth"]):
        at = f"visual.blocks.{i}."
        out |= {at + "norm1.weight": [e], at + "norm1.bias": [e], at + "norm2.weight": [e],
                at + "norm2.bias": [e], at + "attn.qkv.weight": [3 * e, e],
                at + "attn.qkv.bias": [3 * e], at + "attn.proj.weight": [e, e],
                at + "attn.proj.bias": [e], at + "mlp.fc1.weight": [m, e], at + "mlp.fc1.bias": [m],
                at + "mlp.fc2.weight": [e, m], at + "mlp.fc2.bias": [e]}  # fmt: skip
    out |= {"visual.merger.ln_q.weight": [e], "visual.merger.ln_q.bias": [e],
            "visual.merger.mlp.0.weight": [merged, merged], "visual.merger.mlp.0.bias": [merged],
            "visual.merger.mlp.2.weight": [v["hidden_size"], merged],
            "visual.merger.mlp.2.bias": [v["hidden_size"]]}  # fmt: skip
    return out


def _write_sparse_safetensors(path: Path, shapes: dict[str, list[int]]) -> int:
    """A bfloat16 safetensors file of zeros with these tensors (sparse: no data block is
    written); its parameter count."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return offset // 2


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    """A folder outside the repository holding ``Qwen2-VL-7B-Instruct/`` (the stand-in),
    ``prompts.jsonl`` (one prompt of more than 1024 tokens) and ``short.jsonl`` (a short one),
    each with a 448x448 image."""
    from PIL import Image

    from nodes.models.hf_vlm import tiny_qwen2_vl

    root = tmp_path_factory.mktemp("user")
    model = root / "Qwen2-VL-7B-Instruct"
    tiny_qwen2_vl().save_pretrained(model)  # its processor files; the rest is replaced
    config = json.loads(CONFIG.read_text())
    (model / "config.json").write_text(json.dumps(config, indent=2))
    assert _write_sparse_safetensors(model / "model.safetensors", _tensors(config)) == PARAMS
    processor = json.loads((model / "processor_config.json").read_text())
    for part in ("image_processor", "video_processor"):  # Qwen2-VL's: 14-pixel patches, 2x2 merged
        processor[part] |= {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                            "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}}  # fmt: skip
    (model / "processor_config.json").write_text(json.dumps(processor, indent=2))
    Image.new("RGB", (448, 448), (200, 30, 30)).save(root / "red.png")
    for name, prompt in [("prompts", "Say what you see in it, in detail. " * 200),
                         ("short", "What color is it?")]:  # fmt: skip
        row = {"prompt": prompt, "image": "red.png", "answer": "red"}
        (root / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    return root


def test_the_docs_memory_plan_is_what_show_memory_prints(user_folder, monkeypatch):
    section = _section()
    (show,) = _commands(section, "yatt-graph show")
    (run,) = _commands(section, "yatt-graph run")

    def sets(argv: list[str]) -> list[str]:
        return argv[argv.index("--set") + 1 :]

    assert sets(show) == sets(run), "the doc's run and show commands set other options"
    for flag in ("--policy", "--data", "--controllers", "--device", "--train-ranks",
                 "--ranks-per-host", "--replicas", "--nnodes"):  # fmt: skip
        assert show[show.index(flag) + 1] == run[run.index(flag) + 1], flag
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    done = yatt_here(user_folder, *show[1:])
    assert done.returncode == 0, done.stderr
    first, printed = _printed(done.stdout)
    doc = _doc_rows(section)
    assert f"`{first}`" in section, f"the doc does not give the plan's first line {first!r}"
    assert list(printed) == list(doc), "the doc's rows are not the printed plan's nodes"
    for node, row in printed.items():
        assert row == doc[node], f"{node}: printed {row}"
    gpus = re.findall(r"^(host \d) cuda:\d: ([\d.]+ GB) at the peak", done.stdout, re.M)
    assert len(gpus) == 16, done.stdout
    for host, peak in gpus:  # every GPU of a host as its first, which the doc gives
        said = re.search(
            rf"^{host} cuda:0: {re.escape(peak)} at the peak; largest call: ", section, re.M
        )
        assert said, f"{host}: printed {peak} at the peak"


def test_an_hf_vlms_plan_counts_its_image_positions_in_the_prompt(user_folder, monkeypatch):
    """A Qwen2-VL reads its images itself (no vision node): the plan's prompt length counts
    the positions the processor gives each image (a 448x448 image: 16x16 merged patches)."""
    from graphs import mm_grpo
    from graphs.advice import step_load
    from nodes.memory import prompt_tokens

    monkeypatch.chdir(user_folder)
    options = {"policy": "Qwen2-VL-7B-Instruct", "data": "short.jsonl", "device": "cpu",
               "dtype": "bfloat16"}  # fmt: skip
    config = mm_grpo.CONFIG.from_options("mm_grpo", options)
    graph = mm_grpo.graph_from_config(config)
    batch = graph.nodes["data"].run()
    spec = graph.nodes["rollout"].policy_spec
    text_only = prompt_tokens(spec, list(batch["prompts"]))
    with_image = prompt_tokens(spec, list(batch["prompts"]), list(batch["images"]))
    assert with_image == text_only + 16 * 16 + 2  # the image pads, vision start and end
    assert step_load(config, graph).prompt_tokens == with_image
