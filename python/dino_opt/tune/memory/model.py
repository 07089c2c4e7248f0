"""Per-rank memory of a training step of any recipe, before running it: the
parameters, gradients, optimizer and teacher of each process under DDP and
FSDP at any world size, and the activations of the configured crops with
and without activation checkpointing (docs/memory.md derives every term;
with crop-size pairs, the largest global and local sides).

Parameter counts come from the real modules (:mod:`.counts`). Activations
are counted per token and per block from what autograd keeps for the
backward pass of the ViT's operators: attention through SDPA keeps no L x L
matrix, only q, k, v, its output and one log-sum-exp per head and token.

A distillation also counts its frozen teacher and each of its students
(:func:`estimate_distillation`). The estimate of rank 0 (the largest
shards) is :func:`estimate_memory`; the table ``dino-opt presets
--memory-model`` prints is in :mod:`.table`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from torch import nn

from ...config import Config, apply_overrides
from ...models import CHECKPOINT_POLICIES
from ...train import recipe_of
from .counts import ModelCounts, count_model, shard_numel
from .distill import (
    FP32,
    frozen_forward_bytes,
    frozen_gathered,
    parameter_numel,
    traced_student,
    whitening_state_bytes,
)
from .recipes import terms_of

__all__ = [
    "STRATEGIES",
    "MemoryEstimate",
    "activation_bytes",
    "block_bytes_per_token",
    "selective_outputs",
    "sequence_lengths",
    "estimate_distillation",
    "estimate_memory",
]

#: How the student is replicated over processes.
STRATEGIES = ("ddp", "fsdp")

_STATS = 8  # a LayerNorm's mean and reciprocal deviation of one token, float32


# ---------------------------------------------------------------- activations


def block_bytes_per_token(
    counts: ModelCounts,
    act_bytes: int,
    policy: str = "none",
    input_bytes: int = FP32,
    *,
    tokens: int = 0,
    threshold: float = 0.0,
) -> int:
    """Bytes one transformer block keeps per token for its backward pass.

    ``act_bytes``: 2 under bf16/fp16 autocast, 4 in float32; ``input_bytes``:
    the block input's (the residual stream's) bytes per value. ``none``: the
    LayerNorms' float32 inputs and statistics, the linear layers' inputs, q/k/v
    (one tensor), the attention output and its log-sum-exp per head, the MLP's
    hidden activations (GELU's input and output; SwiGLU's fused projection,
    SiLU output and gated product) and, with LayerScale, the scaled branches.
    ``full``: the block input only. ``selective``: the block input and the
    outputs of the matrix products and of attention (every one at
    ``threshold`` 0; above, those that save at least ``threshold`` FLOPs
    per byte, :func:`selective_outputs`, over sequences of ``tokens``)."""
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(CHECKPOINT_POLICIES)}, got {policy!r}")
    c, h, a = counts.embed_dim, counts.ffn_hidden, act_bytes
    heads_lse = FP32 * counts.num_heads
    if policy == "full":
        return input_bytes * c
    if policy == "selective":
        outputs = selective_outputs(counts, a, tokens).values()
        kept = (b for b, cost in outputs if cost >= threshold and (cost > 0 or threshold == 0))
        return input_bytes * c + sum(kept)
    ffn = 4 * a * h if counts.ffn == "swiglu" else 2 * a * h
    layerscale = 2 * a * c if counts.layerscale else 0
    norms = 2 * (FP32 * c + _STATS)
    return norms + a * c + 3 * a * c + a * c + heads_lse + a * c + ffn + layerscale


def selective_outputs(counts: ModelCounts, act_bytes: int, tokens: int) -> dict[str, tuple]:
    """The outputs selective checkpointing may keep in a block, by name:
    (bytes per token, FLOPs keeping it saves per byte), the latter as
    :func:`~dino_opt.models.recompute_flops_per_byte` finds it at run time
    (a linear layer's ``2 K / a``; attention over ``tokens`` keys, its
    output and float32 log-sum-exp per head). The feed-forward network's
    last output saves nothing without LayerScale: only the residual add
    reads it, and the backward never recomputes it."""
    c, h, a = counts.embed_dim, counts.ffn_hidden, act_bytes
    d = c // counts.num_heads
    linear = 2.0 * c / a
    return {
        "qkv": (3 * a * c, linear),
        "attention": (a * c + FP32 * counts.num_heads, 4.0 * tokens * d / (d * a + FP32)),
        "proj": (a * c, linear),
        "fc1": (2 * a * h if counts.ffn == "swiglu" else a * h, linear),  # SwiGLU's w12
        "fc2": (a * c, 2.0 * h / a if counts.layerscale else 0.0),  # SwiGLU's w3
    }


def _ffn_grad(counts: ModelCounts, a: int) -> int:
    """The widest gradients alive at once in a block's backward, per token."""
    return 2 * a * counts.ffn_hidden if counts.ffn == "swiglu" else a * counts.ffn_hidden


@dataclass(frozen=True)
class _Step:
    """The crops of a step, per rank: tokens per crop size, images, head rows."""

    batch: int
    global_tokens: int
    local_tokens: int
    n_local: int
    masked: int  # dinov2: the most masked patch tokens of a batch (iBOT rows)

    @property
    def tokens(self) -> int:
        return self.batch * (2 * self.global_tokens + self.n_local * self.local_tokens)

    @property
    def largest_group(self) -> int:
        """Tokens of the larger backbone call (all global or all local crops)."""
        return self.batch * max(2 * self.global_tokens, self.n_local * self.local_tokens)


def sequence_lengths(cfg: Config, counts: ModelCounts) -> tuple[int, int]:
    """Tokens of a global and of a local crop's sequence (the largest sizes),
    the class and register tokens included."""
    s = _step(cfg, counts)
    return s.global_tokens, s.local_tokens


def _step(cfg: Config, counts: ModelCounts) -> _Step:
    a, p = cfg.augmentation, counts.patch_size
    global_side, local_side = a.largest_crop_sizes  # crop-size pairs: the largest
    g = (global_side // p) ** 2
    masked = terms_of(cfg).masked_tokens(cfg, g)
    return _Step(
        cfg.data.batch_size,
        g + counts.extra_tokens,
        (local_side // p) ** 2 + counts.extra_tokens,
        a.num_local_views,
        masked,
    )


def _head_rows(cfg: Config, counts: ModelCounts, s: _Step) -> tuple[int, int]:
    """(rows through the DINO head, rows through a separate patch (iBOT) head)."""
    rows = s.batch * (2 + s.n_local)
    return terms_of(cfg).head_rows(rows, s.masked, "ibot_head" in counts.units)


def _head_bytes_per_row(cfg: Config, counts: ModelCounts, a: int, out_dim: int) -> int:
    """A head row's saved activations: the MLP's (input, GELU inputs and
    outputs, the L2-normalised bottleneck) and the logits, kept in the
    autocast dtype and as the loss's float32 copy (DINOv2's loss also keeps
    its float32 log-probabilities)."""
    m = cfg.model
    mlp = a * counts.embed_dim + 4 * a * m.hidden_dim + (2 * a + 3 * FP32) * m.bottleneck_dim
    return mlp + terms_of(cfg).loss_bytes_per_logit(a) * out_dim


def _teacher_outputs(cfg: Config, s: _Step, a: int) -> int:
    """What the teacher's pass leaves for the student's: its logits of the
    global crops (autocast dtype and float32; DINOv2: float32 targets and
    logits, and the iBOT targets of the masked tokens)."""
    return terms_of(cfg).teacher_output_bytes(cfg, 2 * s.batch, s.masked, a)


# ---------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class MemoryEstimate:
    """Rank 0's memory in bytes for one setting.

    Kept across steps: ``parameters`` (the student's, float32), ``teacher``,
    ``optimizer`` (AdamW's two float32 moments), ``buckets`` (DDP's
    gradient buckets). Within a step: ``gradients`` (float32),
    ``unsharded`` (FSDP: the units gathered at once, in the parameters'
    compute dtype, and one unit's gradient being reduced), ``activations``
    (what the backward pass keeps, the crops, the teacher's outputs, the
    autocast copies of the weights) and ``transient`` (the largest working
    set of the backward pass on top of that); ``backward_end``: what is alive
    when the backward pass reaches the first block (nearly all gradients, a
    block's working set, a gradient being accumulated, the crops).
    ``peak``: what is kept plus the larger of the backward's start
    (activations, transient, unsharded, the heads' gradients) and its end
    (``backward_end`` and unsharded; the optimizer step needs no more)."""

    arch: str
    strategy: str
    world_size: int
    batch_size: int
    precision: str
    checkpointing: str
    every: int
    reshard_after_forward: bool
    parameter_count: int
    trainable_count: int
    teacher_count: int
    parameters: int
    gradients: int
    optimizer: int
    teacher: int
    buckets: int
    unsharded: int
    activations: int
    transient: int
    head_gradients: int
    backward_end: int

    @property
    def kept(self) -> int:
        """Bytes alive between steps."""
        return self.parameters + self.teacher + self.optimizer + self.buckets

    @property
    def step(self) -> int:
        """Bytes above :attr:`kept` at the step's peak."""
        start = self.activations + self.transient + self.unsharded + self.head_gradients
        return max(start, self.backward_end + self.unsharded)

    @property
    def peak(self) -> int:
        return self.kept + self.step

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "kept": self.kept, "step": self.step, "peak": self.peak}


def estimate_memory(
    cfg: Config,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    checkpointing: str | None = None,
    every: int | None = None,
    reshard_after_forward: bool = True,
    arch: str | None = None,
    counts: ModelCounts | None = None,
    frozen_teacher: nn.Module | None = None,
) -> MemoryEstimate:
    """Rank 0's memory for ``cfg`` (its model, crops, batch per GPU and
    precision: ``fp32`` counts activations and FSDP's gathered parameters in
    float32, every other value in 16 bits) under ``strategy`` over
    ``world_size`` processes, with ``checkpointing`` every ``every``-th block
    (default: the config's ``hardware`` keys). DDP replicates the student
    and keeps a flat gradient bucket per parameter (torch's default, no
    bucket views); FSDP shards parameters, gradients, optimizer states and
    the teacher per unit (each block, each head, the root) with mixed
    precision: 16-bit gathered parameters, float32 reduction. A
    distillation needs its ``frozen_teacher`` (the network
    ``recipe.distill.teacher`` opens; :func:`estimate_distillation`)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if recipe_of(cfg).external_teacher:
        return estimate_distillation(
            cfg,
            frozen_teacher,
            strategy=strategy,
            world_size=world_size,
            checkpointing=checkpointing,
            every=every,
            arch=arch,
        )
    counts = counts if counts is not None else count_model(cfg)
    return _estimate(
        cfg, strategy, world_size, checkpointing, every, reshard_after_forward, arch, counts
    )


def _estimate(
    cfg: Config,
    strategy: str,
    world_size: int,
    checkpointing: str | None,
    every: int | None,
    reshard_after_forward: bool,
    arch: str | None,
    counts: ModelCounts,
) -> MemoryEstimate:
    """:func:`estimate_memory` of a recipe with its DINO heads (arguments checked)."""
    checkpointing, every, a = _setting(cfg, checkpointing, every)
    states = _states(counts, strategy, world_size, a)
    acts, transient, end = _activations(cfg, counts, a, strategy, checkpointing, every)
    if strategy == "ddp":  # a block's gradient of one crop size, added to the other's
        end += FP32 * max(counts.unit_size(u) for u in counts.units if u.startswith("blocks."))
    return MemoryEstimate(
        arch=arch or f"{cfg.model.backbone}/{counts.patch_size}",
        **_run(cfg, a, strategy, world_size, checkpointing, every, reshard_after_forward),
        parameter_count=counts.student,
        trainable_count=counts.trainable,
        teacher_count=counts.teacher,
        **states,
        unsharded=_unsharded(counts, a, strategy, reshard_after_forward),
        activations=acts,
        transient=transient,
        backward_end=end + states["gradients"],
    )


def _run(
    cfg: Config, a: int, strategy: str, world: int, policy: str, every: int, reshard: bool
) -> dict:
    """The fields of an estimate that say what run it is of."""
    return {
        "strategy": strategy,
        "world_size": world,
        "batch_size": cfg.data.batch_size,
        "precision": "fp32" if a == FP32 else "16-bit",
        "checkpointing": policy,
        "every": every,
        "reshard_after_forward": reshard,
    }


def activation_bytes(cfg: Config) -> int:
    """Bytes of an activation value under ``cfg``'s precision: 4 in fp32,
    else 2 (16-bit autocast)."""
    return FP32 if cfg.hardware.precision == "fp32" else 2


def _setting(cfg: Config, checkpointing: str | None, every: int | None) -> tuple[str, int, int]:
    """(checkpointing policy, every, bytes per activation value): the
    arguments, or the config's ``hardware`` keys; 4 bytes in fp32, else 2."""
    h = cfg.hardware
    checkpointing = h.activation_checkpointing if checkpointing is None else checkpointing
    if checkpointing == "auto":
        raise ValueError(
            "activation checkpointing 'auto' is chosen when a run starts, from the device's "
            "memory (dino_opt.tune.resolve_checkpointing); estimate none, full or selective"
        )
    every = h.checkpoint_every if every is None else every
    return checkpointing, every, activation_bytes(cfg)


def _states(counts: ModelCounts, strategy: str, world: int, a: int) -> dict[str, int]:
    """Parameters, gradients, AdamW moments, teacher (with the recipe's
    frozen copies of its backbone), DDP buckets; the heads' gradients (the
    first a backward pass makes), all float32. FSDP keeps the root unit of a
    module gathered after a forward pass until its backward pass, so the
    teacher's (which has none) stays gathered too. The frozen copies are
    sharded as the teacher's backbone, and their roots are freed after each
    forward (:func:`~dino_opt.runtime.shard_frozen_backbone`)."""
    gathered_root = 0
    if strategy == "fsdp":
        local = counts.local
        heads = sum(local(world, trainable_only=True, unit=u) for u in counts.head_units)
        student, trainable = local(world), local(world, trainable_only=True)
        # the same units, sharded alike, and the frozen copies' (the backbone's units)
        teacher, buckets = student + counts.local_frozen(world), 0
        gathered_root = a * counts.unit_size("root")
    else:
        heads = sum(math.prod(s) for u in counts.head_units for s, t in counts.units[u] if t)
        student, trainable, teacher = counts.student, counts.trainable, counts.teacher
        buckets = trainable
    return {
        "parameters": FP32 * student,
        "gradients": FP32 * trainable,
        "optimizer": 2 * FP32 * trainable,
        "teacher": FP32 * teacher + gathered_root,
        "buckets": FP32 * buckets,
        "head_gradients": FP32 * heads,
    }


def _unsharded(counts: ModelCounts, a: int, strategy: str, reshard: bool) -> int:
    """FSDP's gathered parameters at the backward's start: the root's (kept
    gathered), the unit in use and the one prefetched (or every unit without
    resharding after the forward), and the unit whose gradient is reduced
    (its gradient in the compute dtype, and a float32 copy to reduce when
    that dtype is 16-bit)."""
    if strategy != "fsdp":
        return 0
    root, largest = counts.unit_size("root"), counts.largest_unit
    gathered = a * (counts.student if not reshard else root + counts.largest_pair)
    reduce = a * largest + (FP32 * largest if a != FP32 else 0)
    return gathered + reduce


def _blocks_per_token(
    counts: ModelCounts,
    a: int,
    policy: str,
    every: int,
    residual: int,
    tokens: int = 0,
    threshold: float = 0.0,
) -> int:
    """What all blocks and the final norm keep per token of a sequence of
    ``tokens``: the checkpointed blocks (0, every, 2 every, ...) by
    ``policy`` (``threshold``: selective's), the others everything."""
    checkpointed = len(range(0, counts.depth, every)) if policy != "none" else 0
    plain = counts.depth - checkpointed
    kept = block_bytes_per_token(counts, a, policy, residual, tokens=tokens, threshold=threshold)
    return (
        checkpointed * kept
        + plain * block_bytes_per_token(counts, a, "none")
        + FP32 * counts.embed_dim
        + _STATS
    )


def _outside_blocks(cfg: Config, counts: ModelCounts, s: _Step, a: int, strategy: str) -> int:
    """What the step keeps outside the blocks: the heads' activations and
    logits, the teacher's outputs and the weight copies that autocast and
    weight normalisation make (the crops are :func:`_crop_bytes`)."""
    rows, ibot_rows = _head_rows(cfg, counts, s)
    heads = rows * _head_bytes_per_row(cfg, counts, a, cfg.model.out_dim)
    heads += ibot_rows * _head_bytes_per_row(cfg, counts, a, recipe_of(cfg).patch_head_dim(cfg))
    weights = a * counts.head_weight  # the heads' weight-normalised last layers
    if strategy == "ddp" and a != FP32:
        weights += a * (counts.student - counts.head_weight)  # autocast's cached casts
    frozen = terms_of(cfg).frozen_copy_output_bytes(cfg, counts.embed_dim, s.batch)
    return heads + weights + _teacher_outputs(cfg, s, a) + frozen


def _crop_bytes(cfg: Config, a: int) -> int:
    """The batch of crops (float32) and, under autocast, its 16-bit copy."""
    global_side, local_side = cfg.augmentation.largest_crop_sizes
    n_local = cfg.augmentation.num_local_views
    values = cfg.data.batch_size * 3 * (2 * global_side**2 + n_local * local_side**2)
    return values * (FP32 + (a if a != FP32 else 0))


def _activations(
    cfg: Config, counts: ModelCounts, a: int, strategy: str, policy: str, every: int
) -> tuple[int, int, int]:
    """(bytes the backward keeps, the backward's largest working set at its
    start, what besides the gradients is alive when the backward reaches the
    global crops' first block: their saved activations, a block's working
    set, the crops).

    The global crops go through the backbone first, so their backward comes
    last, after the local crops' has made every block's gradient."""
    s = _step(cfg, counts)
    # At block boundaries the residual stream is float32 (autocast) or FSDP's 16-bit.
    residual = 2 if (strategy == "fsdp" and a == 2) else FP32
    setting = (counts, a, policy, every, residual)
    threshold = cfg.hardware.recompute_threshold
    groups = _crop_groups(s)
    crops = _crop_bytes(cfg, a)
    blocks = sum(n * _blocks_per_token(*setting, t, threshold) for n, t in groups)
    kept = blocks + crops + _outside_blocks(cfg, counts, s, a, strategy)
    # A block's backward: the residual's gradient and the widest gradients,
    # after recomputing what a checkpointed block did not keep. The backward
    # starts at the last block and ends at block 0 (always checkpointed).
    backward = [(n, _block_backward(*setting, t, threshold)) for n, t in groups]
    start = max(n * (working + last) for n, (working, _, last) in backward)
    rows, ibot_rows = _head_rows(cfg, counts, s)
    patch_dim = recipe_of(cfg).patch_head_dim(cfg)
    logits = (rows * cfg.model.out_dim + ibot_rows * patch_dim) * (FP32 + a)
    (global_tokens, g), (_, (working, recompute, _)) = groups[0], backward[0]
    end = global_tokens * (_blocks_per_token(*setting, g, threshold) + working + recompute) + crops
    return kept, max(start, logits), end


def _block_backward(
    counts: ModelCounts,
    a: int,
    policy: str,
    every: int,
    residual: int,
    tokens: int = 0,
    threshold: float = 0.0,
) -> tuple[int, int, int]:
    """Per token of a sequence of ``tokens``: a block's backward working set
    (the residual's gradient and the widest gradients), what recomputing a
    checkpointed block adds, and that for the last block (where the
    backward starts)."""
    working = residual * counts.embed_dim + _ffn_grad(counts, a)
    recompute = 0
    if policy != "none":
        kept = block_bytes_per_token(
            counts, a, policy, residual, tokens=tokens, threshold=threshold
        )
        recompute = block_bytes_per_token(counts, a, "none") - kept
    last = recompute if (counts.depth - 1) % every == 0 else 0
    return working, recompute, last


def _crop_groups(s: _Step, local: bool = True) -> list[tuple[int, int]]:
    """(tokens of the step, tokens of a sequence) of the global crops and,
    with ``local``, of the local crops."""
    groups = [(2 * s.batch * s.global_tokens, s.global_tokens)]
    return groups + [(s.batch * s.n_local * s.local_tokens, s.local_tokens)] if local else groups


# ---------------------------------------------------------------- distillation


def _frozen_teacher(
    cfg: Config, frozen_teacher: nn.Module, strategy: str, world_size: int, a: int
) -> tuple[int, int, int]:
    """A distillation's frozen teacher on rank 0: its parameter count, the
    bytes its parameters (and whitening state) take, and its forward's
    working set (``a``: bytes per activation value)."""
    frozen = parameter_numel(frozen_teacher)
    sharded = strategy == "fsdp"
    backbone = getattr(frozen_teacher, "backbone", frozen_teacher)  # sharded; its heads whole
    local = frozen - parameter_numel(backbone)
    local += sum(shard_numel(tuple(p.shape), world_size) for p in backbone.parameters())
    tb = 2 if cfg.hardware.precision not in ("fp32", "fp16") else FP32
    teacher_bytes = tb * (local if sharded else frozen) + whitening_state_bytes(cfg, frozen_teacher)
    working = frozen_forward_bytes(cfg, frozen_teacher, a)
    if sharded:  # its root and a block (and the next, prefetched) gathered in its forward
        working += a * frozen_gathered(frozen_teacher)
    return frozen, teacher_bytes, working


def estimate_distillation(
    cfg: Config,
    frozen_teacher: nn.Module | None,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    checkpointing: str | None = None,
    every: int | None = None,
    arch: str | None = None,
) -> MemoryEstimate:
    """Rank 0's memory for a distillation (``recipe.name=distill``) from
    ``frozen_teacher`` (the network ``recipe.distill.teacher`` opens): the
    teacher's parameters (in bfloat16 where the run stores them so: 16-bit
    autocast but fp16; with FSDP its backbone's local shards and its heads
    whole, and its backbone's root and two blocks gathered in its forward)
    and the working set of its forward pass (one block at a time, no
    gradients). ``heads`` (DDP or FSDP): besides, DINOv2's terms of the
    student (:func:`estimate_memory`). ``features`` (DDP or FSDP, each
    student sharded on its own): for each ViT student its parameters, EMA,
    AdamW moments and gradients (float32), its blocks' activations over the
    global crops (and the local ones: local weight), its projector's rows
    and what the loss keeps of them and of the teacher's tokens; for a
    student without blocks (a ResNet, a ConvNeXt; DDP) the same parts, what
    its pass keeps traced on the meta device
    (:func:`~dino_opt.tune.memory.distill.traced_student`); the crops once.
    The students' backward passes run one after the other. With
    ``distributed.student_groups`` each rank holds one student (DDP, or its
    shard over the student's world_size / S ranks) and runs the teacher on
    its 1/S of the batch: the rank that holds the most is given."""
    if frozen_teacher is None:
        raise ValueError(
            "the memory of a distillation needs its teacher network (frozen_teacher: "
            "what recipe.distill.teacher opens)"
        )
    heads = cfg.recipe.distill.mode == "heads"
    policy, every, a = _setting(cfg, checkpointing, every)
    frozen, teacher_bytes, working = _frozen_teacher(cfg, frozen_teacher, strategy, world_size, a)
    if heads:
        e = _estimate(cfg, strategy, world_size, policy, every, True, arch, count_model(cfg))
        return dataclasses.replace(
            e,
            teacher=e.teacher + teacher_bytes,
            teacher_count=e.teacher_count + frozen,
            transient=max(e.transient, working),
        )
    recipe, groups = recipe_of(cfg), cfg.distributed.student_groups
    alone = [recipe.student_alone(cfg, i) for i in range(len(cfg.student_names))]
    for c in alone:
        if strategy == "fsdp" and not c.model.backbone.startswith("vit"):
            raise ValueError(
                f"the memory model of a distillation under fsdp covers ViT students; "
                f"got {c.model.backbone!r}"
            )
    bank = len(alone) > 1 and not groups
    # on its own ranks a student is spread over its group (one rank: whole, no DDP)
    size = world_size // len(alone) if groups else world_size
    own = (strategy, size) if size > 1 or not groups else ("ddp", 1)
    parts = [
        _feature_student(c, a, policy, every, own[1], own[0], bank)
        if c.model.backbone.startswith("vit")
        else traced_student(c, a)
        for c in alone
    ]
    setting = (a, strategy, world_size, policy, every, arch)
    if not groups:
        return _students_estimate(cfg, parts, (frozen, teacher_bytes, working), setting)
    # each rank one student, the teacher's forward on its 1/S of the batch: the fullest rank
    share = cfg.data.batch_size // len(parts)
    share = apply_overrides(cfg, [f"data.batch_size={share}", "distributed.student_groups=false"])
    teacher = (frozen, teacher_bytes, frozen_forward_bytes(share, frozen_teacher, a))
    return max(
        (_students_estimate(cfg, [p], teacher, setting) for p in parts), key=lambda e: e.peak
    )


def _students_estimate(
    cfg: Config, parts: list[dict[str, int]], teacher: tuple[int, int, int], setting: tuple
) -> MemoryEstimate:
    """The estimate of a rank that holds the students of ``parts`` and the
    frozen ``teacher`` (its parameters, their bytes, its forward's working
    set); ``setting``: (bytes of an activation value, strategy, world size,
    checkpointing policy, every, arch)."""
    frozen, teacher_bytes, working = teacher
    a, strategy, world_size, policy, every, arch = setting
    total = {k: sum(p[k] for p in parts) for k in parts[0] if k not in ("end", "unsharded")}
    crops = _crop_bytes(cfg, a)  # the batch of crops, one for every student
    return MemoryEstimate(
        arch=arch or "+".join(cfg.student_names),
        **_run(cfg, a, strategy, world_size, policy, every, True),
        parameter_count=total["parameter_count"],
        trainable_count=total["trainable_count"],
        teacher_count=total["teacher_count"] + frozen,
        parameters=total["parameters"],
        gradients=total["gradients"],
        optimizer=total["optimizer"],
        teacher=total["teacher"] + teacher_bytes,
        buckets=total["buckets"],
        unsharded=max(p["unsharded"] for p in parts),
        activations=total["activations"] + crops,
        transient=max(working, max(p["working"] for p in parts)),
        head_gradients=total["head_gradients"],
        backward_end=_students_backward(parts) + crops,
    )


def _students_backward(parts: list[dict[str, int]]) -> int:
    """The most alive while the students' backward passes run: the last
    student's first (its forward ran last), so while student i's runs the
    values kept by the students before it are alive and the gradients of
    those after it are made (and its own, as its ``end`` counts them)."""
    return max(
        sum(p["activations"] for p in parts[:i])
        + part["end"]
        + sum(p["gradients"] for p in parts[i:])
        for i, part in enumerate(parts)
    )


def _feature_student(
    cfg: Config, a: int, policy: str, every: int, world: int, strategy: str, bank: bool
) -> dict[str, int]:
    """One student of a feature distillation: its states (:func:`_states`,
    the EMA as the teacher), what its pass keeps (``activations``), the
    working set where its backward starts, FSDP's gathered units then
    (``unsharded``) and (``end``) what is alive when its backward reaches
    its first block (that block's saved values, recomputed where it is
    checkpointed, and its working set). Sharded, the EMA never runs forward
    (nothing of it stays gathered), and a student of a ``bank`` (several)
    is not FSDP's root, so its own parameters are freed after its forward
    too."""
    counts = count_model(cfg)
    states = _states(counts, strategy, world, a)
    unsharded = _unsharded(counts, a, strategy, True)
    if strategy == "fsdp":
        states["teacher"] = FP32 * counts.local(world)
        unsharded -= a * counts.unit_size("root") if bank else 0
    s = _step(cfg, counts)
    residual = 2 if (strategy == "fsdp" and a == 2) else FP32
    setting = (counts, a, policy, every, residual)
    threshold = cfg.hardware.recompute_threshold
    local = int(cfg.recipe.distill.local_weight > 0)  # the local crops' pass, their class rows
    rows = 2 * s.batch * (1 + s.global_tokens - counts.extra_tokens) + local * s.n_local * s.batch
    groups = _crop_groups(s, bool(local))
    blocks = sum(n * _blocks_per_token(*setting, t, threshold) for n, t in groups)
    pairs = 2 * local * s.n_local * s.batch
    hidden = cfg.recipe.distill.projector_hidden
    width, out = counts.embed_dim, cfg.recipe.distill.teacher_dim
    cast = a * width if a != FP32 else 0  # the projector's 16-bit input
    projector = cast + (2 * a * hidden if hidden > 0 else 0)
    loss = 2 * (a + (FP32 if a != FP32 else 0)) * out  # student's and teacher's, and float32
    # the backward starts at the larger group's last block
    backward = [(n, _block_backward(*setting, t, threshold)) for n, t in groups]
    start = max(n * (working + last) for n, (working, _, last) in backward)
    largest, t = max(groups)
    working, recompute, _ = _block_backward(*setting, t, threshold)
    first = block_bytes_per_token(counts, a, policy, residual, tokens=t, threshold=threshold)
    return {
        **states,
        "parameter_count": counts.student,
        "trainable_count": counts.trainable,
        "teacher_count": counts.teacher,
        "unsharded": unsharded,
        "activations": blocks + rows * (projector + loss) + pairs * 2 * FP32 * out,
        "working": start,
        "end": largest * (first + recompute + working),
    }
