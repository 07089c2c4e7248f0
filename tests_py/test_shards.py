"""Data at scale: tar shards, file lists and Hugging Face data sets through the
native loader, against the ImageFolder path: the same images per epoch across
ranks, deterministic orders, mid-epoch resume, skip counting, one-line errors
for bad input, `dino-opt prepare --format shards`, labels for the k-NN, and
how a config names its data."""

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from dino_opt import _C
from dino_opt.config import Config
from dino_opt.data import (
    LoaderError,
    MultiCropDataset,
    MultiCropLoader,
    SourceError,
    expand_pattern,
    open_source,
    sibling_split,
    write_shards,
)
from dino_opt.eval.knn import EvalImageFolder
from dino_opt.train import build_loader, data_roots
from PIL import Image

SMALL = dict(global_size=32, local_size=16, n_local=2, num_threads=2)
CLASSES = ("ant", "bee", "cat")


def digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """3 classes x 7 small JPEGs of different sizes."""
    root = tmp_path_factory.mktemp("folder") / "train"
    rng = np.random.default_rng(0)
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(7):
            h, w = 24 + 3 * i, 40 - 2 * i + c
            y, x = np.mgrid[0:h, 0:w]
            img = np.stack([x * 5 + 40 * c, y * 6, (x + y) * 3], -1) + rng.integers(
                0, 30, (h, w, 3)
            )
            Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(
                root / name / f"{i}.jpg", quality=90
            )
    return root


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "train"
    result = write_shards(folder, out, shard_size_mb=0.006, progress=False)
    assert result["written"] == 21 and result["verified"] and not result["failed"]
    assert len(result["shards"]) >= 4
    return out


@pytest.fixture(scope="module")
def file_list(folder) -> Path:
    lines = ["path,label"] + [
        f"{p.relative_to(folder.parent).as_posix()},{p.parent.name}"
        for p in sorted(folder.rglob("*.jpg"))
    ]
    path = folder.parent / "train.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def hf_data(folder, tmp_path_factory) -> dict:
    datasets = pytest.importorskip("datasets")
    files = sorted(folder.rglob("*.jpg"))
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))}
    )
    ds = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": f.read_bytes(), "path": None} for f in files],
            "label": [CLASSES.index(f.parent.name) for f in files],
        },
        features=features,
    )
    base = tmp_path_factory.mktemp("hf")
    ds.save_to_disk(str(base / "disk"))
    ds.select(range(10)).to_parquet(str(base / "part-0.parquet"))
    ds.select(range(10, 21)).to_parquet(str(base / "part-1.parquet"))
    return {"disk": base / "disk", "parquet": str(base / "part-{0..1}.parquet")}


def epoch_images(spec, rank: int, world: int, epoch: int, pad: bool = True, **kw) -> list:
    with MultiCropLoader(
        spec, 2, rank=rank, world_size=world, pad_shards=pad, seed=3, **SMALL, **kw
    ) as loader:
        source = loader.source
        return [(digest(source.read(i)), source.label(i)) for i in loader.epoch_indices(epoch)]


def source_of(kind: str, request) -> object:
    """The data of ``kind``; the Hugging Face ones only when asked (they need ``datasets``)."""
    if kind in ("hf", "parquet"):
        return request.getfixturevalue("hf_data")["disk" if kind == "hf" else "parquet"]
    return request.getfixturevalue({"shards": "shards", "list": "file_list"}[kind])


# ---------------------------------------------------------------- the same images


@pytest.mark.parametrize("kind", ["shards", "list", "hf", "parquet"])
@pytest.mark.parametrize("pad", [True, False])
def test_every_source_gives_the_folders_images_once_per_epoch_across_ranks(
    kind, pad, folder, request
):
    spec = source_of(kind, request)
    ref = open_source(folder)
    # (image, label) of every image, the labels numbered by the folder's classes
    everything = {(digest(ref.read(i)), ref.label(i)) for i in range(len(ref))}
    assert len(everything) == 21
    for epoch in (0, 1):
        ours = epoch_images(spec, 0, 2, epoch, pad) + epoch_images(spec, 1, 2, epoch, pad)
        theirs = epoch_images(folder, 0, 2, epoch, pad) + epoch_images(folder, 1, 2, epoch, pad)
        assert len(ours) == len(theirs) == (22 if pad else 20)  # equal steps on both ranks
        if pad:
            assert set(ours) == set(theirs) == everything  # one padded repeat
        else:
            assert len(set(ours)) == 20 and set(ours) <= everything  # one dropped, none twice


def test_detection_and_explicit_formats(folder, shards, file_list, request):
    assert open_source(folder).format == "folder"
    assert open_source(shards).format == "shards"
    assert open_source(str(shards / "shard-*.tar")).format == "shards"
    assert open_source(file_list).format == "list"
    assert open_source(shards, format="shards").format == "shards"
    with pytest.raises(ValueError, match="format must be one of"):
        open_source(shards, format="webdataset")
    assert expand_pattern("a-{08..10}-{x,y}.tar") == [
        "a-08-x.tar",
        "a-08-y.tar",
        "a-09-x.tar",
        "a-09-y.tar",
        "a-10-x.tar",
        "a-10-y.tar",
    ]
    assert open_source(source_of("hf", request)).format == "hf"
    assert open_source(source_of("parquet", request)).format == "hf"


# ---------------------------------------------------------------- order and resume


def batches(loader) -> list:
    return [(b.indices.clone(), b.labels.clone(), [c.clone() for c in b.crops]) for b in loader]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0])
        and torch.equal(x[1], y[1])
        and all(torch.equal(p, q) for p, q in zip(x[2], y[2], strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("kind", ["shards", "hf"])
def test_order_is_deterministic_whatever_the_threads_and_resumes_mid_epoch(kind, request):
    spec = source_of(kind, request)
    kw = dict(SMALL, seed=5, shuffle_buffer=5, drop_last=False)
    with (
        MultiCropLoader(spec, 3, **kw) as a,
        MultiCropLoader(spec, 3, **{**kw, "num_threads": 1}) as b,
    ):
        a.set_epoch(2)
        b.set_epoch(2)
        first = batches(a)
        assert same(first, batches(b))
        a.set_epoch(3)
        assert a.epoch_indices(3) != a.epoch_indices(2)
        assert sorted(a.epoch_indices(3)) == sorted(a.epoch_indices(2)) == list(range(21))
        # two batches, then the state goes with the checkpoint
        a.set_epoch(2)
        it = iter(a)
        next(it), next(it)
        state = a.state_dict()
        it.close()
    assert state["next_batch"] == 2 and state["format"] == open_source(spec).format
    with MultiCropLoader(spec, 3, **kw) as resumed:
        resumed.load_state_dict(state)
        assert same(batches(resumed), first[2:])
    with MultiCropLoader(spec, 3, **{**kw, "shuffle_buffer": 7}) as other:
        with pytest.raises(ValueError, match="shuffle_buffer"):
            other.load_state_dict(state)


def test_the_dataset_route_reads_any_source_by_index(shards, request):
    for spec in (shards, source_of("parquet", request)):
        ds = MultiCropDataset(spec, global_size=32, local_size=16, n_local=2)
        item = ds[5]
        assert len(item["crops"]) == 4 and item["index"] == 5
        assert item["label"] == ds.source.label(5) >= 0


def test_a_source_feeds_one_loaders_epochs_at_a_time(shards):
    source = open_source(shards)
    kw = dict(SMALL, drop_last=False)
    with MultiCropLoader(source, 4, **kw) as a, MultiCropLoader(source, 4, **kw) as b:
        assert sum(x.labels.numel() for x in a) == 21
        with pytest.raises(LoaderError, match="already feeds another loader"):
            list(b)
        a.close()
        assert sum(x.labels.numel() for x in b) == 21


def test_shard_order_reads_whole_shards_in_large_sequential_reads(shards):
    with MultiCropLoader(shards, 3, **SMALL, shuffle_buffer=8) as loader:
        order = loader.epoch_indices(0)
        native = loader.source.native
        shard_of = [native.shard_of(i) for i in order]
        # a window of 8 draws from at most 4 shards + the ones it moves on to
        for w in range(0, len(order), 8):
            assert len(set(shard_of[w : w + 8])) <= 6
        assert sum(b.labels.numel() for b in loader) == 21
        io = loader.stats()["io"]
    assert io["reads"] < 21 and io["bytes"] > 0  # fewer reads than images


# ---------------------------------------------------------------- bad input


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


def copy_shards(shards, dst: Path) -> Path:
    dst.mkdir()
    for p in sorted(shards.glob("*.tar")):
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_a_non_image_member_fails_its_batch_or_is_skipped_and_counted(shards, tmp_path):
    bad = copy_shards(shards, tmp_path / "bad")
    victim = sorted(bad.glob("*.tar"))[1]
    with tarfile.open(victim) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    with tarfile.open(victim, "w") as t:
        for k, (m, data) in enumerate(members):
            if k == 0:  # the shard's first image
                data = b"this is not an image"
                m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    name = members[0][0].name
    with MultiCropLoader(bad, 21, **SMALL, drop_last=False) as loader:
        with pytest.raises(LoaderError) as e:
            list(loader)
    assert f"{victim}: {name}: " in one_line(e.value)
    with MultiCropLoader(bad, 21, **SMALL, drop_last=False, on_error="skip") as loader:
        assert sum(b.labels.numel() for b in loader) == 21
        stats = loader.stats()
    assert stats["skipped"] == 1
    assert stats["skipped_files"][0].startswith(f"{victim}: {name}: ")


def test_a_truncated_shard_names_the_shard_and_member(shards, tmp_path):
    bad = copy_shards(shards, tmp_path / "cut")
    victim = sorted(bad.glob("*.tar"))[2]
    data = victim.read_bytes()
    victim.write_bytes(data[: 512 * 3 + 100])  # inside the second member's data
    with pytest.raises(SourceError) as e:
        open_source(bad)
    text = one_line(e.value)
    assert text.startswith(f"{victim}: truncated tar: member '") and "header at byte" in text


def test_a_missing_shard_is_named(shards):
    with pytest.raises(FileNotFoundError) as e:
        open_source(str(shards / "shard-{000000..000099}.tar"))
    assert f"{shards / 'shard-'}" in one_line(e.value) and "does not exist" in str(e.value)


def test_parquet_without_an_image_column_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "text.parquet"
    pq.write_table(pa.table({"caption": ["a", "b"], "label": [0, 1]}), path)
    with pytest.raises(ValueError) as e:
        open_source(path)
    assert f"{path}: no image column (columns: caption, label)" in one_line(e.value)
    with pytest.raises(ValueError, match="no column 'pixels'"):
        open_source(path, image_column="pixels")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(SourceError) as e:
        open_source(bad)
    assert one_line(e.value).startswith(f"{bad}: not a readable Parquet file")


def test_a_changed_shard_is_noticed_and_indexed_again(shards, tmp_path):
    data = copy_shards(shards, tmp_path / "changing")
    victim = sorted(data.glob("*.tar"))[0]
    with MultiCropLoader(data, 21, **SMALL, drop_last=False) as loader:
        assert loader.source.native.index_report()["built"] == len(list(data.glob("*.tar")))
        with open(victim, "ab") as f:
            f.write(bytes(1024))  # the shard grows after its index was built
        with pytest.raises(LoaderError) as e:
            list(loader)
    text = one_line(e.value)
    assert str(victim) in text and "changed since its index was built" in text
    report = open_source(data).native.index_report()
    assert report["built"] == 1 and report["loaded"] == len(list(data.glob("*.tar"))) - 1


def test_indexes_go_to_a_cache_folder_when_they_cannot_go_beside(shards, tmp_path):
    data = copy_shards(shards, tmp_path / "ro")
    for p in data.glob("*.tar"):
        Path(f"{p}.idx").mkdir()  # an index cannot be written there
    cache = tmp_path / "cache"
    source = open_source(data, index_dir=cache)
    report = source.native.index_report()
    assert report["written"] == report["built"] == len(list(data.glob("*.tar")))
    assert len(list(cache.glob("*.idx"))) == report["built"]
    assert open_source(data, index_dir=cache).native.index_report()["loaded"] == report["built"]


# ---------------------------------------------------------------- prepare


def test_prepare_writes_verifiable_shards_from_any_source(folder, file_list, tmp_path, capsys):
    from dino_opt.cli import main

    dst = tmp_path / "out"
    args = [
        "prepare",
        str(file_list),
        str(dst),
        "--format",
        "shards",
        "--shard-size",
        "0.004",
        "--max-side",
        "20",
        "--quiet",
    ]
    assert main(args) == 0
    assert "written 21 samples" in capsys.readouterr().out
    source = open_source(dst)
    assert len(source) == 21 and source.classes == list(CLASSES)
    for i in range(len(source)):
        fmt, w, h = _C.probe_image(source.read(i))
        assert fmt == "JPEG" and max(w, h) == 20
    assert sorted(source.labels().tolist()) == sorted([0] * 7 + [1] * 7 + [2] * 7)
    assert main(["prepare", str(dst), "--verify", "--quiet"]) == 0
    with pytest.raises(SystemExit):  # shards there already
        main(args)
    index = sorted(dst.glob("*.idx"))[0]
    raw = bytearray(index.read_bytes())
    raw[-20] ^= 0xFF
    index.write_bytes(bytes(raw))
    assert main(["prepare", str(dst), "--verify", "--quiet"]) == 1


# ---------------------------------------------------------------- k-NN and config


def test_knn_reads_labels_from_every_labelled_source(folder, shards, file_list, hf_data):
    reference = EvalImageFolder(folder, 16)
    by_image = {digest(reference.source.read(i)): t for i, t in enumerate(reference.targets)}
    for spec in (shards, file_list, hf_data["disk"], hf_data["parquet"]):
        ds = EvalImageFolder(spec, 16)
        assert ds.classes == list(CLASSES) and ds.named
        assert {digest(ds.source.read(i)): t for i, t in enumerate(ds.targets)} == by_image
        x, label = ds[0]
        assert x.shape == (3, 16, 16) and label == ds.targets[0]


def test_a_config_names_its_data_and_its_splits(shards, tmp_path, hf_data):
    for split in ("val", "test"):
        (tmp_path / split).mkdir()
    (tmp_path / "train-0.tar").write_bytes(b"")
    (tmp_path / "val-0.tar").write_bytes(b"")
    assert sibling_split(str(tmp_path / "train-{0..0}.tar"), "val") == str(
        tmp_path / "val-{0..0}.tar"
    )
    assert sibling_split(str(tmp_path / "train-{0..0}.tar"), "test") is None
    cfg = Config.from_dict(
        {
            "data": {"root": str(shards), "format": "shards", "shuffle_buffer": 4, "batch_size": 4},
            "augmentation": {"global_crop_size": 32, "local_crop_size": 16, "num_local_views": 2},
            "eval": {"val_root": str(shards)},
        }
    )
    roots = data_roots(cfg)
    assert roots.train == shards and roots.val == shards and roots.knn_train == shards
    loader = build_loader(cfg, roots.train, torch.device("cpu"))
    assert loader.source.format == "shards" and loader.shuffle_buffer == 4 and len(loader) == 5
    loader.close()
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_from_disk(str(hf_data["disk"]))
    dd = datasets.DatasetDict({"train": ds, "validation": ds.select(range(5))})
    dd.save_to_disk(str(tmp_path / "dd"))
    roots = data_roots(Config.from_dict({"data": {"root": str(tmp_path / "dd")}}))
    assert roots.train == tmp_path / "dd" / "train" and roots.val == tmp_path / "dd" / "validation"
    assert len(open_source(tmp_path / "dd")) == 21  # the DatasetDict's train split
    assert roots.test is None
