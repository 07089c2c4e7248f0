"""``dino-opt embed`` on several processes: each joins the launch's process
group and embeds its shard of the images
(:func:`~dino_opt.weights.embed_weights`), one per GPU."""

from __future__ import annotations

import tempfile

from ..observe import RunFolder
from ..runtime import init_distributed
from ..weights import embed_weights
from .agent import run_agent

__all__ = ["embed_here", "embed_on_processes"]


def embed_here(args: dict) -> dict:
    """One process's part of ``dino-opt embed`` (all of it when alone): it
    joins the launch's process group, if any, and embeds its shard."""
    info = init_distributed(args["device"])
    return embed_weights(
        args["source"],
        args["data"],
        args["output"],
        which=args["which"],
        image_size=args["image_size"],
        device=info.device,
        progress=info.rank == 0,
        batch_size=args["batch_size"],
        patch_maps=args["patch_maps"],
        force=args["force"],
    )


def embed_on_processes(options: dict, nproc: int) -> dict:
    """:func:`embed_here` in ``nproc`` processes (in this one for 1); what
    rank 0 wrote. Raises :class:`~dino_opt.distributed.WorkerFailedError`
    when a process fails."""
    if nproc <= 1:
        return embed_here(options)
    with tempfile.TemporaryDirectory(prefix="dino_opt-embed-") as folder:
        return run_agent(embed_here, (options,), folder=RunFolder(folder), nproc=nproc)[0]
