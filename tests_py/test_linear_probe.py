"""The linear probe: the grid against separate float64 classifiers, the
logistic regression at its optimum, the probe features of a ViT, the probe
end to end on the built-in data, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F
from dino_opt.data import builtin_dataset
from dino_opt.eval.linear import (
    LinearProbeGrid,
    ProbeData,
    ProbeFeatures,
    accuracy,
    fit_grid,
    linear_probe,
    logistic_regression,
    logreg_fit,
    probe_table,
)
from dino_opt.models import VisionTransformer
from torch import nn

LAYOUT = {"dim": 6, "n_blocks": 4, "avgpool": True}


def _batches(x, y, batch):
    def epoch(e):
        for i in range(0, len(x) - batch + 1, batch):
            yield x[i : i + batch], y[i : i + batch]

    return epoch


def _reference(grid, x, y, batch, epochs):
    """Each classifier as its own float64 nn.Linear with torch's SGD
    (momentum 0.9) and CosineAnnealingLR, as DINOv2 sets them up."""
    n_lr = len(grid.weights[0])
    refs, groups = [], []
    for k, spec in enumerate(grid.specs):
        kind, j = divmod(k, n_lr)
        lin = nn.Linear(grid.weights[kind].shape[1], grid.weights[kind].shape[2]).double()
        with torch.no_grad():
            lin.weight.copy_(grid.weights[kind][j].T)
            lin.bias.copy_(grid.biases[kind][j, 0])
        refs.append((lin, grid.columns[kind]))
        groups.append({"params": lin.parameters(), "lr": spec.scaled_lr})
    opt = torch.optim.SGD(groups, momentum=0.9, weight_decay=0)
    total = epochs * (len(x) // batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total, eta_min=0)
    for e in range(epochs):
        for xb, yb in _batches(x, y, batch)(e):
            loss = sum(F.cross_entropy(lin(xb[:, cols]), yb) for lin, cols in refs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return refs


def test_grid_equals_separate_classifiers_float64(gen):
    n, c, batch = 96, 5, 16
    x = torch.randn(n, 5 * LAYOUT["dim"], generator=gen, dtype=torch.float64)
    y = torch.randint(0, c, (n,), generator=gen)
    grid = LinearProbeGrid(
        LAYOUT, c, (0.5, 2.0, 8.0), (1, 4), batch_size=batch, generator=gen
    ).double()
    assert len(grid.specs) == 3 * 2 * 2
    refs = _reference(grid, x, y, batch, epochs=3)
    fit = fit_grid(grid, _batches(x, y, batch), 3, n // batch, torch.device("cpu"))
    assert fit["steps"] == 3 * (n // batch)
    n_lr = len(grid.weights[0])
    moved = 0.0
    for k, (lin, _) in enumerate(refs):
        kind, j = divmod(k, n_lr)
        torch.testing.assert_close(
            grid.weights[kind][j].detach().T, lin.weight.detach(), rtol=1e-10, atol=1e-12
        )
        torch.testing.assert_close(
            grid.biases[kind][j, 0].detach(), lin.bias.detach(), rtol=1e-10, atol=1e-12
        )
        moved = max(moved, lin.bias.detach().abs().max().item())
    assert moved > 1e-3  # the classifiers did train


def test_grid_inputs_are_dinov2s_linear_inputs(gen):
    """Blocks n: the class tokens of the last n blocks; avgpool: then the
    last block's patch mean."""
    d = LAYOUT["dim"]
    feats = torch.randn(4, 5 * d, generator=gen)
    grid = LinearProbeGrid(LAYOUT, 3, (1.0,), (1, 4), generator=gen)
    expected = {
        (1, False): feats[:, 3 * d : 4 * d],
        (1, True): torch.cat([feats[:, 3 * d : 4 * d], feats[:, 4 * d :]], 1),
        (4, False): feats[:, : 4 * d],
        (4, True): feats,
    }
    logits = grid(feats)
    for k, (kind, cols) in enumerate(zip(grid.kinds, grid.columns, strict=True)):
        torch.testing.assert_close(feats[:, cols], expected[kind])
        ref = expected[kind] @ grid.weights[k][0] + grid.biases[k][0]
        torch.testing.assert_close(logits[k], ref)


def test_accuracy_against_loop(gen):
    logits = torch.randn(3, 50, 7, generator=gen)
    labels = torch.randint(0, 7, (50,), generator=gen)
    top1, top5 = accuracy(logits, labels)
    for k in range(3):
        ranks = [(logits[k, i] > logits[k, i, labels[i]]).sum().item() for i in range(50)]
        assert math.isclose(top1[k].item(), 100 * sum(r == 0 for r in ranks) / 50)
        assert math.isclose(top5[k].item(), 100 * sum(r < 5 for r in ranks) / 50)


def test_logistic_regression_reaches_its_optimum(gen):
    """At the chosen C the objective's gradient (written here in float64)
    vanishes, and the sweep picks the C with the best val top-1."""
    centers = torch.randn(4, 8, generator=gen, dtype=torch.float64) * 2
    y = torch.randint(0, 4, (200,), generator=gen)
    x = centers[y] + torch.randn(200, 8, generator=gen, dtype=torch.float64)
    out = logistic_regression(
        (x[:120], y[:120]),
        (x[120:160], y[120:160]),
        (x[160:], y[160:]),
        cs=(1e-3, 1e-1, 10.0),
        max_iter=200,
    )
    assert out["val_top1"] == max(r["val_top1"] for r in out["rows"])
    assert out["val_top1"] > 60 and "test_top1" in out
    # The solver's answer at the chosen C is a stationary point of the
    # objective written here in float64 (penalty ||W||^2 / 2C, bias free).
    xn = F.normalize(x[:120], dim=1)
    theta = logreg_fit(xn, y[:120], 4, out["best_c"], None, max_iter=500)
    theta.requires_grad_(True)
    xb = torch.cat([xn, torch.ones(120, 1, dtype=torch.float64)], 1)
    data = F.cross_entropy(xb @ theta, y[:120], reduction="sum")
    objective = (data + theta[:-1].square().sum() / (2 * out["best_c"])) / 120
    (grad,) = torch.autograd.grad(objective, theta)
    assert grad.abs().max() < 1e-6
    # and it is the minimum: any small step goes up
    step = torch.randn(theta.shape, generator=gen, dtype=torch.float64) * 1e-3
    moved = F.cross_entropy(xb @ (theta + step), y[:120], reduction="sum")
    moved = (moved + (theta + step)[:-1].square().sum() / (2 * out["best_c"])) / 120
    assert moved > objective


def test_probe_features_of_a_vit_with_registers(gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    vit = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=16, depth=5, num_heads=2, num_register_tokens=2
    ).eval()
    x = torch.randn(3, 3, 32, 32, generator=gen)
    probe = ProbeFeatures(vit)
    assert probe.layout == {"dim": 16, "n_blocks": 4, "avgpool": True}
    with torch.no_grad():
        out = probe(x)
        layers = vit.get_intermediate_layers(x, 4)
    assert out.shape == (3, 5 * 16)
    torch.testing.assert_close(out[:, 48:64], vit(x))  # the last block's class token
    torch.testing.assert_close(out[:, 64:], layers[-1][:, 3:].mean(1))  # registers left out
    with pytest.raises(ValueError, match="n_blocks must be in"):
        ProbeFeatures(vit, n_blocks=9)
    # a ViT shallower than the grid's 4 blocks: every block it has
    shallow = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2)
    assert ProbeFeatures(shallow).layout["n_blocks"] == 2


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    return builtin_dataset(
        root / "data", image_size=32, train_per_class=16, val_per_class=4, test_per_class=4
    )


def test_linear_probe_end_to_end(tiny_data):
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2)
    data = ProbeData(tiny_data / "train", tiny_data / "val", tiny_data / "test")
    fast = linear_probe(vit, data, 32, epochs=4, batch_size=32, logreg_c=(0.1, 10.0))
    assert fast["n_classifiers"] == 52 and len(fast["rows"]) == 52
    assert fast["best"]["val_top1"] == max(r["val_top1"] for r in fast["rows"])
    assert {"test_top1", "test_top5"} <= set(fast["best"]) and "logreg" in fast
    assert fast["steps"] == 4 * (160 // 32)
    assert "blocks" in probe_table(fast, top=3)
    aug = linear_probe(
        vit, data, 32, mode="augmented", epochs=1, batch_size=32, learning_rates=(0.01, 0.1)
    )
    assert aug["n_classifiers"] == 8 and aug["steps"] == 160 // 16 * 1
    # Cached features serve a second probe without a backbone pass.
    calls = []
    vit.patch_embed.register_forward_pre_hook(lambda *a: calls.append(1))
    cached = {k: (torch.randn(8, 160), torch.arange(8) % 2) for k in ("train", "val")}
    again = linear_probe(
        vit,
        ProbeData(tiny_data / "train", tiny_data / "val"),
        32,
        epochs=1,
        batch_size=4,
        cached=cached,
        logreg=False,
    )
    assert not calls and again["n_train"] == 8 and "logreg" not in again


def test_augmented_probe_reads_native_images_as_the_training_loader(tmp_path):
    """16-bit grey images, image_mode native: the augmented crops reach the
    backbone with one channel at their depth and the run's normalisation."""
    root = builtin_dataset(
        tmp_path / "gray16",
        image_size=32,
        train_per_class=2,
        val_per_class=1,
        test_per_class=0,
        variant="gray16",
    )
    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, in_chans=1
    )
    seen = []
    vit.patch_embed.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    # mean 0, std 1 / 65535: the crops arrive in uint16 units.
    native = {"image_mode": "native", "mean": [0.0], "std": [1.0 / 65535]}
    data = ProbeData(root / "train", root / "val")
    out = linear_probe(
        vit,
        data,
        32,
        mode="augmented",
        epochs=1,
        batch_size=8,
        learning_rates=(0.1,),
        input=native,
        logreg=False,
    )
    assert out["steps"] >= 1 and seen
    crops = torch.cat([x for x in seen if x.shape[0] > 0])
    assert crops.shape[1] == 1
    # The gray16 scenes span about 600 levels around 30,000 (docs/loader.md):
    # at 8 bits they would be 2 to 3 distinct values, here hundreds.
    assert 28_000 < crops.mean().item() < 32_000
    assert torch.unique(crops.round()).numel() > 50


def test_bad_input(tiny_data, tmp_path):
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2)
    data = ProbeData(tiny_data / "train", tiny_data / "val")
    with pytest.raises(ValueError, match="mode must be"):
        linear_probe(vit, data, 32, mode="slow")
    with pytest.raises(ValueError, match="epochs must be"):
        linear_probe(vit, data, 32, epochs=0)
    unlabelled = tmp_path / "flat"
    unlabelled.mkdir()
    for p in sorted((tiny_data / "val" / "circle").iterdir())[:2]:
        (unlabelled / p.name).write_bytes(p.read_bytes())
    with pytest.raises(ValueError, match="unlabelled images"):
        linear_probe(vit, ProbeData(tiny_data / "train", unlabelled), 32)
    other = tmp_path / "other"
    (other / "a").mkdir(parents=True)
    (other / "b").mkdir()
    for d in ("a", "b"):
        src = next((tiny_data / "val" / "circle").iterdir())
        (other / d / src.name).write_bytes(src.read_bytes())
    with pytest.raises(ValueError, match="classes differ between the splits"):
        linear_probe(vit, ProbeData(tiny_data / "train", other), 32)
    with pytest.raises(ValueError, match="at least 2 classes"):
        LinearProbeGrid(LAYOUT, 1)
