"""Students on their own groups of ranks (``distributed.student_groups``):
S students over W = S x G processes, rank r training student r // G.

Two kinds of process groups are made (every rank makes every one, in the
same order, as torch.distributed requires): a student's ``group`` (its G
ranks, over which DistributedDataParallel averages its gradients) and the
``peers`` of a data rank (the S ranks r % G = d, one per student, which
read the same batches). A batch's frozen-teacher forward is split over the
peers: each computes the teacher on its 1/S of the batch
(:meth:`StudentGroups.take`) and an all-gather among the peers gives every
one of them the whole batch's outputs (:meth:`StudentGroups.join`), in the
batch's order, so the teacher runs once per batch for all the students.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["StudentGroups", "data_place", "student_groups"]


@dataclass(frozen=True)
class StudentGroups:
    """This rank's place among students on their own groups of ranks:
    ``index`` (its student, of ``students``) and ``data_rank`` (its place
    in the student's group of ``size`` ranks: the loader's shard, of
    ``size``); ``group`` and ``peers`` (None alone in one): the process
    groups of its student and of its data rank."""

    students: int
    size: int
    index: int
    data_rank: int
    group: dist.ProcessGroup | None
    peers: dist.ProcessGroup | None

    @property
    def lead(self) -> bool:
        """Whether this rank leads its student's group (saves and evaluates it)."""
        return self.data_rank == 0

    def lead_rank(self, index: int) -> int:
        """The global rank that leads student ``index``'s group (its first)."""
        return index * self.size

    def take(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's 1/S of ``batch`` (its first dimension) for the teacher."""
        return batch.chunk(self.students)[self.index]

    def join(self, part: torch.Tensor) -> torch.Tensor:
        """The whole batch from every peer's ``part`` (each one's
        :meth:`take`'s result), in the batch's order."""
        if self.peers is None:
            return part
        parts = [torch.empty_like(part) for _ in range(self.students)]
        dist.all_gather(parts, part.contiguous(), group=self.peers)
        return torch.cat(parts)

    def metrics(self, names: list[str], loss: torch.Tensor, parts: dict) -> tuple:
        """``(loss, parts)`` of this rank's student so that their mean over
        every rank (the job's metric all-reduce) gives what a run of all the
        students on every rank logs: each student's loss under its name, its
        parts as ``<part>_<name>``, and ``loss`` their sum. This rank's
        values are scaled by S, the other students' are 0."""
        s = self.students
        out = {}
        for i, name in enumerate(names):
            own = i == self.index
            out[name] = loss.detach() * s if own else 0.0
            out.update(
                {f"{k}_{name}": (v * s if own else 0.0) for k, v in parts.items() if k != "loss"}
            )
        return loss.detach() * s, out


def data_place(groups: StudentGroups | None, rank: int, world: int) -> tuple[int, int]:
    """(shard, shards) of the loader of process ``rank`` of ``world``: its
    place in its student's group under ``groups``, else its own."""
    return (groups.data_rank, groups.size) if groups is not None else (rank, world)


def student_groups(students: int, rank: int, world: int, batch_size: int) -> StudentGroups:
    """The groups of ``students`` students over ``world`` ranks, for rank
    ``rank`` (every rank calls it, at the same point: it makes the process
    groups). ValueError naming the numbers when ``world`` is not a multiple
    of ``students`` or ``batch_size`` (a rank's) is not."""
    if students < 2 or world % students:
        raise ValueError(
            f"distributed.student_groups puts each of {students} students on its own group of "
            f"ranks: the number of processes ({world}) must be a multiple of {students}"
        )
    if batch_size % students:
        raise ValueError(
            f"distributed.student_groups splits each batch's teacher forward over the "
            f"{students} students' ranks: data.batch_size ({batch_size}) must be a multiple "
            f"of {students}"
        )
    size = world // students
    group = peers = None
    for i in range(students):  # every rank makes every group, in one order
        made = dist.new_group(list(range(i * size, (i + 1) * size)))
        group = made if rank // size == i else group
    for d in range(size):
        made = dist.new_group(list(range(d, world, size)))
        peers = made if rank % size == d else peers
    return StudentGroups(
        students, size, rank // size, rank % size, group if size > 1 else None, peers
    )
