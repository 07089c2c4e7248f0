"""Model-level speed-ups: fused attention, channels_last and ``torch.compile``.

This is the course's ``ModelOptimizer`` (Module 5, Lesson 4), done correctly:

- :func:`optimize_attention` finds self-attention modules that compute
  ``softmax(q @ k^T * scale) @ v`` by hand (the facebookresearch/dino
  ``Attention``, timm's ``Attention``) and makes them call
  ``torch.nn.functional.scaled_dot_product_attention`` (SDPA), which dispatches
  to flash / memory-efficient kernels on GPUs and never materialises the
  N x N attention matrix. Each conversion is verified in float64 against the
  module's own forward before anything is changed. The module keeps its class,
  its parameters, its hooks and its ``state_dict`` keys.
- :meth:`ModelOptimizer.optimize_model` applies the fused attention,
  channels_last (only where there are convolutions that gain from it) and
  ``torch.compile`` (in place, so that ``state_dict`` keys keep their names),
  and records what it did; :func:`optimize_model_report` also measures the
  compilation's warm-up cost against a steady call.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import COMPILE_MODES
from ..models.vit import Attention as _OwnAttention

__all__ = [
    "COMPILE_MODES",
    "CONFIG_KEYS",
    "ModelOptimizer",
    "SDPAForward",
    "explicit_attention",
    "optimize_attention",
    "optimize_model",
    "optimize_model_report",
    "restore_attention",
]

logger = logging.getLogger(__name__)

# Keys of the ``optimize_model`` configuration and their defaults (everything off).
CONFIG_KEYS = {
    "compile": False,
    "compile_mode": "default",
    "channels_last": False,
    "optimize_attention": False,
}
# The lesson spells the compile switch ``compile_model``; it is accepted as an alias.
_ALIASES = {"compile_model": "compile"}

# Children a hand-written attention may have for its forward to be replaced; any
# other child (relative position bias, rotary embedding, ...) may take part in the
# forward in a way the SDPA forward would not reproduce, so such modules are left alone.
_KNOWN_CHILDREN = frozenset({"qkv", "proj", "attn_drop", "proj_drop", "q_norm", "k_norm"})

# Relative tolerance of the float64 check of each conversion.
_CHECK_RTOL = 1e-6
# Shape of the random token input of the check / probe: (batch, tokens).
_PROBE_SHAPE = (2, 7)


# --------------------------------------------------------------------------- attention


class SDPAForward:
    """The forward that :func:`optimize_attention` installs on a hand-written
    attention module (as the instance attribute ``forward``).

    It computes the same function as the module's own forward with
    ``scaled_dot_product_attention``: ``qkv`` -> optional ``q_norm`` / ``k_norm``
    -> SDPA with the module's ``scale`` (dropout ``attn_drop.p`` in training
    only) -> ``proj`` -> ``proj_drop``. A module whose forward returned a tuple
    ``(x, attn)`` (the DINO ``Attention``) gets ``(x, None)``: the fused kernels
    never form the attention matrix. Use :func:`explicit_attention` where the
    matrix is needed (attention maps, ``get_last_selfattention``).

    Calls with more arguments than the tokens (masks, biases) and inputs that are
    not (B, N, C) go to the module's own forward. The object is picklable and is
    re-bound by ``copy.deepcopy`` to the copy of its module.
    """

    def __init__(self, module: nn.Module, n_outputs: int) -> None:
        self.module = module
        # 0: the module returns a tensor; k >= 1: a tuple of k elements, x first.
        self.n_outputs = n_outputs
        self.enabled = True

    def original(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own (class) forward."""
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if (
            not self.enabled
            or args
            or any(v is not None for v in kwargs.values())
            or not isinstance(x, torch.Tensor)
            or x.dim() != 3
        ):
            return self.original(x, *args, **kwargs)
        out = _sdpa_attention(self.module, x)
        if self.n_outputs == 0:
            return out
        return (out,) + (None,) * (self.n_outputs - 1)

    def __repr__(self) -> str:
        return f"SDPAForward({type(self.module).__name__}, n_outputs={self.n_outputs})"


def _scale_of(m: nn.Module, head_dim: int) -> float:
    scale = getattr(m, "scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    return head_dim**-0.5


def _sdpa_attention(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    b, n, _ = x.shape
    heads = m.num_heads
    inner = m.qkv.out_features // 3
    head_dim = inner // heads
    # (B, N, 3*inner) -> (3, B, heads, N, head_dim)
    q, k, v = m.qkv(x).reshape(b, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q_norm = getattr(m, "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    k_norm = getattr(m, "k_norm", None)
    if k_norm is not None:
        k = k_norm(k)
    attn_drop = getattr(m, "attn_drop", None)
    p = attn_drop.p if m.training and isinstance(attn_drop, nn.Dropout) else 0.0
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=_scale_of(m, head_dim))
    out = m.proj(out.transpose(1, 2).reshape(b, n, inner))
    proj_drop = getattr(m, "proj_drop", None)
    return proj_drop(out) if proj_drop is not None else out


def _forward_uses_sdpa(m: nn.Module) -> bool:
    """Whether the class's forward already calls scaled_dot_product_attention
    (its code names it), as our ViT's and timm's fused paths do."""
    code = getattr(type(m).forward, "__code__", None)
    return code is not None and "scaled_dot_product_attention" in code.co_names


def _has_qkv_shape(m: nn.Module) -> bool:
    qkv = getattr(m, "qkv", None)
    heads = getattr(m, "num_heads", None)
    if not isinstance(qkv, nn.Linear) or isinstance(heads, bool) or not isinstance(heads, int):
        return False
    if heads <= 0 or qkv.out_features % 3 != 0 or (qkv.out_features // 3) % heads != 0:
        return False
    return True


def _classify(m: nn.Module) -> str | None:
    """``"timm"`` (timm-style, fused path switched off), ``"manual"`` (attention
    computed by hand, forward to be replaced) or None (not a candidate, or
    already fused)."""
    if isinstance(m, _OwnAttention) or isinstance(m.__dict__.get("forward"), SDPAForward):
        return None
    if not _has_qkv_shape(m):
        return None
    if "fused_attn" in m.__dict__ or hasattr(type(m), "fused_attn"):
        return "timm" if m.fused_attn is False else None
    if _forward_uses_sdpa(m):
        return None
    head_dim = (m.qkv.out_features // 3) // m.num_heads
    scale = getattr(m, "scale", None)
    given_head_dim = getattr(m, "head_dim", None)
    has_scale = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if not has_scale and given_head_dim is None:
        return None
    if given_head_dim is not None and given_head_dim != head_dim:
        return None
    if not isinstance(getattr(m, "proj", None), nn.Module):
        return None
    if not set(dict(m.named_children())) <= _KNOWN_CHILDREN:
        return None
    if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(False)):
        return None
    attn_drop = getattr(m, "attn_drop", None)
    if attn_drop is not None and not isinstance(attn_drop, (nn.Dropout, nn.Identity)):
        return None
    return "manual"


def _probe_input(m: nn.Module, device: torch.device | str) -> torch.Tensor:
    width = m.qkv.in_features
    if str(device) == "meta":
        return torch.empty(*_PROBE_SHAPE, width, dtype=torch.float64, device="meta")
    gen = torch.Generator().manual_seed(0)
    return torch.randn(*_PROBE_SHAPE, width, generator=gen, dtype=torch.float64)


def _is_meta(m: nn.Module) -> bool:
    return any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


def _verify(name: str, m: nn.Module, kind: str, check: bool) -> int:
    """Run the module's own forward on a float64 copy (on CPU; on the meta device
    when ``check`` is off or the weights are not materialised) and, with ``check``,
    compare it with the fused forward. Returns the output contract (see
    :class:`SDPAForward`). Raises _NotSelfAttention when the module's own forward
    does not map a (B, N, C) token input to tokens, RuntimeError when the fused
    forward differs, and ValueError when ``check`` cannot run."""
    label = name or type(m).__name__
    meta = _is_meta(m)
    if check and meta:
        raise ValueError(
            f"optimize_attention: cannot check {label!r}: its weights are on the meta "
            "device; pass check=False or materialise the model first"
        )
    device = "meta" if (meta or not check) else "cpu"
    dup = copy.deepcopy(m).to(device=device, dtype=torch.float64).eval()
    if device == "cpu":
        # Fresh random weights: the two forwards must agree for any weights, and a
        # zero-initialised projection must not hide a difference.
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in dup.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    x = _probe_input(dup, device)
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        if kind == "timm":
            dup.fused_attn = False
        try:
            ref = dup(x)
        except Exception as e:
            raise _NotSelfAttention(
                f"{label!r} ({type(m).__name__}): its forward fails on a (B, N, C) token "
                f"input: {type(e).__name__}: {e}"
            ) from e
        first = _first(ref)
        tokens = isinstance(first, torch.Tensor) and first.dim() == 3
        if not tokens or first.shape[:2] != x.shape[:2]:
            raise _NotSelfAttention(
                f"{label!r} ({type(m).__name__}): its forward does not map (B, N, C) "
                "tokens to (B, N, C') tokens"
            )
        n_outputs = len(ref) if isinstance(ref, (tuple, list)) else 0
        if not check:
            return n_outputs
        if kind == "timm":
            dup.fused_attn = True
            out = dup(x)
        else:
            out = SDPAForward(dup, n_outputs)(x)
    out = _first(out)
    err = (out - first).abs().max().item() / max(first.abs().max().item(), 1e-300)
    if not err <= _CHECK_RTOL:  # also catches NaN
        raise RuntimeError(
            f"optimize_attention: the fused forward of {label!r} ({type(m).__name__}) differs "
            f"from its own forward by {err:.3g} relative (limit {_CHECK_RTOL:g}) in float64; "
            "its forward is not the standard softmax(q k^T * scale) v attention. "
            "Nothing was changed."
        )
    return n_outputs


class _NotSelfAttention(Exception):
    pass


def optimize_attention(
    model: nn.Module, use_flash_attention: bool = True, check: bool = True
) -> int:
    """Make hand-written self-attention modules of ``model`` use
    ``torch.nn.functional.scaled_dot_product_attention``; returns how many were converted.

    Recognised modules (anywhere in ``model``, ``model`` itself included):

    - DINO-style (facebookresearch/dino ``Attention``, timm's older ``Attention``):
      a ``qkv`` Linear of width 3*inner, ``num_heads``, ``scale`` (or ``head_dim``),
      ``proj``, optional ``attn_drop`` / ``proj_drop`` / ``q_norm`` / ``k_norm``,
      no other children and no parameters of their own. Their forward is replaced
      by an :class:`SDPAForward` set on the instance: the class, the parameters and
      the ``state_dict`` keys stay as they were. A module that returned
      ``(x, attn)`` now returns ``(x, None)`` (see :func:`explicit_attention`).
      Attention dropout is ``attn_drop.p`` in training mode and 0 in eval mode.
    - timm-style: a module with a ``fused_attn`` attribute that is False gets
      ``fused_attn = True`` (its own SDPA path) instead of a new forward.

    Modules that already use SDPA (dino_opt's own ViT attention, timm with
    ``fused_attn=True``, any class whose forward calls
    ``scaled_dot_product_attention``, modules converted before) are left alone
    and not counted.

    With ``check`` (default), each conversion is first run on a float64 copy on
    the CPU (weights redrawn at random) with a random (2, 7, C) input and
    compared with the module's own
    forward; if any differs by more than 1e-6 relative, RuntimeError is raised
    and nothing in ``model`` is changed. Without ``check``, only the output
    contract is probed (on the meta device). Modules that match by structure but
    do not map (B, N, C) tokens to tokens are skipped with a warning.

    ``use_flash_attention=False`` leaves the model as it is and returns 0 (the
    lesson's switch). Which SDPA kernel runs is chosen by PyTorch per call; use
    ``torch.nn.attention.sdpa_kernel`` around the training step to restrict it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize_attention: model must be an nn.Module, got {type(model)}")
    if not use_flash_attention:
        return 0
    plans: list[tuple[str, nn.Module, str, int]] = []
    for name, m in model.named_modules():
        kind = _classify(m)
        if kind is None:
            continue
        try:
            n_outputs = _verify(name, m, kind, check)
        except _NotSelfAttention as e:
            logger.warning("optimize_attention: skipped %s", e)
            continue
        plans.append((name, m, kind, n_outputs))
    for name, m, kind, n_outputs in plans:
        if kind == "timm":
            m.fused_attn = True
            m._dino_opt_fused_attn_set = True
        else:
            m.forward = SDPAForward(m, n_outputs)
        logger.debug("optimize_attention: %r (%s) now uses SDPA", name, type(m).__name__)
    return len(plans)


def restore_attention(model: nn.Module) -> int:
    """Undo :func:`optimize_attention`: the converted modules get their own forward
    back (timm-style ones ``fused_attn = False``). Returns how many were restored."""
    n = 0
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), SDPAForward):
            del m.forward
            n += 1
        elif m.__dict__.pop("_dino_opt_fused_attn_set", False):
            m.fused_attn = False
            n += 1
    return n


@contextmanager
def explicit_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, the modules converted by :func:`optimize_attention` run
    their own forward (and so return the attention matrix where they did, e.g.
    for DINO's ``get_last_selfattention`` and attention maps)::

        with explicit_attention(model):
            attn = model.get_last_selfattention(images)
    """
    patched = [
        m.__dict__["forward"]
        for m in model.modules()
        if isinstance(m.__dict__.get("forward"), SDPAForward) and m.__dict__["forward"].enabled
    ]
    timm = [m for m in model.modules() if m.__dict__.get("_dino_opt_fused_attn_set", False)]
    for f in patched:
        f.enabled = False
    for m in timm:
        m.fused_attn = False
    try:
        yield model
    finally:
        for f in patched:
            f.enabled = True
        for m in timm:
            m.fused_attn = True


# --------------------------------------------------------------------------- model


def _check_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise TypeError(f"optimize_model: config must be a mapping, got {type(config).__name__}")
    allowed = sorted(CONFIG_KEYS) + sorted(_ALIASES)
    out = dict(CONFIG_KEYS)
    given: dict[str, str] = {}
    for key, value in config.items():
        name = _ALIASES.get(key, key)
        if name not in CONFIG_KEYS:
            raise ValueError(
                f"optimize_model: unknown config key {key!r}; allowed keys: {', '.join(allowed)}"
            )
        if name in given and out[name] != value:
            raise ValueError(
                f"optimize_model: config keys {given[name]!r} and {key!r} both set {name!r} "
                f"but disagree ({out[name]!r} vs {value!r})"
            )
        if name == "compile_mode":
            if value not in COMPILE_MODES:
                raise ValueError(
                    f"optimize_model: config key 'compile_mode' must be one of "
                    f"{', '.join(COMPILE_MODES)}; got {value!r}"
                )
        elif not isinstance(value, bool):
            raise ValueError(
                f"optimize_model: config key {key!r} must be True or False; got {value!r}"
            )
        out[name] = value
        given[name] = key
    return out


def _is_patch_embedding(conv: nn.Conv2d) -> bool:
    """A patchify convolution (kernel == stride > 1, no padding, no overlap), as in
    a ViT's patch embedding: it runs once per image and channels_last buys nothing."""
    k, s, p = conv.kernel_size, conv.stride, conv.padding
    return tuple(k) == tuple(s) and max(k) > 1 and (p == "valid" or not any(p))


def _cuda_device(model: nn.Module, args: tuple) -> torch.device | None:
    """The CUDA device the timed calls run on (from the inputs, else the weights)."""
    for t in list(args) + list(model.parameters()):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return t.device
    return None


def _time_calls(
    model: nn.Module, example_input: Any, n_warmup: int = 3, n_steady: int = 3
) -> dict[str, Any]:
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    device = _cuda_device(model, args)

    def sync() -> None:
        if device is not None:
            torch.cuda.synchronize(device)

    times = []
    for _ in range(n_warmup + n_steady):
        sync()
        t0 = time.perf_counter()
        model(*args)
        sync()
        times.append(time.perf_counter() - t0)
    warm = times[:n_warmup]
    steady = statistics.median(times[n_warmup:])
    return {
        "first_call_s": warm[0],
        "warmup_calls_s": warm,
        "steady_call_s": steady,
        "warmup_cost_s": sum(max(0.0, t - steady) for t in warm),
        "grad_enabled": torch.is_grad_enabled(),
        "cuda_synchronized": device is not None,
    }


def _apply_channels_last(model: nn.Module, wanted: bool, report: dict[str, Any]) -> None:
    """channels_last (when ``wanted``) where convolutions other than patch
    embeddings do the work; their count and what was done into ``report``."""
    notes = report["notes"]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    feature_convs = [m for m in convs if not _is_patch_embedding(m)]
    report["conv2d_layers"] = len(feature_convs)
    if not wanted:
        return
    if feature_convs:
        model.to(memory_format=torch.channels_last)
        report["channels_last"] = True
        notes.append(
            f"channels_last: applied ({len(feature_convs)} Conv2d layers); pass inputs "
            "as x.to(memory_format=torch.channels_last) too"
        )
    elif convs:
        notes.append(
            "channels_last: skipped: the only Conv2d layers are patch embeddings "
            "(kernel == stride); a ViT gains nothing from channels_last"
        )
    else:
        notes.append("channels_last: skipped: the model has no Conv2d layers")


def _compile_in_place(
    model: nn.Module, mode: str, example_input: Any, report: dict[str, Any]
) -> None:
    """``model.compile(mode=mode)``, and with ``example_input`` the timing
    of its first calls, into ``report``."""
    notes = report["notes"]
    model.compile(mode=mode)
    report["compiled"] = True
    report["compile_mode"] = mode
    notes.append(
        f"compile: torch.compile in place, mode {mode!r}; the first "
        "call (and the first backward) compiles. Build the EMA teacher before "
        "compiling: a deepcopy of a compiled module calls the original's code"
    )
    if example_input is not None:
        timing = _time_calls(model, example_input)
        report["compile_timing"] = timing
        notes.append(
            f"compile: first call {timing['first_call_s']:.3f} s, steady call "
            f"{timing['steady_call_s'] * 1e3:.3f} ms, warm-up cost "
            f"{timing['warmup_cost_s']:.3f} s"
        )


def optimize_model_report(
    model: nn.Module, config: Mapping[str, Any] | None, example_input: Any = None
) -> tuple[nn.Module, dict[str, Any]]:
    """:meth:`ModelOptimizer.optimize_model` that also returns its report.

    The report (also stored as ``model._dino_opt_optimizations``) has keys
    ``config`` (the validated configuration), ``attention_modules_converted``
    (int, or None when ``optimize_attention`` is off), ``channels_last`` (applied
    or not), ``conv2d_layers`` (convolutions other than patch embeddings),
    ``compiled``, ``compile_mode``, ``compile_timing`` and ``notes`` (also logged).

    With ``compile`` on and ``example_input`` given (a tensor, or a tuple of
    positional arguments; anything else is passed as the one argument), the model
    is called 6 times in the current grad mode and ``compile_timing`` gives
    ``first_call_s`` (the call that compiles), ``warmup_calls_s`` (the first 3
    calls: CUDA-graph modes record on the second), ``steady_call_s`` (median of
    the last 3) and ``warmup_cost_s`` (the excess of the first 3 over steady).
    Times use ``time.perf_counter`` with ``torch.cuda.synchronize`` around each
    call on CUDA inputs. Only the forward is timed: the backward graph compiles
    on the first backward pass. Without compile the model is not called.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize_model: model must be an nn.Module, got {type(model)}")
    cfg = _check_config(config)
    notes: list[str] = []
    report: dict[str, Any] = {
        "config": dict(cfg),
        "attention_modules_converted": None,
        "channels_last": False,
        "conv2d_layers": 0,
        "compiled": False,
        "compile_mode": None,
        "compile_timing": None,
        "notes": notes,
    }

    # 1. Attention first, so that compile traces the fused forward.
    if cfg["optimize_attention"]:
        n = optimize_attention(model)
        report["attention_modules_converted"] = n
        notes.append(f"attention: {n} hand-written attention module(s) now use SDPA")

    # 2. channels_last only where convolutions do the work.
    _apply_channels_last(model, cfg["channels_last"], report)

    # 3. Compile last, in place: the module and its state_dict keys stay the same
    #    (torch.compile(model) would return a wrapper whose keys start with _orig_mod.).
    if cfg["compile"]:
        _compile_in_place(model, cfg["compile_mode"], example_input, report)
    for note in notes:
        logger.info("optimize_model: %s", note)
    model._dino_opt_optimizations = report
    return model, report


class ModelOptimizer:
    """Optimise a model for training speed (the lesson's ``ModelOptimizer``)."""

    @staticmethod
    def optimize_model(model: nn.Module, config: Mapping[str, Any] | None) -> nn.Module:
        """Apply the optimisations chosen in ``config`` and return the model.

        Keys (all optional, everything off by default; any other key, or a value
        of the wrong kind, raises ValueError naming the key and what is allowed):

        - ``optimize_attention`` (bool): :func:`optimize_attention` with its check.
        - ``channels_last`` (bool): ``model.to(memory_format=torch.channels_last)``,
          applied only when the model has Conv2d layers other than patch
          embeddings; ViTs gain nothing and are left alone (said in the notes).
        - ``compile`` (bool; the lesson's ``compile_model`` is an alias):
          ``model.compile(mode=compile_mode)`` in place, so the returned model is
          the same object with the same ``state_dict`` keys.
        - ``compile_mode``: one of ``COMPILE_MODES`` (default ``"default"``).

        What was done is recorded in ``model._dino_opt_optimizations`` (see
        :func:`optimize_model_report`, which also measures the compile warm-up).
        """
        return optimize_model_report(model, config)[0]

    @staticmethod
    def optimize_attention(
        model: nn.Module, use_flash_attention: bool = True, check: bool = True
    ) -> nn.Module:
        """The lesson's form: :func:`optimize_attention`, returning the model. The
        number of converted modules is stored in
        ``model._dino_opt_optimizations["attention_modules_converted"]``."""
        n = optimize_attention(model, use_flash_attention=use_flash_attention, check=check)
        record = dict(getattr(model, "_dino_opt_optimizations", None) or {})
        record["attention_modules_converted"] = n
        model._dino_opt_optimizations = record
        return model


optimize_model = ModelOptimizer.optimize_model
