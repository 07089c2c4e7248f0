"""k-NN evaluation: DINO's weighted vote on hand-built features, the
evaluation transform, feature extraction, the end-to-end helper, t-SNE."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from dino_opt.eval import (
    EvalImageFolder,
    extract_features,
    knn_classify,
    knn_evaluate,
    tsne,
    tsne_plot,
)
from dino_opt.eval.knn import tsne_affinities
from PIL import Image


def unit(*angles_deg: float) -> torch.Tensor:
    a = torch.tensor(angles_deg, dtype=torch.float64) * math.pi / 180
    return torch.stack([a.cos(), a.sin()], dim=1).float()


def reference_knn(train, train_y, test, test_y, k, t, num_classes):
    """Row by row in float64, straight from the definition."""
    train = torch.nn.functional.normalize(train.double(), dim=1)
    test = torch.nn.functional.normalize(test.double(), dim=1)
    k = min(k, len(train))
    top1 = top5 = 0
    for x, y in zip(test, test_y.tolist(), strict=True):
        sim = train @ x
        nearest = sim.argsort(descending=True, stable=True)[:k]
        votes = [0.0] * num_classes
        for j in nearest.tolist():
            votes[train_y[j]] += math.exp(sim[j].item() / t)
        ranked = sorted(range(num_classes), key=lambda c: (-votes[c], c))
        top1 += ranked[0] == y
        top5 += y in ranked[:5] and votes[y] > 0
    n = len(test)
    return {"top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n}


# ---------------------------------------------------------------- knn_classify


def test_separated_clusters_are_all_right(gen):
    centres = torch.nn.functional.normalize(torch.randn(6, 32, generator=gen), dim=1) * 10
    train_y = torch.arange(120) % 6
    test_y = torch.arange(60) % 6
    train = centres[train_y] + 0.1 * torch.randn(120, 32, generator=gen)
    test = centres[test_y] + 0.1 * torch.randn(60, 32, generator=gen)
    assert knn_classify(train, train_y, test, test_y) == {"top1": 100.0, "top5": 100.0}
    # shuffled test labels: only the matching sixth is right
    wrong = (test_y + 1) % 6
    assert knn_classify(train, train_y, test, wrong)["top1"] == 0.0


def test_weights_flip_the_majority():
    """One class-0 neighbour at cosine 0.99 against two class-1 neighbours at
    0.80: with T = 0.07 the weights exp(sim / T) let the single close one win
    (exp(0.99/0.07) = 1.39e6 > 2 exp(0.80/0.07) = 1.84e5); with a large T the
    vote is a plain majority and class 1 wins."""
    c0 = math.degrees(math.acos(0.99))
    c1 = math.degrees(math.acos(0.80))
    train = unit(c0, c1, -c1, 180.0)
    train_y = torch.tensor([0, 1, 1, 2])
    test, test_y = unit(0.0), torch.tensor([0])
    assert math.exp(0.99 / 0.07) > 2 * math.exp(0.80 / 0.07)
    sharp = knn_classify(train, train_y, test, test_y, k=3, temperature=0.07)
    flat = knn_classify(train, train_y, test, test_y, k=3, temperature=100.0)
    assert sharp["top1"] == 100.0
    assert flat["top1"] == 0.0
    assert sharp["top5"] == flat["top5"] == 100.0
    # k=4 adds the class-2 vector at cosine -1, far too light to matter
    assert knn_classify(train, train_y, test, test_y, k=4)["top1"] == 100.0
    # and k=1 is the nearest neighbour alone
    assert knn_classify(train, train_y, test, torch.tensor([1]), k=1)["top1"] == 0.0


def test_matches_the_definition_and_chunking_does_not_matter(gen):
    train = torch.randn(200, 16, generator=gen)
    test = torch.randn(77, 16, generator=gen)
    # labels correlated with the features, so scores are neither 0 nor 100
    proj = torch.randn(16, generator=gen)
    train_y = ((train @ proj).argsort().argsort() * 7 // 200).long()
    test_y = ((test @ proj) > 0).long() * 3 + torch.randint(0, 3, (77,), generator=gen)
    expected = reference_knn(train, train_y, test, test_y, 20, 0.07, 7)
    assert 0 < expected["top1"] < 100
    for chunk in (1, 5, 76, 1000, None):
        got = knn_classify(train, train_y, test, test_y, k=20, chunk=chunk)
        assert got == pytest.approx(expected), chunk


def test_raw_features_are_normalised(gen):
    train = torch.randn(50, 8, generator=gen)
    test = torch.randn(20, 8, generator=gen)
    train_y = torch.randint(0, 4, (50,), generator=gen)
    test_y = torch.randint(0, 4, (20,), generator=gen)
    scaled_train = train * torch.rand(50, 1, generator=gen).add(0.1) * 100
    scaled_test = test * torch.rand(20, 1, generator=gen).add(0.1) * 0.01
    assert knn_classify(train, train_y, test, test_y, k=5) == knn_classify(
        scaled_train, train_y, scaled_test, test_y, k=5
    )


def test_k_larger_than_the_train_set_is_clamped(gen):
    train = torch.randn(3, 4, generator=gen)
    train_y = torch.tensor([0, 1, 1])
    test = torch.randn(10, 4, generator=gen)
    test_y = torch.randint(0, 2, (10,), generator=gen)
    assert knn_classify(train, train_y, test, test_y, k=20) == knn_classify(
        train, train_y, test, test_y, k=3
    )
    expected = reference_knn(train, train_y, test, test_y, 3, 0.07, 2)
    assert knn_classify(train, train_y, test, test_y, k=1000) == pytest.approx(expected)


def test_top5_with_fewer_than_five_classes():
    train = unit(0, 5, 120, 125, 240)
    train_y = torch.tensor([0, 0, 1, 1, 2])
    test = unit(2, 122, 238)
    test_y = torch.tensor([0, 1, 2])
    # all three classes get votes: top-5 (here top-3) always holds the label
    assert knn_classify(train, train_y, test, test_y, k=5) == {"top1": 100.0, "top5": 100.0}
    # k=2: the rows' neighbours are {0, 0}, {1, 1} and {2, 1}. Row 1 (label 2)
    # gets no class-2 vote: the sort order alone must not count it as found.
    got = knn_classify(train, train_y, test, torch.tensor([0, 2, 1]), k=2)
    assert got["top1"] == pytest.approx(100 / 3)
    assert got["top5"] == pytest.approx(200 / 3)
    # a fourth class that never occurs (num_classes=4) changes nothing
    assert knn_classify(train, train_y, test, test_y, k=5, num_classes=4)["top5"] == 100.0


def test_tiny_temperatures_stay_finite(gen):
    train = torch.randn(40, 8, generator=gen)
    train_y = torch.arange(40) % 4
    test = train[:8] + 1e-3 * torch.randn(8, 8, generator=gen)
    # exp(1 / 0.005) overflows float32 and float64 alike; the result must not
    got = knn_classify(train, train_y, test, train_y[:8], temperature=0.005)
    assert got == {"top1": 100.0, "top5": 100.0}


def test_bad_inputs_are_named():
    f, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="dimension"):
        knn_classify(f, y, torch.randn(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="train_labels"):
        knn_classify(f, y[:3], f, y)
    with pytest.raises(ValueError, match="test_labels"):
        knn_classify(f, y, f, y.float())
    with pytest.raises(ValueError, match="k must"):
        knn_classify(f, y, f, y, k=0)
    with pytest.raises(ValueError, match="temperature"):
        knn_classify(f, y, f, y, temperature=0.0)
    with pytest.raises(ValueError, match="num_classes"):
        knn_classify(f, y, f, y, num_classes=1)
    with pytest.raises(ValueError, match=">= 0"):
        knn_classify(f, y, f, torch.tensor([0, -1, 0, 1]))
    with pytest.raises(ValueError, match="empty"):
        knn_classify(f, y, f[:0], y[:0])


# ---------------------------------------------------------------- data and features


def write_folder(root: Path, colours: dict[str, tuple[int, int, int]], per_class: int, seed: int):
    """Flat-coloured images with noise, of assorted sizes and modes."""
    rng = np.random.default_rng(seed)
    for name, rgb in colours.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            h, w = rng.integers(30, 90, 2)
            pixels = np.clip(np.array(rgb) + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
            image = Image.fromarray(pixels)
            if i % 3 == 1:
                image.convert("RGBA").save(root / name / f"{i}.png")
            else:
                image.save(root / name / f"{i}.jpg", quality=90)
    return root


COLOURS = {"blue": (20, 40, 220), "green": (30, 200, 40), "red": (220, 30, 30)}


@pytest.fixture(scope="module")
def colour_folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("colours")
    return write_folder(base / "train", COLOURS, 6, 0), write_folder(base / "val", COLOURS, 4, 1)


def test_eval_image_folder_matches_torchvision(colour_folders):
    T = pytest.importorskip("torchvision.transforms")
    ds = EvalImageFolder(colour_folders[0], image_size=32)
    assert ds.classes == ["blue", "green", "red"]
    assert ds.targets == [0] * 6 + [1] * 6 + [2] * 6
    assert len(ds) == 18
    reference = T.Compose(
        [
            T.Resize(int(round(32 * 256 / 224)), interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(32),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    for i in range(len(ds)):
        x, label = ds[i]
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32
        assert label == ds.targets[i]
        with Image.open(ds.samples[i][0]) as im:
            expected = reference(im.convert("RGB"))
        torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)


def test_eval_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        EvalImageFolder(tmp_path / "missing", 32)
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (8, 8)).save(flat / "a.png")
    with pytest.raises(ValueError, match="class folders"):
        EvalImageFolder(flat, 32)
    (tmp_path / "broken" / "a").mkdir(parents=True)
    (tmp_path / "broken" / "a" / "x.jpg").write_bytes(b"not a jpeg")
    ds = EvalImageFolder(tmp_path / "broken", 32)
    with pytest.raises(OSError, match="x.jpg"):
        ds[0]


class TinyNet(torch.nn.Module):
    def __init__(self, dim: int = 12):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, dim, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(dim)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


class MeanColour(torch.nn.Module):
    def forward(self, x):
        return x.mean(dim=(2, 3))


def test_extract_features_on_a_tiny_net(colour_folders):
    torch.manual_seed(0)
    net = TinyNet().train()
    ds = EvalImageFolder(colour_folders[0], 24)
    feats, labels = extract_features(net, ds, "cpu", batch_size=5)
    assert net.training  # mode restored
    assert feats.shape == (18, 12) and feats.dtype == torch.float32
    assert labels.tolist() == ds.targets and labels.dtype == torch.int64
    torch.testing.assert_close(feats.norm(dim=1), torch.ones(18))
    # eval mode: dropout off, batch norm on running stats -> batch size does not matter
    net.eval()
    with torch.no_grad():
        direct = net(torch.stack([ds[i][0] for i in range(len(ds))]))
    torch.testing.assert_close(feats, torch.nn.functional.normalize(direct, dim=1))
    raw, _ = extract_features(net, ds, "cpu", batch_size=100, normalize=False)
    torch.testing.assert_close(raw, direct)
    # a DataLoader (any iterable of batches) works as well
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    again, labels2 = extract_features(net, loader, "cpu")
    torch.testing.assert_close(again, feats)
    assert labels2.tolist() == ds.targets
    # autocast in bf16 gives float32 features close to the fp32 ones
    amp, _ = extract_features(net, ds, "cpu", amp=True)
    assert amp.dtype == torch.float32
    assert (amp * feats).sum(dim=1).min() > 0.99


def test_extract_features_errors(colour_folders):
    ds = EvalImageFolder(colour_folders[1], 16)
    with pytest.raises(ValueError, match=r"\[B, D\]"):
        extract_features(torch.nn.Identity(), ds, "cpu")

    class NaNNet(torch.nn.Module):
        def forward(self, x):
            out = x.mean(dim=(2, 3))
            out[0, 0] = float("nan")
            return out

    with pytest.raises(ValueError, match="not finite"):
        extract_features(NaNNet(), ds, "cpu", batch_size=4)
    with pytest.raises(ValueError, match="empty"):
        extract_features(MeanColour(), [], "cpu")


def test_knn_evaluate_with_a_known_answer(colour_folders):
    """Mean colour separates flat-colour classes: k-NN must be perfect; a
    network that outputs noise must not be."""
    train, val = colour_folders
    result = knn_evaluate(MeanColour(), train, val, 24, "cpu", k=5, return_features=True)
    assert result["top1"] == 100.0 and result["top5"] == 100.0
    assert (result["n_train"], result["n_val"], result["k"]) == (18, 12, 5)
    assert result["classes"] == ["blue", "green", "red"]
    assert result["val_features"].shape == (12, 3)
    assert result["train_labels"].tolist() == [0] * 6 + [1] * 6 + [2] * 6

    class Noise(torch.nn.Module):
        def forward(self, x):
            g = torch.Generator().manual_seed(int(x.sum().abs().item() * 1000) % 2**31)
            return torch.randn(len(x), 16, generator=g)

    assert knn_evaluate(Noise(), train, val, 24, k=5)["top1"] < 100.0


def test_knn_evaluate_rejects_different_classes(tmp_path, colour_folders):
    other = write_folder(tmp_path / "other", {"blue": (0, 0, 255), "cyan": (0, 255, 255)}, 2, 3)
    with pytest.raises(ValueError, match="class folders"):
        knn_evaluate(MeanColour(), colour_folders[0], other, 16)


# ---------------------------------------------------------------- t-SNE


def loo_knn_accuracy(points: torch.Tensor, labels: torch.Tensor, k: int = 5) -> float:
    d = torch.cdist(points.double(), points.double())
    d.fill_diagonal_(float("inf"))
    nearest = d.topk(k, largest=False).indices
    return (labels[nearest].mode(dim=1).values == labels).double().mean().item()


def simplex_blobs(seed: int, n: int = 200, classes: int = 10, dim: int = 20):
    """Blobs around the corners of a simplex: far apart in 20-D, but no 2-D
    linear projection keeps ten equidistant centres apart."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    x = 8.0 * torch.eye(dim)[labels] + torch.randn(n, dim, generator=g)
    return x, labels


def test_tsne_separates_blobs_that_pca_mixes():
    x, labels = simplex_blobs(0)
    assert loo_knn_accuracy(x, labels) == 1.0
    centred = x - x.mean(dim=0)
    pca = centred @ torch.linalg.svd(centred, full_matrices=False).Vh[:2].T
    assert loo_knn_accuracy(pca, labels) < 0.8  # the test can fail
    emb = tsne(x, perplexity=20, n_iter=300, seed=0)
    assert emb.shape == (200, 2) and emb.dtype == torch.float32
    assert torch.isfinite(emb).all()
    assert loo_knn_accuracy(emb, labels) >= 0.95
    torch.testing.assert_close(tsne(x, perplexity=20, n_iter=300, seed=0), emb)  # deterministic


@pytest.mark.parametrize("perplexity", [5.0, 30.0])
def test_tsne_affinities_have_the_asked_perplexity(gen, perplexity):
    x = torch.randn(120, 10, generator=gen, dtype=torch.float64) * 50  # scale must not matter
    p = tsne_affinities(torch.cdist(x, x).square(), perplexity)
    torch.testing.assert_close(p.sum(dim=1), torch.ones(120, dtype=torch.float64))
    assert (p.diagonal() == 0).all()
    entropy = -(p * p.clamp_min(1e-300).log()).sum(dim=1)
    torch.testing.assert_close(
        entropy.exp(), torch.full_like(entropy, perplexity), rtol=1e-3, atol=0
    )


def test_tsne_small_and_bad_inputs():
    assert tsne(torch.randn(3, 5)).shape == (3, 2)
    assert torch.isfinite(tsne(torch.randn(6, 5), n_iter=50)).all()
    assert torch.isfinite(tsne(torch.zeros(10, 4), n_iter=50)).all()  # all points equal
    with pytest.raises(ValueError, match="N >= 2"):
        tsne(torch.randn(1, 5))
    with pytest.raises(ValueError, match="NaN"):
        tsne(torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [1.0, 1.0]]))


def test_tsne_plot_writes_a_png(tmp_path):
    x, labels = simplex_blobs(1, n=60, classes=3, dim=6)
    path = tsne_plot(
        x, labels, ["a", "b", "c"], tmp_path / "plots" / "tsne.png", "blobs", n_iter=100
    )
    assert path == tmp_path / "plots" / "tsne.png"
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 300
    with pytest.raises(ValueError, match="labels"):
        tsne_plot(x, labels + 1, ["a", "b", "c"], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="labels"):
        tsne_plot(x, labels[:10], ["a", "b", "c"], tmp_path / "bad.png")
