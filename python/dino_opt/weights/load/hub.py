"""Weights by name: the released DINO, DINOv2 and DINOv3 networks by their
torch.hub names (``dinov2_vits14``, ``dinov2_vitg14_reg``, ``dinov3_vitl16``,
``dino_vitb16``), any Hugging Face repository (``hf:ORG/NAME[@REVISION]``)
and timm's pretrained tags (``timm:NAME[.TAG]``), turned into the local file
or folder that :func:`~dino_opt.weights.read_weights` reads.

Nothing here downloads by hand: DINO's and DINOv2's checkpoints come through
torch.hub's downloader into its cache (``TORCH_HOME``/hub/checkpoints, the
file ``torch.hub.load_state_dict_from_url`` keeps), DINOv3's and every
``hf:`` and ``timm:`` name through huggingface_hub (its cache under
``HF_HOME``, its token for gated repositories, ``HF_HUB_OFFLINE``; with
``HF_HUB_OFFLINE=1`` torch.hub's checkpoints are not fetched either). A name
that is not cached while offline, a gated repository without access and a
name that does not exist each raise :class:`WeightsNameError`: one line
saying which, and what to do.

A path that exists always wins over a name (a folder called ``dinov2_vits14``
is read as that folder).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub import errors as hf_errors

__all__ = [
    "format_models",
    "RELEASED",
    "Released",
    "WeightsNameError",
    "cached_at",
    "is_weights_name",
    "model_rows",
    "weights_location",
]


class WeightsNameError(ValueError):
    """Weights named by a name that cannot be had here: unknown, gated, or
    offline and not cached (one line saying which and what to do)."""


_DINO = "https://dl.fbaipublicfiles.com/dino"
_DINOV2 = "https://dl.fbaipublicfiles.com/dinov2"


@dataclass(frozen=True)
class Released:
    """One released network: its torch.hub ``name``, ``family``, millions of
    parameters (``params_m``), where its weights are (``url``: a torch.hub
    checkpoint; ``repo``: a Hugging Face repository) and ``model``, the
    config keys of the network its weights hold, and ``augmentation`` the
    crop sizes it needs (patch 14: DINOv2's 224 and 98 pixels), which
    ``--adapt NAME`` and ``dino_opt.train(model=NAME)`` set before your
    overrides."""

    name: str
    family: str
    params_m: float
    url: str | None = None
    repo: str | None = None
    model: dict = field(default_factory=dict)
    gated: bool = False
    augmentation: dict = field(default_factory=dict)

    @property
    def source(self) -> str:
        return self.url if self.url else f"hf:{self.repo}"


def _dino(name: str, file: str, params: float, backbone: str, patch: int | None) -> Released:
    model = {"backbone": backbone} | ({"patch_size": patch} if patch else {})
    return Released(name, "DINO", params, f"{_DINO}/{file}/{file}.pth", model=model)


def _dinov2(size: str, params: float, backbone: str, registers: bool) -> Released:
    name = f"dinov2_vit{size}14" + ("_reg" if registers else "")
    stem = f"dinov2_vit{size}14"
    file = f"{stem}_reg4_pretrain.pth" if registers else f"{stem}_pretrain.pth"
    # as DINOv2's hub builds them: LayerScale, 518-pixel tables, offset 0.1 (registers:
    # four of them, anti-aliased resizing without the offset)
    model = {"backbone": backbone, "patch_size": 14, "layerscale_init": 1e-5, "img_size": 518}
    model |= (
        {"num_register_tokens": 4, "interpolate_offset": 0.0, "interpolate_antialias": True}
        if registers
        else {"interpolate_offset": 0.1}
    )
    crops = {"global_crop_size": 224, "local_crop_size": 98}  # multiples of its patch
    return Released(
        name, "DINOv2", params, f"{_DINOV2}/{stem}/{file}", model=model, augmentation=crops
    )


def _dinov3(size: str, params: float, backbone: str) -> Released:
    """``size``: the size of its name, ``plus`` for S+ and H+ (``s``, ``splus``, ``7b``)."""
    arch = size.replace("plus", "") + "16" + ("plus" if size.endswith("plus") else "")
    repo = f"facebook/dinov3-vit{arch}-pretrain-lvd1689m"
    return Released(
        f"dinov3_vit{arch}",
        "DINOv3",
        params,
        repo=repo,
        model={"backbone": backbone, "patch_size": 16},
        gated=True,
    )


#: The released networks by their torch.hub names (DINOv3's come from its
#: Hugging Face repositories: DINOv3's own hub takes a download link sent
#: on request, not a name).
RELEASED: dict[str, Released] = {
    r.name: r
    for r in (
        _dino("dino_vits16", "dino_deitsmall16_pretrain", 21.7, "vit_small", 16),
        _dino("dino_vits8", "dino_deitsmall8_pretrain", 21.7, "vit_small", 8),
        _dino("dino_vitb16", "dino_vitbase16_pretrain", 85.8, "vit_base", 16),
        _dino("dino_vitb8", "dino_vitbase8_pretrain", 85.8, "vit_base", 8),
        _dino("dino_resnet50", "dino_resnet50_pretrain", 23.5, "resnet50", None),
        _dinov2("s", 22.1, "vit_small", False),
        _dinov2("b", 86.6, "vit_base", False),
        _dinov2("l", 304.4, "vit_large", False),
        _dinov2("g", 1136.5, "vit_giant2", False),
        _dinov2("s", 22.1, "vit_small", True),
        _dinov2("b", 86.6, "vit_base", True),
        _dinov2("l", 304.4, "vit_large", True),
        _dinov2("g", 1136.5, "vit_giant2", True),
        _dinov3("s", 21.6, "vit_small_dinov3"),
        _dinov3("splus", 28.7, "vit_small_plus_dinov3"),
        _dinov3("b", 85.7, "vit_base_dinov3"),
        _dinov3("l", 303.1, "vit_large_dinov3"),
        _dinov3("hplus", 840.6, "vit_huge_plus_dinov3"),
        _dinov3("7b", 6716.0, "vit_7b_dinov3"),
    )
}

# A bare word in the released names' spelling: meant as a name, not a path.
_NAME_LIKE = re.compile(r"dino(v2|v3)?_[A-Za-z0-9_]+")
_FORMS = "a released name (dino-opt models lists them), hf:ORG/NAME[@REVISION] or timm:NAME[.TAG]"


def is_weights_name(value: str | os.PathLike | None) -> bool:
    """Whether ``value`` names weights (a released name, ``hf:`` or
    ``timm:``) rather than a path that exists."""
    if value is None or isinstance(value, os.PathLike) or Path(value).exists():
        return False
    text = str(value)
    return text in RELEASED or text.startswith(("hf:", "timm:")) or bool(_NAME_LIKE.fullmatch(text))


def weights_location(value: str | os.PathLike) -> Path:
    """The local file or folder of the weights ``value``: the path itself
    when it exists (or is not spelled as a name), else the named weights
    from their library's cache, downloaded there first when not cached."""
    if not is_weights_name(value):
        return Path(value)
    text = str(value)
    if text.startswith("hf:"):
        repo, _, revision = text[3:].partition("@")
        return _hf_folder(text, repo, revision or None)
    if text.startswith("timm:"):
        return _timm_file(text, text[5:])
    released = RELEASED.get(text)
    if released is None:
        close = difflib.get_close_matches(text, list(RELEASED), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise WeightsNameError(f"{text!r} is no released model's name{hint}: give {_FORMS}")
    if released.url:
        return _torch_hub_file(text, released.url)
    return _hf_folder(text, released.repo, None, released.gated)


def _offline() -> bool:
    return hf_constants.HF_HUB_OFFLINE


def _torch_hub_file(name: str, url: str) -> Path:
    """torch.hub's cached checkpoint of ``url`` (its ``checkpoints/`` folder
    under ``TORCH_HOME``), downloaded by torch.hub when missing."""
    file = _torch_hub_path(url)
    if file.is_file():
        return file
    if _offline():
        raise WeightsNameError(
            f"{name}: not in torch.hub's cache ({file}) and HF_HUB_OFFLINE=1: run once online, "
            f"or put the file {url} there"
        )
    file.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch.hub.download_url_to_file(url, str(file), progress=True)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise WeightsNameError(
            f"{name}: could not download {url} ({reason}); check the network, or put the file "
            f"at {file}"
        ) from None
    return file


def _torch_hub_path(url: str) -> Path:
    """Where ``torch.hub.load_state_dict_from_url`` keeps ``url``'s file."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)


# The files of a Hugging Face model folder that read_weights reads.
_HF_SAFETENSORS = [
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
]
_HF_LEGACY = ["config.json", "pytorch_model.bin"]


def _hf_folder(name: str, repo: str, revision: str | None, gated: bool = False) -> Path:
    """The snapshot folder of the Hugging Face repository ``repo`` (its
    config and weights; an older ``pytorch_model.bin`` where it has no
    safetensors), from huggingface_hub's cache; a timm repository's
    weights file."""
    with _hub_errors(name, repo, revision, gated):
        folder = Path(
            huggingface_hub.snapshot_download(
                repo, revision=revision, allow_patterns=_HF_SAFETENSORS
            )
        )
        if not any((folder / f).is_file() for f in _HF_SAFETENSORS[1:3]):
            folder = Path(
                huggingface_hub.snapshot_download(
                    repo, revision=revision, allow_patterns=_HF_LEGACY
                )
            )
    if _is_timm_folder(folder):  # timm's config.json, not transformers': its weights file
        return folder / "model.safetensors"
    return folder


def _is_timm_folder(folder: Path) -> bool:
    """Whether a Hugging Face folder is timm's (its config.json names an
    ``architecture``, not a transformers ``model_type``)."""
    config, weights = folder / "config.json", folder / "model.safetensors"
    if not config.is_file() or not weights.is_file():
        return False
    try:
        value = json.loads(config.read_text())
    except ValueError:
        return False
    return isinstance(value, dict) and "architecture" in value and "model_type" not in value


def _timm_file(name: str, what: str) -> Path:
    """The weights file of timm's pretrained ``what`` (``arch[.tag]``), where
    timm's pretrained config says (its Hugging Face repository, else its
    URL through torch.hub)."""
    try:
        import timm.models  # optional dependency: the `timm` extra
    except ImportError as e:
        raise ImportError(f"{name} needs the timm package: pip install 'dino_opt[timm]'") from e
    arch, _, tag = what.partition(".")
    try:
        cfg = timm.models.get_pretrained_cfg(what)
    except RuntimeError:
        tags = timm.models.list_pretrained(f"{arch}.*")
        raise WeightsNameError(
            f"{name}: timm has no pretrained tag {tag!r} for {arch}; its tags: "
            f"{', '.join(t.partition('.')[2] for t in tags)}"
        ) from None
    if cfg is None:
        close = difflib.get_close_matches(arch, timm.models.list_models(pretrained=True), n=1)
        hint = f" (did you mean 'timm:{close[0]}'?)" if close else ""
        raise WeightsNameError(f"{name}: timm has no pretrained model {arch!r}{hint}")
    if cfg.hf_hub_id:
        repo, _, revision = cfg.hf_hub_id.partition("@")
        filename = cfg.hf_hub_filename or "model.safetensors"
        with _hub_errors(name, repo, revision or None, False):
            try:
                return Path(
                    huggingface_hub.hf_hub_download(repo, filename, revision=revision or None)
                )
            except hf_errors.RemoteEntryNotFoundError:
                return Path(
                    huggingface_hub.hf_hub_download(
                        repo, "pytorch_model.bin", revision=revision or None
                    )
                )
    if cfg.url:
        return _torch_hub_file(name, cfg.url)
    raise WeightsNameError(f"{name}: timm's pretrained config names no weights to download")


class _hub_errors:  # noqa: N801 - used as a context: `with _hub_errors(...)`
    """huggingface_hub's errors as :class:`WeightsNameError` lines."""

    def __init__(self, name: str, repo: str, revision: str | None, gated: bool) -> None:
        self.name, self.repo, self.revision, self.gated = name, repo, revision, gated

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, trace) -> bool:
        if error is None:
            return False
        line = _hub_line(self.name, self.repo, self.revision, error)
        if line is None:
            return False
        raise WeightsNameError(line) from None


def _hub_line(name: str, repo: str, revision: str | None, e: BaseException) -> str | None:
    """The line for huggingface_hub's error ``e`` fetching ``repo`` (None:
    not one of its errors)."""
    page = f"https://huggingface.co/{repo}"
    if isinstance(e, hf_errors.GatedRepoError):
        return (
            f"{name}: {repo} is a gated repository and this account has no access: accept "
            f"its licence at {page}, then log in (hf auth login, or set HF_TOKEN)"
        )
    if isinstance(e, hf_errors.RepositoryNotFoundError):
        return (
            f"{name}: no repository {repo} on the Hugging Face Hub (or a private one: log "
            "in with hf auth login, or set HF_TOKEN)"
        )
    if isinstance(e, hf_errors.RevisionNotFoundError):
        return f"{name}: {repo} has no revision {revision!r}"
    if isinstance(e, (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled)):
        cache = hf_constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE=1" if _offline() else "the Hub could not be reached"
        return (
            f"{name}: {repo} is not in the Hugging Face cache ({cache}) and {why}: run once "
            "online (HF_HUB_OFFLINE unset), or point HF_HOME at a cache that has it"
        )
    if isinstance(e, hf_errors.HfHubHTTPError):
        return f"{name}: the Hugging Face Hub refused {repo}: {str(e).splitlines()[0]}"
    return None


def cached_at(released: Released) -> Path | None:
    """Where the weights of ``released`` are cached here (None: not cached),
    without any download."""
    if released.url:
        file = _torch_hub_path(released.url)
        return file if file.is_file() else None
    found = huggingface_hub.try_to_load_from_cache(released.repo, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def model_rows() -> list[dict]:
    """``dino-opt models``' rows: each released name, its family, millions
    of parameters, download size (float32), source and where it is cached."""
    rows = []
    for r in RELEASED.values():
        where = cached_at(r)
        rows.append(
            {
                "name": r.name,
                "family": r.family,
                "params_m": r.params_m,
                "download_mb": round(r.params_m * 4 * 1e6 / 2**20),
                "source": r.source,
                "gated": r.gated,
                "cached": None if where is None else str(where),
                "model": r.model,
            }
        )
    return rows


def format_models(rows: list[dict]) -> str:
    """``dino-opt models``' table of :func:`model_rows`, and the caches and
    the other forms of a name under it."""
    lines = [f"{'name':20s} {'family':7s} {'params':>8s} {'download':>9s}  cached at (or source)"]
    for r in rows:
        where = r["cached"] or f"not cached: {r['source']}" + (" (gated)" if r["gated"] else "")
        lines.append(
            f"{r['name']:20s} {r['family']:7s} {r['params_m']:7.1f}M "
            f"{r['download_mb']:>7d}MB  {where}"
        )
    offline = "on" if _offline() else "off"
    lines += [
        "",
        f"torch.hub cache: {Path(torch.hub.get_dir()) / 'checkpoints'} (TORCH_HOME)",
        f"Hugging Face cache: {hf_constants.HF_HUB_CACHE} (HF_HOME); HF_HUB_OFFLINE {offline}",
        "Also: hf:ORG/NAME[@REVISION] (a Hugging Face repository) and timm:NAME[.TAG] (timm's "
        "pretrained weights). A name is fetched into its cache the first time it is used.",
    ]
    return "\n".join(lines)
