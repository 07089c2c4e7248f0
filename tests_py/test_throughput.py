"""The batch-size search (real training steps on a copy, OOM survived and
freed, doubling then bisection), the ViT batch-size estimate, and the
auto-configured loader."""

import copy
import weakref

import pytest
import torch
from dino_opt import _C, DINOLoss
from dino_opt import data as data_mod
from dino_opt.config import apply_overrides, default_config
from dino_opt.data import MultiCropLoader, builtin_dataset, multicrop_collate
from dino_opt.train import DINOModel, build_models
from dino_opt.tune import OptimizedDataLoader, ThroughputOptimizer, dynamic_batch_size
from dino_opt.tune import throughput as throughput_mod

N_LOCAL = 2
N_CROPS = 2 + N_LOCAL
OUT_DIM = 64
FAST = dict(steps=1, warmup=0)  # behaviour, not timing


@pytest.fixture(scope="module")
def cfg():
    return apply_overrides(
        default_config(),
        [
            "model.backbone=vit_tiny",
            "model.patch_size=8",
            "model.out_dim=64",
            "model.hidden_dim=32",
            "model.bottleneck_dim=16",
            "augmentation.global_crop_size=32",
            "augmentation.local_crop_size=16",
            f"augmentation.num_local_views={N_LOCAL}",
        ],
    )


@pytest.fixture
def dino_model(cfg):
    torch.manual_seed(0)
    student, teacher = build_models(cfg)
    return DINOModel(student, teacher, 0.996)


def sample(i: int, gen: torch.Generator) -> dict:
    crops = [torch.randn(3, 32, 32, generator=gen) for _ in range(2)]
    crops += [torch.randn(3, 16, 16, generator=gen) for _ in range(N_LOCAL)]
    return {"crops": crops, "label": i % 2, "index": i}


@pytest.fixture
def loader(gen):
    """A DataLoader of 2-image batches over an in-memory multi-crop dataset."""
    dataset = [sample(i, gen) for i in range(4)]
    return torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=multicrop_collate)


def state_of(model: DINOModel) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model: DINOModel, before: dict) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def check_table(result: dict, target: float, lo: int, hi: int) -> None:
    rows = result["trials"]
    for row in rows:
        assert set(row) == {
            "batch_size",
            "fits",
            "images_per_second",
            "peak_memory_gb",
            "memory_fraction",
            "error",
        }
        if row["error"] is None:
            assert row["images_per_second"] > 0
            assert row["fits"] == (row["memory_fraction"] <= target)
        else:
            assert not row["fits"] and row["images_per_second"] is None
    fitting = [r for r in rows if r["fits"]]
    assert lo <= result["batch_size"] <= hi
    best = max(fitting, key=lambda r: r["images_per_second"])
    assert result["batch_size"] == best["batch_size"]
    assert result["images_per_second"] == best["images_per_second"]
    assert result["largest_fitting_batch_size"] == max(r["batch_size"] for r in fitting)


# ---------------------------------------------------------------- the search, real steps


def test_search_times_real_steps_and_leaves_the_model_alone(dino_model, loader, monkeypatch):
    loss_fn = DINOLoss(OUT_DIM, N_CROPS, 0.04, 0.04, 0, 1)
    loss_fn.center.fill_(0.25)
    before, center = state_of(dino_model), loss_fn.center.clone()
    modes = [m.training for m in dino_model.modules()]
    dino_model.teacher_step = 7
    calls = []
    real_step = ThroughputOptimizer._train_step

    def spy(self, trainer, crops):
        # The trial trains a copy, with the DINO loss and AdamW, crops on the device.
        assert trainer.model is not dino_model
        assert trainer.model.student is not dino_model.student
        assert trainer.loss_fn is not loss_fn
        assert isinstance(trainer.optimizer, torch.optim.AdamW)
        assert len(crops) == N_CROPS
        w = trainer.model.student.backbone.blocks[0].mlp.fc1.weight
        t = trainer.model.teacher.backbone.blocks[0].mlp.fc1.weight
        w0, t0 = w.detach().clone(), t.detach().clone()
        real_step(self, trainer, crops)
        # A real step: the student moved and the EMA moved the teacher.
        assert not torch.equal(w, w0) and not torch.equal(t, t0)
        calls.append(crops[0].shape[0])

    monkeypatch.setattr(ThroughputOptimizer, "_train_step", spy)
    opt = ThroughputOptimizer(dino_model, "cpu", loss_fn=loss_fn)
    result = opt.find_optimal_batch_size(
        loader, max_batch_size=4, target_memory_fraction=1.0, **FAST
    )

    # All fit on the CPU (a tiny model against the host's RAM): 1, 2, 4 and no bisection;
    # 4 is beyond the loader's own batch of 2.
    assert [r["batch_size"] for r in result["trials"]] == [1, 2, 4]
    assert all(r["fits"] for r in result["trials"])
    assert calls == [1, 2, 4]
    check_table(result, 1.0, 1, 4)
    assert opt.optimal_batch_size == result["batch_size"]
    assert opt.trials == result["trials"]
    assert result["device"] == "cpu" and result["memory_total_gb"] > 0
    for row in result["trials"]:
        assert 0 <= row["memory_fraction"] < 1 and row["peak_memory_gb"] >= 0

    assert_same_state(dino_model, before)
    assert torch.equal(loss_fn.center, center)
    assert [m.training for m in dino_model.modules()] == modes
    assert dino_model.teacher_step == 7


def test_out_of_memory_is_caught_freed_and_bisected(cfg, loader, monkeypatch):
    torch.manual_seed(0)
    student, _ = build_models(cfg)  # a student alone: the teacher is a copy
    before = {k: v.clone() for k, v in student.state_dict().items()}
    limit = 5
    refs = []
    real_step = ThroughputOptimizer._train_step

    def step(self, trainer, crops):
        refs.extend(weakref.ref(x) for x in (trainer, trainer.model, trainer.optimizer, crops[0]))
        if crops[0].shape[0] > limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real_step(self, trainer, crops)

    monkeypatch.setattr(ThroughputOptimizer, "_train_step", step)
    opt = ThroughputOptimizer(student, "cpu")
    result = opt.find_optimal_batch_size(
        loader, max_batch_size=64, target_memory_fraction=1.0, **FAST
    )

    sizes = [r["batch_size"] for r in result["trials"]]
    # Doubling until the first failure, then bisection between 4 and 8.
    assert sizes == [1, 2, 4, 8, 6, 5]
    fits = {r["batch_size"]: r["fits"] for r in result["trials"]}
    assert fits == {1: True, 2: True, 4: True, 8: False, 6: False, 5: True}
    for row in result["trials"]:
        if row["batch_size"] > limit:
            assert "out of memory" in row["error"]
            assert row["images_per_second"] is None and row["memory_fraction"] is None
    assert result["batch_size"] <= limit
    assert result["largest_fitting_batch_size"] == limit
    check_table(result, 1.0, 1, 64)
    # Nothing of any trial is kept alive: not the trainer, the model copy,
    # its optimizer or the crops (the failed trials' included).
    assert len(refs) == 4 * len(sizes)
    assert all(r() is None for r in refs)
    for k, v in student.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_runtime_error_saying_out_of_memory_counts_as_not_fitting(dino_model, loader, monkeypatch):
    def step(self, trainer, crops):
        if crops[0].shape[0] > 1:
            raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(ThroughputOptimizer, "_train_step", step)
    result = ThroughputOptimizer(dino_model, "cpu").find_optimal_batch_size(
        loader, max_batch_size=8, **FAST
    )
    assert [(r["batch_size"], r["fits"]) for r in result["trials"]] == [(1, True), (2, False)]
    assert result["batch_size"] == 1


def test_other_errors_propagate(dino_model, loader, monkeypatch):
    def step(self, trainer, crops):
        if crops[0].shape[0] > 1:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(ThroughputOptimizer, "_train_step", step)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        ThroughputOptimizer(dino_model, "cpu").find_optimal_batch_size(loader, 8, **FAST)


def test_nothing_fits_raises_naming_min_batch_size(dino_model, loader, monkeypatch):
    def step(self, trainer, crops):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(ThroughputOptimizer, "_train_step", step)
    opt = ThroughputOptimizer(dino_model, "cpu")
    with pytest.raises(RuntimeError, match="min_batch_size=2 does not fit.*out of memory"):
        opt.find_optimal_batch_size(loader, 8, min_batch_size=2, **FAST)
    assert [r["batch_size"] for r in opt.trials] == [2]


# ---------------------------------------------------------------- the search, logic


def fake_measure(peak_gb_per_image: float, best: int):
    """Trials without training: peak memory proportional to the batch, the
    most images per second at ``best``."""

    def measure(self, batch_size, steps, warmup):
        seconds = batch_size / (100.0 - abs(batch_size - best))
        return seconds, int(batch_size * peak_gb_per_image * 2**30)

    return measure


@pytest.mark.parametrize(
    "min_bs, max_bs, best, sizes, largest",
    [
        # 10 GiB, 1 GiB per image, 0.9: up to 9 fit.
        (1, 512, 4, [1, 2, 4, 8, 16, 12, 10, 9], 9),
        (1, 512, 9, [1, 2, 4, 8, 16, 12, 10, 9], 9),
        # the cap: the last doubling is cut to max_batch_size, no bisection when it fits
        (1, 6, 2, [1, 2, 4, 6], 6),
        # doubling from min_batch_size
        (3, 512, 6, [3, 6, 12, 9, 10], 9),
        (9, 9, 9, [9], 9),
    ],
)
def test_doubling_then_bisection(
    dino_model, loader, monkeypatch, min_bs, max_bs, best, sizes, largest
):
    monkeypatch.setattr(ThroughputOptimizer, "_measure", fake_measure(1.0, best))
    monkeypatch.setattr(ThroughputOptimizer, "_total_memory_bytes", lambda self: 10 * 2**30)
    opt = ThroughputOptimizer(dino_model, "cpu")
    result = opt.find_optimal_batch_size(
        loader, max_batch_size=max_bs, min_batch_size=min_bs, target_memory_fraction=0.9
    )
    assert [r["batch_size"] for r in result["trials"]] == sizes
    for row in result["trials"]:
        assert row["memory_fraction"] == pytest.approx(row["batch_size"] / 10)
        assert row["fits"] == (row["batch_size"] <= 9)
        assert row["error"] is None
    assert result["largest_fitting_batch_size"] == largest
    assert result["batch_size"] == min(best, largest)
    check_table(result, 0.9, min_bs, max_bs)


def test_memory_fraction_too_high_for_the_smallest(dino_model, loader, monkeypatch):
    monkeypatch.setattr(ThroughputOptimizer, "_measure", fake_measure(1.0, 1))
    monkeypatch.setattr(ThroughputOptimizer, "_total_memory_bytes", lambda self: 2**30)
    with pytest.raises(RuntimeError, match="above target_memory_fraction=0.5"):
        ThroughputOptimizer(dino_model, "cpu").find_optimal_batch_size(
            loader, target_memory_fraction=0.5
        )


# ---------------------------------------------------------------- inputs


def test_test_batch_repeats_and_cuts_the_first_batch(dino_model, loader):
    opt = ThroughputOptimizer(dino_model, "cpu")
    from dino_opt.tune.throughput import _first_batch

    first = next(iter(loader))["crops"]
    opt._sample = _first_batch(loader)
    five = opt._create_test_batch(5)
    one = opt._create_test_batch(1)
    assert len(five) == N_CROPS
    for c, f, o in zip(first, five, one, strict=True):
        assert f.shape == (5, *c.shape[1:]) and o.shape == (1, *c.shape[1:])
        assert torch.equal(f, torch.cat([c, c, c])[:5])
        assert torch.equal(o, c[:1])


def test_a_native_loader_is_left_where_it_was(cfg, tmp_path, monkeypatch):
    root = builtin_dataset(
        tmp_path / "ds",
        train_per_class=2,
        val_per_class=1,
        test_per_class=0,
        image_size=40,
        num_workers=0,
    )
    monkeypatch.setattr(ThroughputOptimizer, "_measure", fake_measure(0.0, 2))
    torch.manual_seed(0)
    student, teacher = build_models(cfg)
    with MultiCropLoader(
        root / "train",
        2,
        global_size=32,
        local_size=16,
        n_local=N_LOCAL,
        num_threads=1,
        shuffle=False,
    ) as native:
        expected = [b.indices.tolist() for b in native]
        native.set_epoch(0)
        it = iter(native)
        assert next(it).indices.tolist() == expected[0]
        it.close()
        state = native.state_dict()
        opt = ThroughputOptimizer(DINOModel(student, teacher), "cpu")
        result = opt.find_optimal_batch_size(native, max_batch_size=4)
        assert result["batch_size"] == 2
        assert native.state_dict() == state
        assert [b.indices.tolist() for b in native] == expected[1:]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_batch_size=8, max_batch_size=4), "min_batch_size"),
        (dict(min_batch_size=0), "min_batch_size"),
        (dict(target_memory_fraction=0.0), "target_memory_fraction"),
        (dict(target_memory_fraction=1.5), "target_memory_fraction"),
        (dict(steps=0), "steps"),
        (dict(warmup=-1), "warmup"),
    ],
)
def test_bad_arguments_name_themselves(dino_model, loader, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ThroughputOptimizer(dino_model, "cpu").find_optimal_batch_size(loader, **kwargs)


def test_loss_with_other_crop_count_is_refused(dino_model, loader):
    opt = ThroughputOptimizer(dino_model, "cpu", loss_fn=DINOLoss(OUT_DIM, 10, 0.04, 0.04, 0, 1))
    with pytest.raises(ValueError, match="ncrops is 10 but .* 4 crops"):
        opt.find_optimal_batch_size(loader, **FAST)


def test_batches_without_crops_are_refused(dino_model):
    batches = [{"images": torch.zeros(2, 3, 32, 32)}]
    with pytest.raises(ValueError, match="'crops'"):
        ThroughputOptimizer(dino_model, "cpu").find_optimal_batch_size(batches, **FAST)


def test_optimizer_factory_and_config_are_used(dino_model, loader, monkeypatch):
    seen = []
    real_step = ThroughputOptimizer._train_step

    def factory(student):
        return torch.optim.SGD(student.parameters(), lr=0.1)

    def step(self, trainer, crops):
        seen.append(
            (
                type(trainer.optimizer),
                trainer.gradient_clip,
                trainer.accumulation_steps,
                trainer.freeze_last_layer,
            )
        )
        real_step(self, trainer, crops)

    monkeypatch.setattr(ThroughputOptimizer, "_train_step", step)
    opt = ThroughputOptimizer(
        dino_model,
        "cpu",
        optimizer_factory=factory,
        config={"gradient_clip": 1.5, "accumulation_steps": 4, "freeze_last_layer": 3},
    )
    opt.find_optimal_batch_size(loader, max_batch_size=1, target_memory_fraction=1.0, **FAST)
    assert seen == [(torch.optim.SGD, 1.5, 1, 0)]


# ---------------------------------------------------------------- the estimate


def test_dynamic_batch_size_matches_the_documented_formula():
    # ViT-S/16, 224 and 8 x 96 crops, bf16, on 80 GiB, by hand:
    tokens = 2 * (14 * 14 + 1) + 8 * (6 * 6 + 1)  # 394 + 296 = 690
    per_image = 12 * 384 * 2 * 16 * tokens
    head = 384 * 2048 + 2048 * 2048 + 2048 * 256 + 256 * 65536
    params = 12 * 12 * 384**2 + 3 * 16**2 * 384 + head
    available = 0.9 * 80 * 2**30 - (20 * params + 0.5 * 2**30)
    n = int(available // per_image)
    assert dynamic_batch_size(80, 224, 384) == n - n % 8
    assert 600 < dynamic_batch_size(80, 224, 384) < 800


def test_dynamic_batch_size_grows_with_memory_and_shrinks_with_size():
    sizes = [dynamic_batch_size(gb, 224, 384) for gb in (2, 4, 8, 16, 24, 40, 80)]
    assert sizes == sorted(sizes) and sizes[-1] > 4 * sizes[2]
    by_res = [dynamic_batch_size(80, r, 384) for r in (96, 160, 224, 320, 480)]
    assert by_res == sorted(by_res, reverse=True) and by_res[0] > by_res[-1]
    by_dim = [dynamic_batch_size(80, 224, d) for d in (192, 384, 768)]
    assert by_dim == sorted(by_dim, reverse=True) and by_dim[0] > by_dim[-1]
    assert dynamic_batch_size(80, 224, 384, bytes_per_value=4) < dynamic_batch_size(80, 224, 384)
    assert dynamic_batch_size(80, 224, 384, n_local=0) > dynamic_batch_size(80, 224, 384)


@pytest.mark.parametrize("gb", [0.01, 0.5, 1, 1.5, 2, 3, 6, 12, 24, 48, 80, 141])
@pytest.mark.parametrize("dim, depth, patch", [(192, 12, 16), (384, 12, 8), (768, 12, 16)])
def test_dynamic_batch_size_is_at_least_one_and_rounded(gb, dim, depth, patch):
    n = dynamic_batch_size(gb, 224, dim, patch_size=patch, depth=depth)
    assert n >= 1
    assert n in (1, 2, 4) or n % 8 == 0


def test_dynamic_batch_size_small_values_are_powers_of_two():
    # Between 1 and 8 the estimate is rounded down to 1, 2 or 4; find such memory sizes.
    small = {dynamic_batch_size(gb / 10, 224, 768) for gb in range(1, 200)}
    assert {1, 2, 4} <= small
    assert not small & {3, 5, 6, 7}


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((0, 224, 384), {}, "gpu_memory_gb"),
        ((8, 0, 384), {}, "resolution"),
        ((8, 224, -1), {}, "network_dim"),
        ((8, 8, 384), {}, "resolution"),
        ((8, 224, 384), {"n_local": -1}, "n_local"),
        ((8, 224, 384), {"patch_size": 0}, "patch_size"),
    ],
)
def test_dynamic_batch_size_bad_arguments(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        dynamic_batch_size(*args, **kwargs)


# ---------------------------------------------------------------- the loader


def test_loader_for_a_dataset_is_the_lessons_dataloader(gen, monkeypatch):
    dataset = [sample(i, gen) for i in range(6)]
    calls = []
    real = data_mod.DataLoadingOptimizer.create_optimized_dataloader

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(data_mod.DataLoadingOptimizer, "create_optimized_dataloader", spy)
    loader = OptimizedDataLoader.create(dataset, 2, num_workers=0)
    assert len(calls) == 1 and isinstance(loader, torch.utils.data.DataLoader)
    assert loader.collate_fn is multicrop_collate and loader.drop_last
    assert loader.num_workers == 0
    assert loader.pin_memory == torch.cuda.is_available()
    batch = next(iter(loader))
    assert [tuple(c.shape) for c in batch["crops"]] == [(2, 3, 32, 32)] * 2 + [(2, 3, 16, 16)] * 2

    auto = OptimizedDataLoader.create(dataset, 2)
    assert auto.num_workers == min(8, _C.available_cores())
    assert auto.prefetch_factor == 2 and auto.persistent_workers
    assert auto.pin_memory == torch.cuda.is_available()
    explicit = OptimizedDataLoader.create(
        dataset, 2, num_workers=1, prefetch_factor=3, pin_memory=True
    )
    assert explicit.num_workers == 1 and explicit.prefetch_factor == 3
    assert explicit.pin_memory == torch.cuda.is_available()  # pinning only with CUDA


def test_loader_for_a_folder_is_the_native_loader(tmp_path, monkeypatch):
    root = builtin_dataset(
        tmp_path / "ds",
        train_per_class=2,
        val_per_class=1,
        test_per_class=0,
        image_size=40,
        num_workers=0,
    )
    crops = dict(global_size=32, local_size=16, n_local=N_LOCAL)
    with OptimizedDataLoader.create(str(root / "train"), 2, **crops) as loader:
        assert isinstance(loader, MultiCropLoader)
        assert loader.pin_memory == torch.cuda.is_available()
        batch = next(iter(loader))
        assert loader.stats()["num_threads"] == min(8, _C.available_cores())
        assert [tuple(c.shape) for c in batch.crops] == [(2, 3, 32, 32)] * 2 + [(2, 3, 16, 16)] * 2

    seen = {}

    class Recorder:
        def __init__(self, source, batch_size, **kwargs):
            seen.update(source=source, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(throughput_mod, "MultiCropLoader", Recorder)
    OptimizedDataLoader.create(root / "train", 3, **crops)
    assert seen["prefetch"] == 4 and seen["num_threads"] == min(8, _C.available_cores())
    assert seen["pin_memory"] == torch.cuda.is_available() and seen["n_local"] == N_LOCAL
    paths = sorted(str(p) for p in (root / "train").rglob("*.png")) or sorted(
        str(p) for p in (root / "train").rglob("*.jpg")
    )
    OptimizedDataLoader.create(paths, 2, num_workers=0, prefetch_factor=2, pin_memory=True)
    assert seen["source"] == paths
    assert seen["num_threads"] == 1 and seen["prefetch"] == 2
    assert seen["pin_memory"] == torch.cuda.is_available()


def test_lesson_form_and_bad_inputs(gen):
    dataset = [sample(i, gen) for i in range(4)]
    wrapped = OptimizedDataLoader(dataset, batch_size=2, num_workers=0)
    assert len(wrapped) == 2
    batches = list(wrapped)
    assert len(batches) == 2 and batches[0]["crops"][0].shape == (2, 3, 32, 32)
    moved = OptimizedDataLoader.prefetch_to_gpu(batches[0], "cpu")
    assert torch.equal(moved["crops"][0], batches[0]["crops"][0])

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(TypeError, match="map-style"):
        OptimizedDataLoader.create(Stream(), 2)
    with pytest.raises(TypeError, match="native loader"):
        OptimizedDataLoader.create(dataset, 2, global_size=32)
    with pytest.raises(ValueError, match="batch_size"):
        OptimizedDataLoader.create(dataset, 0)
    with pytest.raises(ValueError, match="num_workers"):
        OptimizedDataLoader.create(dataset, 2, num_workers=-1)
    with pytest.raises(ValueError, match="prefetch_factor"):
        OptimizedDataLoader.create(dataset, 2, prefetch_factor=0)


# ---------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.slow
def test_real_search_on_a_gpu(cfg, loader):
    torch.manual_seed(0)
    student, teacher = build_models(cfg)
    model = DINOModel(student, teacher)
    before = state_of(model)
    opt = ThroughputOptimizer(copy.deepcopy(model), "cuda")
    result = opt.find_optimal_batch_size(loader, max_batch_size=16, steps=2, warmup=1)
    check_table(result, 0.9, 1, 16)
    assert [r["batch_size"] for r in result["trials"]] == [1, 2, 4, 8, 16]
    for row in result["trials"]:
        assert 0 < row["memory_fraction"] < 0.9
    # Every trial freed what it built: a second search leaves nothing more. (The
    # first matrix product of a process keeps cuBLAS's workspace, 33 MiB on an
    # H200, for the process's life: the first search grew by that much.)
    allocated = torch.cuda.memory_allocated()
    opt.find_optimal_batch_size(loader, max_batch_size=4, steps=1, warmup=1)
    assert torch.cuda.memory_allocated() <= allocated
    assert_same_state(model, before)
