import xml.etree.ElementTree as ET

from sample_nodes import Loop, Source, Sum, scale

from yatt_graph import Graph


def build() -> Graph:
    with Graph("pictured") as g:
        src = Source(name="src")()
        a = scale(Sum(name="sum")(src.x), name="scaled")
        loop = Loop(name="loop")
        out = loop(a)
        g.connect(out, loop, "back", delay=1)
        g.output("out", out)
        g.output("prompt", src.prompt)
    return g


def _texts(svg: str) -> str:
    root = ET.fromstring(svg)
    return " ".join(t for el in root.iter() if el.tag.endswith("text") for t in el.itertext())


def test_svg_parses_and_names_every_node_and_port_type():
    g = build()
    svg = g._repr_svg_()
    texts = _texts(svg)
    for name in g.nodes:
        assert name in texts
    assert "x: float32[B,T]" in texts and "(next step)" in texts


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
