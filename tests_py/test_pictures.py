"""Attention and PCA pictures (dino_opt.eval.pictures) against references
written here from the published recipes: the last block's softmax(q k^T / sqrt(d))
in float64, DINO's thresholding rule, a PCA by SVD."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dino_opt.eval import pictures as P
from dino_opt.models import MultiCropWrapper, VisionTransformer, build_backbone
from PIL import Image


def tiny_vit(gen, registers: int = 0, dtype=torch.float64) -> VisionTransformer:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    vit = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_register_tokens=registers
    )
    with torch.no_grad():  # registers start near zero and attention near uniform: sharpen
        if vit.register_tokens is not None:
            vit.register_tokens.normal_(generator=gen)
        for block in vit.blocks:
            block.attn.qkv.weight.mul_(15.0)
    return vit.to(dtype)


def reference_cls_row(vit: VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """The class token's attention row of the last block (B, heads, N), by hand."""
    x = vit.prepare_tokens(images)
    for block in vit.blocks[:-1]:
        x = block(x)
    last = vit.blocks[-1]
    x = F.layer_norm(x, (x.shape[-1],), last.norm1.weight, last.norm1.bias, last.norm1.eps)
    b, n, c = x.shape
    heads, d = vit.num_heads, c // vit.num_heads
    qkv = x @ last.attn.qkv.weight.T + last.attn.qkv.bias
    q, k = (qkv[..., i * c : (i + 1) * c].reshape(b, n, heads, d).transpose(1, 2) for i in (0, 1))
    scores = q @ k.transpose(-2, -1) / d**0.5
    return torch.softmax(scores, dim=-1)[:, :, 0]


@pytest.mark.parametrize("registers", [0, 3])
def test_attention_matches_float64_reference(gen, registers):
    vit = tiny_vit(gen, registers)
    images = torch.randn(2, 3, 32, 48, generator=gen, dtype=torch.float64)  # not square
    maps = P.attention_maps(vit, images)
    with torch.no_grad():
        row = reference_cls_row(vit, images)
    assert maps["attention"].shape == (2, 4, 4, 6) and maps["attention"].dtype == torch.float64
    torch.testing.assert_close(maps["attention"], row[..., 1 + registers :].reshape(2, 4, 4, 6))
    torch.testing.assert_close(maps["cls_share"], row[..., 0])
    torch.testing.assert_close(maps["register_attention"], row[..., 1 : 1 + registers])
    total = maps["cls_share"] + maps["register_share"] + maps["attention"].sum(dim=(-2, -1))
    torch.testing.assert_close(total, torch.ones_like(total))
    torch.testing.assert_close(maps["patch_share"], maps["attention"].sum(dim=(-2, -1)))
    if registers:
        assert (maps["register_share"] > 0).all()
    else:
        assert (maps["register_share"] == 0).all()


def test_attention_float32_wrapped_and_mode_restored(gen):
    vit = tiny_vit(gen, 2, torch.float32).train()
    wrapped = MultiCropWrapper(vit, torch.nn.Identity())
    images = torch.randn(3, 3, 40, 24, generator=gen)
    maps = P.attention_maps(wrapped, images, threshold=0.5)
    assert vit.training, "the model's mode is restored"
    with torch.no_grad():
        row = reference_cls_row(vit.double(), images.double())
    torch.testing.assert_close(
        maps["attention"].double(), row[..., 3:].reshape(3, 4, 5, 3), rtol=1e-4, atol=1e-6
    )
    assert maps["thresholded"].shape == (3, 4, 5, 3) and maps["thresholded"].dtype == torch.bool


def test_check_attention_agrees_with_fused_block(gen):
    vit = tiny_vit(gen, 2)
    images = torch.randn(2, 3, 24, 40, generator=gen, dtype=torch.float64)
    assert P.check_attention(vit, images) < 1e-12
    assert P.check_attention(vit.float(), images.float()) < 1e-5
    vit.blocks[-1].attn.scale = 1.0  # explicit weights no longer those the block uses
    assert P.check_attention(vit, images.float()) > 1e-2


def test_threshold_known_vectors():
    attn = torch.tensor([0.5, 0.1, 0.3, 0.1])
    assert P.threshold_attention(attn, 0.6).tolist() == [True, False, True, False]
    assert P.threshold_attention(attn, 0.5).tolist() == [True, False, False, False]
    assert P.threshold_attention(attn, 0.85).tolist() == [
        True,
        True,
        True,
        False,
    ] or P.threshold_attention(attn, 0.85).tolist() == [True, False, True, True]
    # renormalised over the patches given: the scale of the row does not matter
    assert P.threshold_attention(attn * 0.3, 0.6).tolist() == [True, False, True, False]
    assert P.threshold_attention(attn, 1.0).all()


def test_threshold_matches_rule(gen):
    attn = torch.rand(3, 5, 50, generator=gen, dtype=torch.float64)
    for t in (0.3, 0.6, 0.9):
        kept = P.threshold_attention(attn, t)
        # kept iff the mass of the larger patches is below t of the total
        above = (attn[..., None, :] * (attn[..., None, :] > attn[..., :, None])).sum(-1)
        expected = above < t * attn.sum(-1, keepdim=True)
        assert torch.equal(kept, expected)
        assert ((attn * kept).sum(-1) >= t * attn.sum(-1) - 1e-12).all()


def planted_features(gen, b=3, h=6, w=8, c=24):
    """Features with a central foreground block along a planted direction, and
    inside it three planted directions of decreasing spread."""
    fg = torch.zeros(b, h, w, dtype=torch.bool)
    fg[:, 1:4, 2:6] = True
    x = 0.02 * torch.randn(b, h, w, c, generator=gen, dtype=torch.float64)
    x[..., 0] += torch.where(fg, 4.0, -1.0)
    # uncorrelated over the foreground patches, so each is a principal direction
    raw = torch.randn(int(fg.sum()), 3, generator=gen, dtype=torch.float64)
    q = torch.linalg.qr(raw - raw.mean(0)).Q * torch.tensor([6.0, 4.0, 2.0], dtype=torch.float64)
    a = torch.zeros(b, h, w, 3, dtype=torch.float64)
    a[fg] = q
    x[..., 1:4] += a
    return x, fg, a


def test_pca_finds_planted_foreground_and_components(gen):
    x, fg, a = planted_features(gen)
    out = P.feature_pca(x)
    assert torch.equal(out["foreground"], fg)
    assert out["rgb"].shape == (3, 6, 8, 3)
    assert (out["rgb"][~fg] == 0).all() and out["rgb"].min() >= 0 and out["rgb"].max() <= 1
    rgb = out["rgb"][fg].double()
    torch.testing.assert_close(rgb.min(0).values, torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(rgb.max(0).values, torch.ones(3, dtype=torch.float64))
    for ch in range(3):  # red, green, blue follow the planted directions, sign fixed
        corr = torch.corrcoef(torch.stack([rgb[:, ch], a[fg][:, ch]]))[0, 1]
        assert corr > 0.99
    # the first component is the PCA's: |scores| against an SVD reference
    flat = x.reshape(-1, 24)
    xc = flat - flat.mean(0)
    v = torch.linalg.svd(xc, full_matrices=False).Vh[0]
    torch.testing.assert_close(
        out["first_component"].reshape(-1).abs().double(), (xc @ v).abs(), rtol=1e-5, atol=1e-5
    )


def test_pca_sign_stable_and_invert(gen):
    x, fg, _ = planted_features(gen)
    out = P.feature_pca(x)
    flipped = P.feature_pca(-x)  # the SVD's sign is arbitrary; the picture's is not
    assert torch.equal(flipped["foreground"], fg)
    torch.testing.assert_close(flipped["first_component"], out["first_component"])
    assert torch.equal(P.feature_pca(x)["rgb"], out["rgb"])
    inverted = P.feature_pca(x, invert=True)
    assert torch.equal(inverted["foreground"], ~fg)
    everything = P.feature_pca(x, foreground=False)
    assert everything["foreground"].all() and (everything["rgb"].amax(dim=(0, 1, 2)) == 1).all()


def test_pca_lists_of_sizes_and_grey(gen):
    x, fg, _ = planted_features(gen, b=2)
    parts = [x[0], x[1, :4, :6]]
    out = P.feature_pca(parts, n_components=1)
    assert [tuple(r.shape) for r in out["rgb"]] == [(6, 8, 3), (4, 6, 3)]
    assert torch.equal(out["foreground"][0], fg[0])
    assert torch.equal(out["rgb"][0][..., 0], out["rgb"][0][..., 2])  # grey


def test_pca_maps_of_vit(gen):
    vit = tiny_vit(gen, 1)
    images = torch.randn(2, 3, 32, 48, generator=gen, dtype=torch.float64)
    out = P.pca_maps(vit, images)
    with torch.no_grad():
        tokens = vit.forward_features(images)["x_norm_patchtokens"].reshape(2, 4, 6, -1)
    ref = P.feature_pca(tokens)
    assert torch.equal(out["rgb"], ref["rgb"]) and torch.equal(out["foreground"], ref["foreground"])
    assert (out["rgb"][~out["foreground"]] == 0).all()
    sizes = P.pca_maps(vit, [images[0], images[1, :, :16, :24]])
    assert [tuple(m.shape) for m in sizes["foreground"]] == [(4, 6), (2, 3)]


def write_images(tmp_path, gen):
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    paths = []
    for name, (w, h) in (("my cat.png", (50, 30)), ("dog.jpg", (40, 40))):
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(arr).save(tmp_path / name)
        paths.append(tmp_path / name)
    return paths


def test_show_writes_pngs_named_by_image(gen, tmp_path):
    vit = tiny_vit(gen, 2, torch.float32)
    paths = write_images(tmp_path, gen)
    images = P.load_images(paths, image_size=64, patch_size=8)
    assert [tuple(i.shape) for i in images] == [(3, 40, 64), (3, 64, 64)]
    for kind, n_panels in (("attention", 1 + 4 + 2), ("pca", 4)):
        written = P.show(vit, paths, kind, tmp_path / "out", image_size=64, panel=96)
        assert [p.name for p in written] == [f"my_cat_{kind}.png", f"dog_{kind}.png"]
        arrays = P.picture_arrays(vit, images, kind, ["my_cat", "dog"], panel=96)
        for path, array, (ph, pw) in zip(written, arrays, [(60, 96), (96, 96)], strict=True):
            with Image.open(path) as im:
                assert im.size == (
                    n_panels * pw + (n_panels + 1) * P.GAP_PX,
                    P.TITLE_PX + ph + P.GAP_PX,
                )
                assert np.array_equal(np.asarray(im.convert("RGB")), array)
            assert array.dtype == np.uint8 and array.shape[2] == 3


def test_save_grids_and_safe_names(gen, tmp_path):
    vit = tiny_vit(gen, 0, torch.float32)
    images = torch.randn(2, 3, 16, 24, generator=gen)
    maps = P.attention_maps(vit, images)
    paths = P.save_attention_grid(images, maps, tmp_path, ["a/b c", "a/b c"])
    assert [p.name for p in paths] == ["a_b_c_attention.png", "a_b_c_1_attention.png"]
    pca = P.pca_maps(vit, images)
    paths = P.save_pca_grid(images, pca, tmp_path)
    assert [p.name for p in paths] == ["image0_pca.png", "image1_pca.png"]
    # the last panel (48 x 72) is the RGB map of 2 x 3 patches, each over 24 x 24 pixels
    array = P.pca_grid_arrays(images, pca, panel=72)[1]
    x0, y0 = P.GAP_PX + 3 * (72 + P.GAP_PX), P.TITLE_PX
    shown = array[y0 : y0 + 48, x0 : x0 + 72].astype(np.int64)
    rgb = pca["rgb"][1].repeat_interleave(24, 0).repeat_interleave(24, 1)
    assert np.abs(shown - np.round(rgb.numpy() * 255)).max() <= 1
    assert P.safe_stem("../..") == "image"


def test_bad_input_one_line(gen, tmp_path):
    vit = tiny_vit(gen, 0, torch.float32)
    resnet, _ = build_backbone("resnet18")
    checks = [
        (ValueError, "ResNet", lambda: P.attention_maps(resnet, torch.zeros(1, 3, 32, 32))),
        (ValueError, "30x32", lambda: P.attention_maps(vit, torch.zeros(1, 3, 30, 32))),
        (ValueError, "(1, 1, 32, 32)", lambda: P.pca_maps(vit, torch.zeros(1, 1, 32, 32))),
        (ValueError, "torch.int64", lambda: P.attention_maps(vit, torch.zeros(1, 3, 8, 8).long())),
        (ValueError, "threshold", lambda: P.attention_maps(vit, torch.zeros(1, 3, 8, 8), 0.0)),
        (ValueError, "kind", lambda: P.picture_arrays(vit, torch.zeros(1, 3, 8, 8), "tsne")),
        (ValueError, "no image paths", lambda: P.show(vit, [], output_dir=tmp_path)),
        (ValueError, "no images", lambda: P.pca_maps(vit, [])),
        (FileNotFoundError, "missing.png", lambda: P.show(vit, tmp_path / "missing.png")),
        (ValueError, "n_components", lambda: P.feature_pca(torch.zeros(1, 2, 2, 4), 4)),
    ]
    (tmp_path / "broken.jpg").write_bytes(b"not an image")
    checks.append((ValueError, "broken.jpg", lambda: P.show(vit, tmp_path / "broken.jpg")))
    for error, words, call in checks:
        with pytest.raises(error) as info:
            call()
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_attention_of_a_dinov3_vit_with_its_rope(gen):
    # A DINOv3 ViT rotates queries and keys with RoPE: the maps come from the
    # attention it computes (its own get_last_selfattention), in float64.
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    vit, _ = build_backbone("vit_small_dinov3", drop_path_rate=0.0)
    vit = vit.double().eval()
    images = torch.randn(2, 3, 32, 48, generator=gen, dtype=torch.float64)
    maps = P.attention_maps(vit, images)
    with torch.no_grad():
        row = vit.get_last_selfattention(images)[:, :, 0]
    patches = row[..., 1 + vit.num_register_tokens :].reshape(2, vit.num_heads, 2, 3)
    torch.testing.assert_close(maps["attention"], patches, rtol=1e-12, atol=1e-14)
    assert maps["register_attention"].shape == (2, vit.num_heads, 4)
    assert P.check_attention(vit, images) < 1e-12
