"""Checkpoint storage: atomic files, the manager, the background writers (one file, or
sharded through torch.distributed.checkpoint), RNG state; the user's outputs, written
atomically and never over what a command reads."""

from .description import RefusedCheckpointError
from .files import CheckpointWriteError, atomic_write, fsync_dir
from .manager import CheckpointManager, CheckpointRecord
from .outputs import check_output, replace_with, write_file, write_files, write_folder
from .sharded import is_sharded_checkpoint, load_shards, read_sharded
from .state import capture_rng_state, restore_rng_state, run_metadata
from .writer import AsyncCheckpointWriter, ShardedCheckpointWriter

__all__ = [
    "AsyncCheckpointWriter",
    "CheckpointManager",
    "CheckpointRecord",
    "CheckpointWriteError",
    "RefusedCheckpointError",
    "ShardedCheckpointWriter",
    "atomic_write",
    "capture_rng_state",
    "check_output",
    "fsync_dir",
    "is_sharded_checkpoint",
    "load_shards",
    "read_sharded",
    "replace_with",
    "restore_rng_state",
    "run_metadata",
    "write_file",
    "write_files",
    "write_folder",
]
