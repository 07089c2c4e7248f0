import gc
import os
import time

import pytest
import torch
from dino_opt.data import builtin_dataset
from tiny import distill_teacher_net, tiny_one_epoch

# A time (seconds since the epoch) after which no further test starts: the GPU
# check sets it so that a run cut short still ends, its report written, with
# every test it could not start recorded as not run.
DEADLINE_ENV = "DINO_OPT_TEST_DEADLINE"
NOT_RUN = "not run: the run's time cap ({}) was reached"


# The test files that train on several processes, and the two longest that
# do not, longest first (their test-seconds in a whole run, docs/testing.md).
# Under pytest-xdist (`make test-py`: --dist loadscope --no-loadscope-reorder,
# each file on one worker, handed out in this order) they start first, so
# that the workers end together instead of one running the last long file
# alone.
LONGEST_FIRST = (
    "test_fsdp.py",
    "test_distill_groups.py",
    "test_memory_model.py",
    "test_distill_students.py",
    "test_reference_trainer.py",  # one process, but every row of the bench in it
    "test_throughput.py",
    "test_notebooks.py",
    "test_fault_tolerance.py",
    "test_resume.py",
    "test_fsdp_dinov3.py",
    "test_distill.py",
    "test_restarts.py",
)


def _start_order(item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    # Quick tests first: a run stopped at a time cap has run the most tests.
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
    if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get(DEADLINE_ENV):
        items.sort(key=_start_order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """What collecting imported, out of the cyclic collector's way (as the
    forked workers do), so a full collection walks only what the tests made
    (docs/testing.md, "What keeps it short"); its garbage goes first."""
    gc.collect()
    gc.freeze()


def pytest_runtest_setup(item):
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline and time.time() > float(deadline):
        pytest.skip(NOT_RUN.format(DEADLINE_ENV))


@pytest.fixture
def gen():
    """A generator with a fresh seed each run; the seed is printed so that a
    failure can be reproduced (pytest shows captured output of failed tests)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def distill_data(tmp_path_factory):
    """The distillation runs' data: 40 train images (5 steps per epoch at 2
    ranks of 4), 10 val."""
    return builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin",
        train_per_class=4,
        val_per_class=1,
        test_per_class=0,
        image_size=40,
    )


@pytest.fixture(scope="session")
def distill_teacher(tmp_path_factory):
    """:func:`tiny.distill_teacher_net` as DINO's backbone file."""
    path = tmp_path_factory.mktemp("teacher") / "teacher.pth"
    torch.save(distill_teacher_net().state_dict(), path)
    return path


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """A tiny built-in data set and TINY trained one epoch on it (tiny.tiny_one_epoch)."""
    return tiny_one_epoch(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_data(one_epoch):
    return one_epoch[0]


@pytest.fixture(scope="module")
def run(one_epoch):
    return one_epoch[1]
