"""``dino-opt doctor``: the versions, the kernels of this build by device,
and every fused operator checked on the device (:mod:`dino_opt.doctor`,
which also runs alone as ``python -m dino_opt.doctor``)."""

from __future__ import annotations

from .. import doctor

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    d = sub.add_parser(
        "doctor", help="versions, kernels by device, and a self-check of every operator here"
    )
    doctor.add_arguments(d)
    d.set_defaults(run=doctor.run)
