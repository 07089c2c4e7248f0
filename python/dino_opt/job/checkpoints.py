"""The checkpoints of a run as the job reads and writes them
(:class:`RunCheckpoints`): the one a run resumes from, one read back for a
rollback, and the writes: synchronous, in the background
(``checkpoint.async``), or every rank's shards (fsdp)."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import (
    AsyncCheckpointWriter,
    CheckpointManager,
    ShardedCheckpointWriter,
    is_sharded_checkpoint,
)
from .parts import ResumeError
from .sharding import split_shards

__all__ = ["RunCheckpoints"]


class RunCheckpoints:
    """The run folder's ``checkpoints/`` (``manager``) for one process of the
    job. Rank 0 (``lead``) writes them, or every rank its shards when the run
    is ``sharded``; ``asynchronous``: through a background writer, once
    :meth:`start_writer` has made it. Built by the job's set-up, once the run
    folder and the strategy are fixed."""

    def __init__(
        self, manager: CheckpointManager, *, lead: bool, sharded: bool, asynchronous: bool
    ):
        self.manager = manager
        self.lead, self.sharded, self.asynchronous = lead, sharded, asynchronous
        self.writer: AsyncCheckpointWriter | ShardedCheckpointWriter | None = None

    def to_resume(
        self, resume: str | None, *, restarted: bool, output_dir: Path
    ) -> tuple[dict, Path] | None:
        """The checkpoint a run resumes from (``checkpoint.resume``; after a
        restart by the launcher, ``restarted``, the newest complete one),
        read for this run; None for a fresh start."""
        manager = self.manager
        if restarted and manager.checkpoints():
            return self._for_this_run(manager.load_latest(tensors=not self.sharded))
        if resume is None:
            if manager.checkpoints():
                raise ResumeError(
                    f"run folder {str(output_dir)!r} already holds checkpoints; continue "
                    "it with checkpoint.resume=auto, or choose another output folder"
                )
            return None
        if resume == "auto":
            return self._for_this_run(manager.load_latest(tensors=not self.sharded))
        path = Path(resume)
        verify = manager.sidecar_path(path).exists() or path.parent == manager.directory
        try:
            state = manager.load(path, verify=verify, tensors=not self.sharded)
        except (ValueError, OSError) as e:
            raise ResumeError(f"checkpoint.resume={resume!r}: {e}") from e
        return self._for_this_run((state, path))

    def read(self, path: Path) -> dict:
        """A checkpoint of the folder, read for this run (a rollback's target)."""
        state = self.manager.load(path, tensors=not self.sharded)
        return self._for_this_run((state, path))[0]

    def _for_this_run(self, resumed: tuple[dict, Path] | None) -> tuple[dict, Path] | None:
        """A checkpoint read for this run. A sharded run of a sharded folder
        gets its small state only (``shards`` names the folder the networks
        load from); of the other strategy, the whole state (a ddp file is
        read whole, so is a sharded folder by a ddp run)."""
        if resumed is not None and self.sharded and is_sharded_checkpoint(resumed[1]):
            resumed[0]["shards"] = resumed[1]
        return resumed

    def start_writer(self) -> None:
        """The background writer: every rank's when sharded (each writes its
        shards), rank 0's with ``checkpoint.async``; none otherwise."""
        if self.sharded:
            self.writer = ShardedCheckpointWriter(
                self.manager, lead=self.lead, asynchronous=self.asynchronous
            )
        elif self.lead and self.asynchronous:
            self.writer = AsyncCheckpointWriter(self.manager)

    def write(
        self, state: dict, reason: str, *, epoch: int, step: int, end_of_epoch: bool, wait: bool
    ) -> Path | None:
        """One checkpoint (rank 0, or every rank of a sharded run): at once,
        or through the writer (whose save first raises the error of the write
        before, if any), waited for when ``wait``. Its path on rank 0."""
        kwargs = dict(
            epoch=epoch,
            step=step,
            end_of_epoch=end_of_epoch,
            milestone=True if reason == "final" else None,
        )
        if self.sharded:
            path = self.writer.save(split_shards(state), state, **kwargs)
            if wait:
                self.writer.wait()
            return path if self.lead else None
        if self.writer is None:
            return self.manager.save(state, **kwargs)
        path = self.writer.save(state, **kwargs)
        if wait:
            self.writer.wait()
        return path

    def wait(self) -> None:
        """Until the write in flight, if any, is on disk (raises its error)."""
        if self.writer is not None:
            self.writer.wait()
