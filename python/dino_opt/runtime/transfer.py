"""A state sent from one rank to another with its tensors' bytes as one
buffer: :func:`send_state` and :func:`recv_state`.

``torch.distributed.send_object_list`` pickles its object, tensors
included, through ``torch.save`` into bytes, copies those into a byte
tensor, and the receiver copies them out again and unpickles them: a
student's networks and AdamW state (a ResNet-18's is ~190 MB) are copied
five times and go through pickle's byte handling. Here the object is
pickled with each dense tensor (a plain ``torch.Tensor``; parameters and
other subclasses are pickled as usual) left out (a persistent id), the tensors'
bytes are copied once into one buffer, and the receiver's tensors are views
of the buffer it received (two point-to-point messages: sizes, then the
pickle and the bytes).
"""

from __future__ import annotations

import io
import pickle

import torch
import torch.distributed as dist

__all__ = ["recv_state", "send_state"]

_ALIGN = 64  # each tensor's bytes start at a multiple: any dtype's view is aligned


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Packer(pickle.Pickler):
    """Pickles an object with each dense tensor replaced by its slot: its
    number, its place in the buffer, its dtype and its shape (a tensor met
    twice is one slot)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[torch.Tensor, int]] = []  # each with its offset
        self.slots: dict[int, tuple] = {}
        self.size = 0

    def persistent_id(self, obj):
        plain = type(obj) is torch.Tensor  # not a Parameter, DTensor or other subclass
        if not plain or obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
            return None
        slot = self.slots.get(id(obj))
        if slot is None:
            offset = _aligned(self.size)
            nbytes = obj.numel() * obj.element_size()
            slot = (len(self.tensors), offset, nbytes, obj.dtype, tuple(obj.shape))
            self.slots[id(obj)] = slot
            self.tensors.append((obj, offset))
            self.size = offset + nbytes
        return slot


class _Unpacker(pickle.Unpickler):
    """Unpickles a :class:`_Packer`'s object, each slot a view of ``payload``
    (the same tensor object for each use of one slot, as pickle gives)."""

    def __init__(self, file, payload: torch.Tensor):
        super().__init__(file)
        self.payload = payload
        self.loaded: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid):
        index, offset, nbytes, dtype, shape = pid
        if index not in self.loaded:
            view = self.payload[offset : offset + nbytes].view(dtype).view(shape)
            self.loaded[index] = view
        return self.loaded[index]


def _pack(obj) -> tuple[torch.Tensor, int, int]:
    """``(buffer, pickle's size, where the tensors' bytes start)``: one byte
    tensor holding ``obj`` pickled without its tensors, then their bytes."""
    header = io.BytesIO()
    packer = _Packer(header)
    packer.dump(obj)
    head = header.getbuffer()
    start = _aligned(len(head))
    out = torch.empty(start + packer.size, dtype=torch.uint8)
    out[: len(head)] = torch.frombuffer(head, dtype=torch.uint8)
    for t, offset in packer.tensors:
        if t.numel():
            at = start + offset
            view = out[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t.detach())
    return out, len(head), start


def _device(group) -> torch.device:
    """Where the messages must be for ``group``'s backend (NCCL: this rank's GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_state(obj, dst: int, group=None) -> None:
    """Sends ``obj`` (picklable; its tensors on any device) to rank ``dst``
    (a global rank), which calls :func:`recv_state`."""
    buffer, head, start = _pack(obj)
    device = _device(group)
    sizes = torch.tensor([head, start, buffer.numel()], dtype=torch.int64, device=device)
    dist.send(sizes, dst, group=group)
    dist.send(buffer.to(device), dst, group=group)


def recv_state(src: int, group=None):
    """What rank ``src`` sent with :func:`send_state`: its tensors on the
    CPU, each a view of the one buffer received."""
    device = _device(group)
    sizes = torch.empty(3, dtype=torch.int64, device=device)
    dist.recv(sizes, src, group=group)
    head, start, total = sizes.tolist()
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    dist.recv(buffer, src, group=group)
    buffer = buffer.cpu()
    header = io.BytesIO(buffer[:head].numpy().tobytes())
    return _Unpacker(header, buffer[start:]).load()
