"""VisionEncoder: open_clip image tower -> image_embeds (tiny ViT, 32x32 images; ~5 s, mostly import)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from nodes.vision import TINY_OPEN_CLIP_CFG, VisionEncoder, tiny_vision_encoder
from yatt_graph import NodeInputError


def _images() -> list[Image.Image]:
    g = torch.Generator().manual_seed(0)
    arrays = [
        torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
        for h, w in [(32, 32), (40, 24), (64, 80)]
    ]
    return [Image.fromarray(a.numpy(), "RGB") for a in arrays]


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    return tiny_vision_encoder()


def test_embeddings_shape_dtype_and_dim(encoder):
    out = encoder.run({"images": _images()})
    embeds = out["image_embeds"]
    assert encoder.kind == "encoder"
    assert encoder.embed_dim == TINY_OPEN_CLIP_CFG["embed_dim"] == 32
    assert encoder.image_size == (32, 32)
    assert embeds.shape == (3, encoder.embed_dim) and embeds.dtype == torch.float32
    assert torch.isfinite(embeds).all()
    # different images give different embeddings (the tower reads the pixels)
    assert not torch.allclose(embeds[0], embeds[1])


def test_deterministic_in_eval_and_seeded(encoder):
    images = _images()
    a = encoder.run(images=images)["image_embeds"]
    b = encoder.run(images=images)["image_embeds"]
    assert torch.equal(a, b)
    same = tiny_vision_encoder()  # same seed -> same random weights, as in another process
    assert torch.equal(same.run(images=images)["image_embeds"], a)
    other = VisionEncoder("ViT-S-32", model_cfg=TINY_OPEN_CLIP_CFG, seed=1)
    assert not torch.allclose(other.run(images=images)["image_embeds"], a)
    rebuilt = type(encoder)(**encoder.config())
    assert torch.equal(rebuilt.run(images=images)["image_embeds"], a)


def test_frozen_has_no_grad_trainable_does(encoder):
    assert not encoder.tower.training
    assert not any(p.requires_grad for p in encoder.tower.parameters())
    with torch.enable_grad():
        embeds = encoder.run(images=_images())["image_embeds"]
    assert not embeds.requires_grad

    trainable = tiny_vision_encoder(trainable=True)
    assert trainable.tower.training
    embeds = trainable.run(images=_images())["image_embeds"]
    embeds.pow(2).sum().backward()
    grads = [p.grad for p in trainable.tower.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_modes_converted_to_rgb(encoder):
    gray = Image.new("L", (32, 32), 120)
    rgba = Image.new("RGBA", (32, 32), (10, 200, 30, 7))
    pal = gray.convert("P")
    out = encoder.run(images=[gray, rgba, pal])["image_embeds"]
    ref = encoder.run(
        images=[gray.convert("RGB"), Image.new("RGB", (32, 32), (10, 200, 30)), pal.convert("RGB")]
    )["image_embeds"]
    assert torch.allclose(out, ref)


@pytest.mark.parametrize(
    "images, index, words",
    [
        (lambda: [Image.new("RGB", (8, 8)), "cat.png"], 1, "not a PIL.Image"),
        (lambda: [Image.new("RGB", (8, 8)), Image.new("I;16", (8, 8))], 1, "mode 'I;16'"),
        (lambda: [Image.new("F", (8, 8))], 0, "mode 'F'"),
        (
            lambda: [Image.new("RGB", (8, 8)), Image.new("RGB", (8, 8)), Image.new("RGB", (0, 5))],
            2,
            "empty",
        ),
    ],
)
def test_bad_images_name_node_and_index(encoder, images, index, words):
    with pytest.raises(ValueError, match=rf"node 'vision_encoder': images\[{index}\].*{words}"):
        encoder.run(images=images())


def test_bad_batches(encoder):
    with pytest.raises(ValueError, match="'vision_encoder': images is an empty list"):
        encoder.run(images=[])
    with pytest.raises(ValueError, match="must be a list of PIL images"):
        encoder.run(images=Image.new("RGB", (8, 8)))
    with pytest.raises(NodeInputError, match="required input 'images'"):
        encoder.run({})


def test_local_pretrained_file_loads_weights(tmp_path):
    import open_clip

    torch.manual_seed(123)
    full = open_clip.create_model("ViT-S-32", pretrained=None, **TINY_OPEN_CLIP_CFG)
    path = tmp_path / "tiny_clip.pt"
    torch.save(full.state_dict(), path)
    loaded = VisionEncoder("ViT-S-32", pretrained=str(path), model_cfg=TINY_OPEN_CLIP_CFG, seed=7)
    for key, value in full.visual.state_dict().items():
        assert torch.equal(loaded.tower.state_dict()[key], value), key


def test_bad_construction():
    with pytest.raises(ValueError, match="not a local file"):
        VisionEncoder(
            "ViT-S-32", pretrained="/nonexistent/weights.pt", model_cfg=TINY_OPEN_CLIP_CFG
        )
    with pytest.raises(ValueError, match="unknown open_clip model 'ViT-Tiny-Nope'"):
        VisionEncoder("ViT-Tiny-Nope")


def test_state_roundtrip_and_batch_policy(encoder):
    assert encoder.batch_policy.max_batch_size == 64
    other = VisionEncoder("ViT-S-32", model_cfg=TINY_OPEN_CLIP_CFG, seed=3)
    other.load_state_dict(encoder.state_dict())
    images = _images()
    assert torch.equal(
        other.run(images=images)["image_embeds"], encoder.run(images=images)["image_embeds"]
    )
    with pytest.raises(ValueError, match="expected a state with key 'tower'"):
        other.load_state_dict({"weights": {}})


def test_a_truncated_image_file_is_named_by_index():
    import io

    from PIL import Image

    from nodes.vision import tiny_vision_encoder

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(buf, "PNG")
    truncated = Image.open(io.BytesIO(buf.getvalue()[:60]))
    good = Image.new("RGB", (32, 32))
    with pytest.raises(
        ValueError, match=r"node 'vision': images\[1\] cannot be read .*truncated or corrupt"
    ):
        tiny_vision_encoder(name="vision").run(images=[good, truncated])
