"""Python's garbage collector kept out of the training loop
(``hardware.gc_every_steps``, :class:`dino_opt.runtime.StepCollector`)."""

import gc

import pytest
from dino_opt.cli import main
from dino_opt.config import apply_overrides, default_config
from dino_opt.job import job as job_module
from dino_opt.runtime import StepCollector
from tiny import TINY, tiny_train_only


@pytest.fixture
def collections(monkeypatch):
    """Every ``gc.collect`` call's generation (None: all), not run."""
    calls = []
    real = gc.collect
    real()  # nothing of the previous tests left for the counts to catch
    monkeypatch.setattr(gc, "collect", lambda generation=None: calls.append(generation) or 0)
    yield calls
    monkeypatch.setattr(gc, "collect", real)


def test_collection_is_off_inside_and_as_before_after(collections):
    assert gc.isenabled()
    with StepCollector(3) as c:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        for step in range(1, 10):
            c.after_step(step)
        c.after_epoch()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    # one full collection on entry, the young generations at steps 3, 6, 9, all at the epoch's end
    assert collections == [None, 1, 1, 1, None]


def test_a_collector_left_off_stays_off(collections):
    gc.disable()
    try:
        with StepCollector(5) as c:
            c.after_step(5)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert collections == [None, 1]


def test_zero_leaves_python_alone(collections):
    with StepCollector(0) as c:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        c.after_step(50)
        c.after_epoch()
    assert collections == []
    with pytest.raises(ValueError, match="every_steps"):
        StepCollector(-1)


def test_the_config_key():
    assert default_config().hardware.gc_every_steps == 50
    assert (
        apply_overrides(default_config(), ["hardware.gc_every_steps=0"]).hardware.gc_every_steps
        == 0
    )
    with pytest.raises(ValueError, match="gc_every_steps"):
        apply_overrides(default_config(), ["hardware.gc_every_steps=-2"])


def test_a_training_run_collects_between_steps(tmp_path, tmp_path_factory, monkeypatch):
    """A tiny run (2 epochs of 5 steps, gc_every_steps=2): automatic
    collection off while it trains, a young collection after steps 2, 4, ...,
    a full one after each epoch, and Python's collector back afterwards."""
    seen = []

    class Recording(StepCollector):
        def after_step(self, step: int) -> None:
            seen.append(("step", step, gc.isenabled()))
            super().after_step(step)

        def after_epoch(self) -> None:
            seen.append(("epoch", None, gc.isenabled()))
            super().after_epoch()

    monkeypatch.setattr(job_module, "StepCollector", Recording)
    root = tiny_train_only(tmp_path_factory)
    argv = [
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        "--quiet",
        f"data.root={root}",
        *TINY,
        "data.num_workers=1",
        "hardware.gc_every_steps=2",
    ]
    assert main(argv) == 0
    assert [s for kind, s, _ in seen if kind == "step"] == list(range(1, 11))
    assert [kind for kind, _, _ in seen].count("epoch") == 2
    assert not any(enabled for _, _, enabled in seen) and gc.isenabled()
