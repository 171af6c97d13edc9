import itertools
import xml.etree.ElementTree as ET

import networkx as nx
import pytest
from sample_nodes import scaled_loop

from yatt_graph import Graph
from yatt_graph.render import edge_labels, picture


def build() -> Graph:
    return scaled_loop("pictured", {"scaled": 2.0})


def _texts(svg: str) -> str:
    root = ET.fromstring(svg)
    return " ".join(t for el in root.iter() if el.tag.endswith("text") for t in el.itertext())


def test_svg_parses_and_names_every_node_and_port_type():
    g = build()
    svg = g._repr_svg_()
    texts = _texts(svg)
    for name in g.nodes:
        assert name in texts
    assert "x" in texts and "total→x" in texts and "(next step)" in texts


def test_plan_svg_shows_controllers():
    svg = build().plan(2)._repr_svg_()
    texts = _texts(svg)
    assert "controller 0" in texts and "controller 1" in texts
    for name in ("src", "sum", "scaled", "loop"):
        assert name in texts


def test_png_is_a_png(tmp_path):
    path = tmp_path / "g.png"
    data = build().draw(str(path))
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and path.read_bytes() == data


def test_mermaid_and_text_listing():
    g = build()
    mermaid = g.plan(2).to_mermaid()
    assert mermaid.startswith("flowchart LR")
    assert 'subgraph c0["controller 0"]' in mermaid
    assert 'n_src -->|"x: float32[B,T]"| n_sum' in mermaid
    assert 'n_loop -.->|"b: float32[B]"| n_loop' in mermaid
    text = str(g)
    assert text.splitlines()[0] == "graph pictured (4 nodes, 4 edges)"
    assert "%scaled = advantage:@scale(x=%sum.total) -> (y: float32[B])" in text
    assert "back=%loop.b@prev" in text


@pytest.fixture(scope="module")
def mm_ppo() -> Graph:
    from graphs.mm_ppo import build_graph

    return build_graph()


def _pairs(g: Graph) -> dict[tuple[str, str], list[str]]:
    ports: dict[tuple[str, str], list[str]] = {}
    for e in g.edges:
        ports.setdefault((e.src, e.dst), []).extend({e.src_port, e.dst_port})
    return ports


@pytest.mark.parametrize("controllers", [1, 2])
def test_one_labelled_edge_per_node_pair_with_every_port_name(mm_ppo, controllers):
    pic = picture(mm_ppo, mm_ppo.plan(controllers) if controllers > 1 else None)
    ports = _pairs(mm_ppo)
    assert len(ports) < len(mm_ppo.edges)  # some pairs carry several ports
    assert set(pic.labels) == set(ports)
    arrows = [p for p in pic.figure.axes[0].patches if type(p).__name__ == "FancyArrowPatch"]
    assert len(arrows) == len(ports)
    for pair, names in ports.items():
        text = pic.labels[pair].get_text()
        for name in names:
            assert name in text, (pair, name, text)
    assert edge_labels(mm_ppo)[("rollout", "gae")] == "response_mask, logprobs"
    assert edge_labels(mm_ppo)[("ppo", "rollout")] == "weights\n(next step)"


@pytest.mark.parametrize("controllers", [1, 2])
def test_nodes_go_left_to_right_by_topological_generation(mm_ppo, controllers):
    pic = picture(mm_ppo, mm_ppo.plan(controllers) if controllers > 1 else None)
    xs = []
    for generation in nx.topological_generations(mm_ppo.step_dag()):
        column = {pic.positions[n][0] for n in generation}
        assert len(column) == 1, generation  # one generation, one column
        xs.append(column.pop())
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    for e in mm_ppo.edges:
        if not e.delay:
            assert pic.positions[e.src][0] < pic.positions[e.dst][0]


@pytest.mark.parametrize("which", ["mm_ppo", "mm_ppo on 2 controllers", "toy"])
def test_labels_cover_no_other_label_and_no_node(mm_ppo, which):
    from graphs.toy import build_graph as toy

    if which == "toy":
        pic = picture(toy())
    else:
        pic = picture(mm_ppo, mm_ppo.plan(2) if "2" in which else None)
    renderer = pic.figure.canvas.get_renderer()
    labels = {p: t.get_window_extent(renderer) for p, t in pic.labels.items()}
    boxes = {n: b.get_window_extent(renderer) for n, b in pic.boxes.items()}
    for (a, ba), (b, bb) in itertools.combinations(labels.items(), 2):
        assert not ba.overlaps(bb), (a, b)
    for pair, box in labels.items():
        for name, node_box in boxes.items():
            assert not box.overlaps(node_box), (pair, name)
    width, height = pic.figure.canvas.get_width_height()
    for pair, box in labels.items():  # inside the picture
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, pair
