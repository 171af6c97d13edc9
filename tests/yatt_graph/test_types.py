import pytest
from sample_nodes import ImagePrompt, Prompt

from yatt_graph import ANY, StructSpec, Tensor, TensorSpec
from yatt_graph.types import compatible, spec_of


def test_tensor_shorthand_and_str():
    spec = Tensor("float32", "B", "T", 3)
    assert spec == TensorSpec("float32", ("B", "T", 3))
    assert str(spec) == "float32[B,T,3]"


@pytest.mark.parametrize(
    ("src", "dst", "why"),
    [
        (Tensor("float32", "B"), Tensor("float32", "N"), None),
        (Tensor("float32", "B", 4), Tensor("float32", "B", "D"), None),
        (Tensor("float32", "B", "*"), Tensor("float32", "B", 7), None),
        (Tensor("float32", "B"), Tensor("bfloat16", "B"), "dtype float32 is not bfloat16"),
        (Tensor("float32", "B"), Tensor("float32", "B", "T"), "rank 1 is not 2"),
        (Tensor("int64", "B", 3), Tensor("int64", "B", 4), "dimension 1 is 3 on one side and 4"),
    ],
)
def test_tensor_compatibility_rule(src, dst, why):
    got = compatible(src, dst)
    assert (got is None) if why is None else (why in got)


def test_struct_compatibility_is_by_type_and_subclass():
    assert compatible(StructSpec.of(ImagePrompt), StructSpec.of(Prompt)) is None
    why = compatible(StructSpec.of(Prompt), StructSpec.of(ImagePrompt))
    assert "Prompt is not ImagePrompt" in why
    assert "tensor port cannot feed a struct port" in compatible(
        Tensor("float32"), StructSpec.of(Prompt)
    )
    assert compatible(ANY, Tensor("int64", "B")) is None


def test_bad_specs_are_refused_clearly():
    with pytest.raises(ValueError, match="unknown dtype 'float'"):
        Tensor("float", "B")
    with pytest.raises(ValueError, match="dimension -1"):
        Tensor("float32", -1)
    with pytest.raises(TypeError, match="is not a port type"):
        spec_of(3)
