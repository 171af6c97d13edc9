"""``yatt-graph run`` parses its command line once into a RunSpec, which ``settings.json`` is."""

from __future__ import annotations

import json

import msgspec
import pytest
from cli_helpers import yatt

from runtime.cli import parse_run
from runtime.flags import RunSpec
from runtime.run import graph_options


@pytest.mark.timeout(300)
def test_settings_json_is_the_run_spec_the_command_line_parses_into(tmp_path):
    argv = [
        "text_grpo", "--steps", "2", "--out", "run", "--quiet", "--controllers", "2",
        "--max-staleness", "1", "--checkpoint-every", "1", "--seed", "3",
        "--set", "batch_size=2", "max_new_tokens=2",
    ]  # fmt: skip
    done = yatt(tmp_path, "run", *argv)
    assert done.returncode == 0, done.stderr
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    recorded = msgspec.convert(
        {k: settings[k] for k in RunSpec.__struct_fields__}, RunSpec, strict=False
    )
    parsed = parse_run(argv)
    parsed = parsed.with_options(graph_options(parsed.graph, parsed.engine.offload))
    parsed = msgspec.structs.replace(parsed, graph=msgspec.structs.replace(parsed.graph, flags={}))
    assert recorded == parsed  # the out folder is as typed, relative to where the run started
    assert recorded.options == {"batch_size": 2, "max_new_tokens": 2, "seed": 3}
    assert recorded.engine.max_staleness == 1 and recorded.launch.controllers == 2
    assert settings["config"]["batch_size"] == 2  # and what the typed config resolved them to
    assert [json.loads(r)["step"] for r in (tmp_path / "run" / "metrics.jsonl").open()] == [0, 1]


def test_a_bad_set_pair_is_refused_while_the_command_line_is_parsed():
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_run(["text_grpo", "--set", "batch_size"])
