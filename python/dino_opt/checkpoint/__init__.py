"""Checkpoint storage: atomic files, the manager, the background writer, RNG state."""

from .files import CheckpointWriteError, atomic_write, fsync_dir
from .manager import CheckpointManager, CheckpointRecord
from .state import capture_rng_state, restore_rng_state, run_metadata
from .writer import AsyncCheckpointWriter

__all__ = [
    "AsyncCheckpointWriter",
    "CheckpointManager",
    "CheckpointRecord",
    "CheckpointWriteError",
    "atomic_write",
    "capture_rng_state",
    "fsync_dir",
    "restore_rng_state",
    "run_metadata",
]
