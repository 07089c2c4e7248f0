"""The names a backbone key takes: the built-in backbones, and a network of
the user's own, by source (what :mod:`dino_opt.models.external` builds):

- ``timm:NAME``: ``timm.create_model(NAME)`` (no classifier, no download);
- ``torchvision:NAME``: ``torchvision.models.get_model(NAME)``;
- ``package.module:function``: the module that ``function()`` returns.

Only the spelling is checked here; whether the network exists and what it
gives is checked when it is built, before any training.

A ``package.module:function`` name imports that module (running its
import-time code) and calls the function: :func:`refuse_code` refuses one
named in a file being read (a checkpoint's or a run's config) unless the
user allowed it (``--trust-code``, or ``model.trust_code`` in the config
they gave); ``timm:`` and ``torchvision:`` names build those libraries'
own models and import nothing else.
"""

from __future__ import annotations

import re

__all__ = [
    "BACKBONE_NAMES",
    "EXTERNAL_FORMS",
    "BackboneNames",
    "external_name_problem",
    "is_external",
    "names_code",
    "refuse_code",
    "student_key",
]

#: The sources of a network of the user's own, as ``SOURCE:NAME``.
EXTERNAL_FORMS = "timm:NAME, torchvision:NAME or package.module:function"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def is_external(name: str) -> bool:
    """Whether ``name`` names a network by its source (``SOURCE:NAME``)."""
    return ":" in name


def external_name_problem(name: str) -> str | None:
    """What is wrong with the spelling of ``name`` as ``SOURCE:NAME`` (None
    when nothing is)."""
    source, _, what = name.partition(":")
    if source in ("timm", "torchvision"):
        if _NAME.fullmatch(what):
            return None
        tag = (
            "; its '.tag' names weights to download, which are not fetched: start the "
            "student from a file"
            if source == "timm" and "." in what
            else ""
        )
        return f"{source}:NAME takes a model name (letters, digits, underscores){tag}; got {name!r}"
    if not _MODULE.fullmatch(source) or not _NAME.fullmatch(what):
        return f"{name!r} is not {EXTERNAL_FORMS}"
    return None


def names_code(name: str) -> bool:
    """Whether the backbone ``name`` imports code of its own
    (``package.module:function``, not a built-in, timm or torchvision name)."""
    return is_external(name) and name.partition(":")[0] not in ("timm", "torchvision")


def refuse_code(cfg, where: str, trust_code: bool) -> None:
    """ValueError (one line, naming ``where``, the file the config ``cfg``
    was read from) when ``cfg`` names a network of code of its own
    (``model.backbone``, ``recipe.distill.students``) and the user did not
    allow it (``trust_code``: what they gave, never the file's own
    ``model.trust_code``)."""
    if trust_code:
        return
    named = [("model.backbone", cfg.model.backbone)]
    named += [("recipe.distill.students", n) for n in cfg.recipe.distill.students]
    for key, name in named:
        if names_code(name):
            module, _, function = name.partition(":")
            raise ValueError(
                f"{where}: its config names {key}={name!r}, which would import {module} and "
                f"call {function}(); code named in a file being read is not run unless you "
                "allow it: --trust-code (or model.trust_code=true in your config)"
            )


class BackboneNames(tuple):
    """The built-in backbone names as a tuple whose ``in`` also takes a
    well-spelled ``SOURCE:NAME`` (the config's choices for a backbone key)."""

    also = EXTERNAL_FORMS

    @staticmethod
    def problem(value: str) -> str | None:
        """What is wrong with ``value`` as ``SOURCE:NAME`` (None: nothing,
        or it is not one)."""
        return external_name_problem(value) if is_external(value) else None

    def __contains__(self, value) -> bool:
        if isinstance(value, str) and is_external(value):
            return external_name_problem(value) is None
        return tuple.__contains__(self, value)


BACKBONE_NAMES = BackboneNames(
    (
        "vit_tiny",
        "vit_small",
        "vit_base",
        "vit_large",
        "vit_giant2",
        "vit_small_dinov3",
        "vit_small_plus_dinov3",
        "vit_base_dinov3",
        "vit_large_dinov3",
        "vit_large_plus_dinov3",
        "vit_huge_plus_dinov3",
        "vit_7b_dinov3",
        "resnet18",
        "resnet50",
        "convnext_tiny",
        "convnext_small",
        "convnext_base",
        "convnext_large",
    )
)


def student_key(name: str) -> str:
    """The key of the student ``name`` among a distillation's students (its
    module's name, in state dicts ``members.<key>.``): the name with each
    ``.`` (which a module's name cannot hold) as ``_``."""
    return name.replace(".", "_")
