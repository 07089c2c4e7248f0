"""Batches copied to the GPU a batch ahead, on a stream of their own.

A copy from pinned memory issued on the compute stream waits for the work
queued before it and holds back the work after it. Issued on a side stream
while the previous batch trains, it overlaps that batch's compute; the
compute stream waits only for the copy's event, when the batch is used
(docs/loader.md, "Copied a batch ahead")."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch

__all__ = ["DeviceCopy", "one_ahead"]

T = TypeVar("T")
U = TypeVar("U")


def one_ahead(items: Iterable[T], start: Callable[[T], U]) -> Iterator[tuple[T, U]]:
    """``(item, start(item))`` for each of ``items`` in order, ``start`` of
    the next item called before the current pair is yielded: the next
    batch's copy is under way while the consumer works on this one."""
    pending = None
    for item in items:
        started = (item, start(item))
        if pending is not None:
            yield pending
        pending = started
    if pending is not None:
        yield pending


class DeviceCopy:
    """Non-blocking copies of ``tensors`` (None kept) to the CUDA ``device``,
    issued on ``stream`` and marked by an event; :meth:`wait` makes the
    current stream wait for them and hands them over to it."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor | None],
        device: torch.device,
        stream: torch.cuda.Stream,
    ) -> None:
        self.device = device
        with torch.cuda.stream(stream):
            self.tensors = [None if t is None else t.to(device, non_blocking=True) for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def wait(self) -> list[torch.Tensor | None]:
        """The copied tensors, usable on the current stream: it waits for the
        copies, and each tensor's memory is kept from reuse until the work
        queued on that stream is done with it."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.event)
        for t in self.tensors:
            if t is not None:
                t.record_stream(current)
        return self.tensors
