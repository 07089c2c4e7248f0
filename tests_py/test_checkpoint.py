import errno
import hashlib
import json
import os
import pickle
import random
import re
import signal
import stat
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from dino_opt.checkpoint import (
    CheckpointManager,
    CheckpointWriteError,
    capture_rng_state,
    restore_rng_state,
    run_metadata,
    write_file,
    write_folder,
)
from dino_opt.checkpoint import files as ckpt
from dino_opt.runtime import GracefulStop
from torch.distributed.checkpoint.metadata import Metadata

REPO = Path(__file__).resolve().parents[1]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "student": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(5, generator=g)}}, "lr": [1e-3, 2e-3]},
        "epoch": seed,
        "name": f"run-{seed}",
        "nested": [{"a": torch.arange(seed + 1)}, (1, 2.5, "x")],
    }


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _names(mgr):
    return [r.path.name for r in mgr.checkpoints()]


def _files(directory):
    return sorted(os.listdir(directory))


# ------------------------------------------------------------------ save/load


def test_round_trip_and_recorded_checksum(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck")  # created on the first save
    state = _state(3)
    path = mgr.save(state, epoch=3, step=120)
    assert path == tmp_path / "ck" / "checkpoint-e0003-s00000120.pth"
    assert _files(tmp_path / "ck") == [
        "checkpoint-e0003-s00000120.pth",
        "checkpoint-e0003-s00000120.pth.sha256",
        "checkpoints.json",
    ]
    _assert_same(mgr.load(path), state)
    loaded, latest = mgr.load_latest()
    assert latest == path == mgr.latest_path()
    _assert_same(loaded, state)

    # The checksum computed while writing is that of the bytes on disk, in
    # the index and the sidecar alike.
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (rec,) = mgr.checkpoints()
    assert (rec.epoch, rec.step, rec.milestone, rec.sha256) == (3, 120, False, digest)
    assert rec.size == path.stat().st_size
    index = json.loads((path.parent / "checkpoints.json").read_text())
    assert [e["sha256"] for e in index["checkpoints"]] == [digest]
    assert json.loads(mgr.sidecar_path(path).read_text())["sha256"] == digest
    assert mgr.verify(path) and mgr.verify_reason(path) is None


def test_empty_or_missing_directory(tmp_path):
    mgr = CheckpointManager(tmp_path / "nothing")
    assert mgr.checkpoints() == []
    assert mgr.load_latest() is None
    assert mgr.latest_path() is None
    assert not (tmp_path / "nothing").exists()


def test_save_rejects_bad_arguments(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(TypeError):
        mgr.save([torch.zeros(1)], epoch=0, step=0)
    with pytest.raises(ValueError, match="epoch"):
        mgr.save({}, epoch=-1, step=0)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    assert _files(tmp_path) == []


def test_ordering_is_by_epoch_then_step_not_name_or_time(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=None)
    for epoch, step in [(2, 5), (10, 1), (2, 40), (0, 99999999)]:
        mgr.save({"e": epoch, "s": step}, epoch=epoch, step=step)
    assert [(r.epoch, r.step) for r in mgr.checkpoints()] == [
        (0, 99999999),
        (2, 5),
        (2, 40),
        (10, 1),
    ]
    assert mgr.load_latest()[0] == {"e": 10, "s": 1}


# ------------------------------------------------------------------- rotation


def test_rotation_keeps_last_k_and_milestones(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, milestone_every=3)
    for epoch in range(1, 8):
        mgr.save({"epoch": epoch}, epoch=epoch, step=100 * epoch, end_of_epoch=True)
        # a mid-epoch save at a milestone epoch is not a milestone
        mgr.save({"epoch": epoch, "mid": True}, epoch=epoch, step=100 * epoch + 50)
    recs = mgr.checkpoints()
    # milestones: end of epochs 3 and 6; the rest rotates, newest 2 kept
    assert [(r.epoch, r.step, r.milestone) for r in recs] == [
        (3, 300, True),
        (6, 600, True),
        (7, 700, False),
        (7, 750, False),
    ]
    # deleted checkpoints take their sidecars along; the index matches the files
    assert _files(tmp_path) == sorted(
        [r.path.name for r in recs] + [r.path.name + ".sha256" for r in recs] + ["checkpoints.json"]
    )
    index = json.loads((tmp_path / "checkpoints.json").read_text())
    assert [e["file"] for e in index["checkpoints"]] == [r.path.name for r in recs]


def test_explicit_milestone_flag_overrides(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1, milestone_every=2)
    mgr.save({}, epoch=1, step=1, milestone=True)  # not an end-of-epoch save
    mgr.save({}, epoch=2, step=2, end_of_epoch=True, milestone=False)
    mgr.save({}, epoch=3, step=3)
    mgr.save({}, epoch=4, step=4)
    assert [(r.epoch, r.milestone) for r in mgr.checkpoints()] == [(1, True), (4, False)]


def test_just_written_checkpoint_is_never_rotated_away(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save({"v": 9}, epoch=9, step=9)
    path = mgr.save({"v": 5}, epoch=5, step=5)  # e.g. a rerun from an older point
    assert path.exists() and mgr.verify(path)
    assert _names(mgr) == [path.name, "checkpoint-e0009-s00000009.pth"]


def test_prefixes_share_a_directory(tmp_path):
    a = CheckpointManager(tmp_path, keep_last=1, prefix="a")
    b = CheckpointManager(tmp_path, keep_last=1, prefix="b")
    for i in range(3):
        a.save({"a": i}, epoch=i, step=i)
        b.save({"b": i}, epoch=i, step=i)
    assert _names(a) == ["a-e0002-s00000002.pth"]
    assert _names(b) == ["b-e0002-s00000002.pth"]
    index = json.loads((tmp_path / "checkpoints.json").read_text())
    files = {e["file"] for e in index["checkpoints"]}
    assert files == {"a-e0002-s00000002.pth", "b-e0002-s00000002.pth"}


# ------------------------------------------------------------ index and sidecars


def test_index_lost_sidecars_still_verify_and_keep_milestones(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1, milestone_every=1)
    mgr.save({"x": 1}, epoch=1, step=10, end_of_epoch=True)  # milestone
    mgr.save({"x": 2}, epoch=1, step=20)
    before = mgr.checkpoints()
    (tmp_path / "checkpoints.json").unlink()

    after = mgr.checkpoints()
    assert after == before  # sha256, size, milestone, time: all from the sidecars
    assert all(mgr.verify(r.path) for r in after)
    assert mgr.load_latest()[0] == {"x": 2}

    # the next save rebuilds the index from the sidecars and still spares the milestone
    mgr.save({"x": 3}, epoch=1, step=30)
    assert [(r.step, r.milestone) for r in mgr.checkpoints()] == [(10, True), (30, False)]
    index = json.loads((tmp_path / "checkpoints.json").read_text())
    assert [e["step"] for e in index["checkpoints"]] == [10, 30]


def test_damaged_index_warns_and_uses_sidecars(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save({"x": 1}, epoch=0, step=1)
    (tmp_path / "checkpoints.json").write_text("{ not json")
    with pytest.warns(UserWarning, match="checkpoints.json.*damaged"):
        assert mgr.verify(path)


def test_sidecar_lost_index_still_verifies(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save({"x": 1}, epoch=0, step=1)
    mgr.sidecar_path(path).unlink()
    assert mgr.verify(path)


def test_unrecorded_file_does_not_verify_and_is_skipped(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = mgr.save({"x": 1}, epoch=0, step=1)
    stray = tmp_path / "checkpoint-e0000-s00000002.pth"
    torch.save({"x": 2}, stray)  # no index entry, no sidecar
    assert _names(mgr) == [good.name, stray.name]
    assert not mgr.verify(stray)
    assert "no checksum record" in mgr.verify_reason(stray)
    assert mgr.verify_reason(tmp_path / "missing.pth") == "file does not exist"
    with pytest.warns(UserWarning, match=re.escape(stray.name) + ".*no checksum record"):
        state, path = mgr.load_latest()
    assert (state, path) == ({"x": 1}, good)
    # explicit opt-out of verification
    assert mgr.load(stray, verify=False) == {"x": 2}


# ---------------------------------------------------------------- corruption


def _two_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path)
    old = mgr.save(_state(1), epoch=1, step=1)
    new = mgr.save(_state(2), epoch=2, step=2)
    return mgr, old, new


def test_truncated_newest_falls_back_with_warning(tmp_path):
    mgr, old, new = _two_checkpoints(tmp_path)
    data = new.read_bytes()
    new.write_bytes(data[: len(data) // 2])
    assert "truncated" in mgr.verify_reason(new)
    with pytest.warns(UserWarning, match=re.escape(new.name) + ".*truncated"):
        state, path = mgr.load_latest()
    assert path == old
    _assert_same(state, _state(1))
    with pytest.raises(ValueError, match=re.escape(str(new))):
        mgr.load(new)


def test_bit_flipped_newest_falls_back_with_warning(tmp_path):
    mgr, old, new = _two_checkpoints(tmp_path)
    data = bytearray(new.read_bytes())
    data[len(data) // 2] ^= 0x10
    new.write_bytes(bytes(data))
    assert not mgr.verify(new)
    assert "SHA-256 mismatch" in mgr.verify_reason(new)
    with pytest.warns(UserWarning, match=re.escape(new.name) + ".*SHA-256 mismatch"):
        state, path = mgr.load_latest()
    assert path == old
    _assert_same(state, _state(1))


def test_verified_but_unloadable_newest_falls_back(tmp_path):
    mgr, old, new = _two_checkpoints(tmp_path)
    # garbage whose checksum is correctly recorded: passes verify, fails torch.load
    garbage = b"not a zip archive" * 10
    new.write_bytes(garbage)
    entry = json.loads(mgr.sidecar_path(new).read_text())
    entry.update(sha256=hashlib.sha256(garbage).hexdigest(), size=len(garbage))
    mgr.sidecar_path(new).write_text(json.dumps(entry))
    (tmp_path / "checkpoints.json").unlink()
    assert mgr.verify(new)
    with pytest.warns(UserWarning, match=re.escape(new.name) + ".*cannot be loaded"):
        assert mgr.load_latest()[1] == old


def test_all_corrupt_gives_none(tmp_path):
    mgr, old, new = _two_checkpoints(tmp_path)
    for p in (old, new):
        p.write_bytes(b"")
    with pytest.warns(UserWarning) as record:
        assert mgr.load_latest() is None
    text = " ".join(str(w.message) for w in record)
    assert old.name in text and new.name in text


def test_pickled_objects_need_opt_in(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save({"when": __import__("datetime").date(2024, 1, 2)}, epoch=0, step=0)
    with pytest.raises(ValueError, match="cannot be loaded"):
        mgr.load(path)
    assert mgr.load(path, allow_pickle=True)["when"].year == 2024


# ------------------------------------------------------------- failing writes


def _snapshot(directory):
    return {name: (directory / name).read_bytes() for name in _files(directory)}


def test_torch_save_oserror_leaves_everything_untouched(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    good = mgr.save(_state(1), epoch=1, step=1)
    before = _snapshot(tmp_path)

    def full(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    target = mgr.path_for(2, 2)
    with pytest.raises(CheckpointWriteError) as info:
        mgr.save(_state(2), epoch=2, step=2)
    msg = str(info.value)
    assert str(target) in msg and "disk full" in msg
    assert info.value.errno == errno.ENOSPC and info.value.path == target
    assert isinstance(info.value, OSError)
    # no temp file, no new sidecar, index and old checkpoint byte-identical
    assert _snapshot(tmp_path) == before
    monkeypatch.undo()
    state, path = mgr.load_latest()
    assert path == good
    _assert_same(state, _state(1))


class _FullDisk:
    """A file that takes ``room`` bytes, then fails like a full disk."""

    def __init__(self, f, room):
        self._f = f
        self.room = room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_write_failing_mid_stream_reports_the_os_error(tmp_path, monkeypatch):
    """torch's C++ writer turns an OSError from the file into a vague
    RuntimeError; the message must still say what happened."""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    good = mgr.save(_state(1), epoch=1, step=1)
    before = _snapshot(tmp_path)
    real_fdopen = os.fdopen
    opened = []

    def fdopen(fd, mode="r", *args, **kwargs):
        f = _FullDisk(real_fdopen(fd, mode, *args, **kwargs), room=300)
        opened.append(f)
        return f

    monkeypatch.setattr(ckpt.os, "fdopen", fdopen)
    with pytest.raises(CheckpointWriteError, match="disk full") as info:
        mgr.save({"big": torch.zeros(10_000)}, epoch=2, step=2)
    monkeypatch.undo()
    assert opened and opened[0].room < 300  # some bytes did reach the temp file
    assert str(mgr.path_for(2, 2)) in str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert _snapshot(tmp_path) == before
    assert mgr.load_latest()[1] == good


def test_failed_rename_restores_the_sidecar_and_deletes_nothing(tmp_path, monkeypatch):
    """Overwriting a checkpoint whose final rename fails: the sidecar, which is
    replaced just before, is put back, so the old file still verifies; and
    no rotation happens."""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save({"x": 0}, epoch=0, step=0)
    good = mgr.save({"x": 1}, epoch=1, step=1)
    before = _snapshot(tmp_path)
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith(".pth"):
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    for epoch, step in [(1, 1), (2, 2)]:  # an overwrite, then a new file
        with pytest.raises(CheckpointWriteError, match="I/O error"):
            mgr.save({"x": 9}, epoch=epoch, step=step)
        assert _snapshot(tmp_path) == before
    monkeypatch.undo()
    assert mgr.verify(good)
    assert mgr.load_latest() == ({"x": 1}, good)


def test_unpicklable_state_raises_write_error(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointWriteError, match="checkpoint-e0000-s00000000.pth"):
        mgr.save({"f": lambda: None}, epoch=0, step=0)
    assert _files(tmp_path) == []


def test_checkpoints_and_outputs_are_as_readable_as_the_umask_allows(tmp_path):
    """Not mkstemp's 0600 (nor mkdtemp's 0700): the group sees what a run wrote."""
    umask = os.umask(0o022)
    os.umask(umask)
    mgr = CheckpointManager(tmp_path / "run")
    path = mgr.save({"x": 1}, epoch=0, step=0)
    out = write_file(tmp_path / "e.csv", lambda f: f.write(b"1"))
    folder = write_folder(tmp_path / "masks", lambda d: (d / "a.png").write_bytes(b"m"))
    for file in (path, mgr.sidecar_path(path), out):
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask


def test_permission_denied_creating_temp_file(tmp_path, monkeypatch):
    """Runs as root too (unlike the chmod test below)."""
    mgr = CheckpointManager(tmp_path)
    mgr.save({"x": 1}, epoch=0, step=0)
    before = _snapshot(tmp_path)

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ckpt.tempfile, "mkstemp", denied)
    with pytest.raises(CheckpointWriteError, match="permission denied"):
        mgr.save({"x": 2}, epoch=0, step=1)
    assert _snapshot(tmp_path) == before


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores file permissions"
)
def test_read_only_directory(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = mgr.save({"x": 1}, epoch=0, step=0)
    before = _snapshot(tmp_path)
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(CheckpointWriteError) as info:
            mgr.save({"x": 2}, epoch=0, step=1)
        assert str(mgr.path_for(0, 1)) in str(info.value)
        assert "permission denied" in str(info.value)
        assert _snapshot(tmp_path) == before
        assert mgr.load_latest() == ({"x": 1}, good)
    finally:
        tmp_path.chmod(stat.S_IRWXU)


def test_remove_stale_temp_files(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = mgr.save({"x": 1}, epoch=0, step=0)
    stale = tmp_path / ".checkpoint-e0000-s00000001.pth.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    orphan = tmp_path / "checkpoint-e0000-s00000009.pth.sha256"
    orphan.write_text("{}")
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    assert sorted(mgr.remove_stale_temp_files()) == sorted([stale, orphan])
    assert _files(tmp_path) == sorted(
        [good.name, good.name + ".sha256", "checkpoints.json", "notes.txt"]
    )


# ------------------------------------------------------------------------ RNG


def _draws():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),  # noqa: NPY002 (the global RNG is what is saved)
        torch.rand(3).tolist(),
        torch.randn(2, generator=None).tolist(),
    )


def test_rng_capture_restore_reproduces_draws():
    random.seed(1)
    np.random.seed(2)  # noqa: NPY002
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in the Python state
    np.random.standard_normal()  # noqa: NPY002  (and a cached one in NumPy's)
    state = capture_rng_state()
    expected = _draws()
    _draws()  # move every generator on
    restore_rng_state(state)
    assert _draws() == expected


def test_rng_state_survives_a_weights_only_checkpoint(tmp_path):
    torch.manual_seed(0)
    state = capture_rng_state()
    expected = _draws()
    mgr = CheckpointManager(tmp_path)
    mgr.save({"rng": state}, epoch=0, step=0)
    loaded, _ = mgr.load_latest()  # weights_only=True, no pickle fallback
    _draws()
    restore_rng_state(loaded["rng"])
    assert _draws() == expected


def test_rng_restore_rejects_bad_states():
    state = capture_rng_state()
    with pytest.raises(ValueError, match="lacks numpy"):
        restore_rng_state({k: v for k, v in state.items() if k != "numpy"})
    with pytest.raises(ValueError, match="malformed"):
        restore_rng_state({**state, "python": (3, "nonsense")})


def test_rng_restore_with_missing_cuda_devices():
    state = capture_rng_state()
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # one CUDA state more than there are devices (valid ones where they are applied)
    cuda = list(state.get("cuda", []))
    fake = {**state, "cuda": cuda + [cuda[0] if cuda else torch.zeros(16, dtype=torch.uint8)]}
    expected = _draws()
    with pytest.raises(ValueError, match=f"{have + 1} device.*sees {have}"):
        restore_rng_state(fake)
    assert _draws() != expected  # the refused restore changed nothing
    with pytest.warns(UserWarning, match="restoring the first"):
        restore_rng_state(fake, strict=False)
    assert _draws() == expected


# ------------------------------------------------------------------ metadata


def test_run_metadata_in_a_checkout(monkeypatch):
    monkeypatch.chdir(REPO)
    meta = run_metadata()
    if meta["git_commit"] is None:
        pytest.skip("git is not usable here")
    assert re.fullmatch(r"[0-9a-f]{40}", meta["git_commit"])
    assert isinstance(meta["git_dirty"], bool)
    import dino_opt

    assert meta["dino_opt_version"] == dino_opt.__version__
    assert meta["torch_version"] == torch.__version__
    assert meta["hostname"]


def test_run_metadata_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    meta = run_metadata(tmp_path)
    assert meta["git_commit"] is None and meta["git_dirty"] is None
    assert meta["torch_version"] == torch.__version__


# -------------------------------------------------------------- GracefulStop


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_graceful_stop_sets_flag_and_restores_handlers(sig):
    hits = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: hits.append(s))
    sigterm_before = signal.getsignal(signal.SIGTERM)
    try:
        with GracefulStop() as stop:
            assert stop.active and not stop.requested and stop.signal_name is None
            os.kill(os.getpid(), sig)
            assert stop.requested
            assert stop.signal_name == sig.name
            os.kill(os.getpid(), signal.SIGUSR1)  # a later signal does not overwrite
            assert stop.signal_name == sig.name
        assert hits == []  # the old handler did not see them
        assert not stop.active
        assert signal.getsignal(signal.SIGTERM) == sigterm_before
        os.kill(os.getpid(), signal.SIGUSR1)  # the old handler is back
        assert hits == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_graceful_stop_second_sigint_force_quits():
    sigint_before = signal.getsignal(signal.SIGINT)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == sigint_before


def test_graceful_stop_off_main_thread_is_a_noop():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    result = {}

    def worker():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with GracefulStop() as stop:
                result["active"] = stop.active
                result["handlers"] = {s: signal.getsignal(s) for s in handlers}
            result["warned"] = any("main thread" in str(w.message) for w in caught)
            result["requested"] = stop.requested

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert result == {
        "active": False,
        "handlers": handlers,
        "warned": True,
        "requested": False,
    }


def _sharded_folder(manager: CheckpointManager, epoch: int, step: int) -> Path:
    """What the ranks of a sharded save leave in the hidden folder (shards,
    description, small state), ready to publish."""
    partial = manager.partial_path(manager.path_for(epoch, step, sharded=True))
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(os.urandom(1000))
    (partial / "__1_0.distcp").write_bytes(os.urandom(900))
    (partial / ".metadata").write_bytes(pickle.dumps(Metadata({}, storage_data={})))
    torch.save({"step": step}, partial / "extra.pt")
    return partial


def test_sharded_checkpoints_are_published_verified_rotated_and_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path / "ck", keep_last=2)
    for step in (1, 2, 3):
        path = manager.publish_sharded(_sharded_folder(manager, 0, step), epoch=0, step=step)
        assert path.name == f"checkpoint-e0000-s{step:08d}.dcp" and path.is_dir()
    records = manager.checkpoints()
    assert [r.step for r in records] == [2, 3]  # the oldest folder rotated away
    assert records[-1].size == sum(p.stat().st_size for p in path.iterdir())
    assert manager.verify(path) and manager.load(path, tensors=False) == {"step": 3}
    (path / "__1_0.distcp").write_bytes(b"short")
    assert "__1_0.distcp has 5 bytes" in manager.verify_reason(path)
    (path / "__1_0.distcp").unlink()
    assert manager.verify_reason(path) == "__1_0.distcp is missing"
    with pytest.warns(UserWarning, match="__1_0.distcp is missing; falling back"):
        assert manager.load_latest(tensors=False)[1].name.endswith("s00000002.dcp")
    # a save killed before publishing, and a deletion killed half way, are cleared
    _sharded_folder(manager, 1, 9)
    (manager.directory / ".checkpoint-e0000-s00000001.dcp.deleting").mkdir()
    assert [r.step for r in manager.checkpoints()] == [2, 3]
    removed = {p.name for p in manager.remove_stale_temp_files()}
    assert removed == {
        ".checkpoint-e0001-s00000009.dcp.partial",
        ".checkpoint-e0000-s00000001.dcp.deleting",
    }
    assert not any(p.name.startswith(".checkpoint") for p in manager.directory.iterdir())
