"""What a resumed run may change of the configuration its checkpoint was
trained with: the keys whose field says so (``resume``, or their section's
``MAY_CHANGE_ON_RESUME``: where things go and how they are reported, not
what is computed)."""

from __future__ import annotations

import typing

from .fields import _SECTIONS
from .schema import Config, _flat_dict
from .specs import _SPECS, _flatten

__all__ = ["may_change_on_resume", "resume_differences"]


def may_change_on_resume(section: str, key: str) -> bool:
    """Whether ``section.key`` (dotted within a nested section) may differ
    between a checkpoint and the run that resumes it; a key since removed
    as its section says."""
    spec = _SPECS.get(section, {}).get(key)
    if spec is not None:
        return spec.resume
    return bool(getattr(_SECTIONS.get(section), "MAY_CHANGE_ON_RESUME", False))


def _as_written(saved: typing.Mapping) -> dict:
    return {
        s: _flatten(s, v) if s in _SPECS and isinstance(v, typing.Mapping) else v
        for s, v in saved.items()
    }


def resume_differences(saved: typing.Mapping, current: Config) -> list[str]:
    """The keys whose values differ between a checkpoint's config (``saved``,
    the dict it stores) and ``current``, beyond those a resume may change,
    one line each. The saved config is read as a config first, so that keys
    added since it was written compare at their defaults (and old names at
    their new ones)."""
    try:
        old = _flat_dict(Config.from_dict(saved))
    except ValueError:  # a key since removed: compared as written
        old = _as_written(saved)
    now = _flat_dict(current)
    keys = []
    for section in sorted(set(old) | set(now)):
        a, b = old.get(section, {}), now.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key) and not may_change_on_resume(section, key):
                keys.append(
                    f"{section}.{key}: {a.get(key)!r} in the checkpoint, {b.get(key)!r} now"
                )
    return keys
