"""The configuration's fields: one dataclass per section, each field with its
help, default and allowed values (the per-key specs derived from them are
:mod:`dino_opt.config.specs`')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .names import BACKBONE_NAMES
from .option import option as _opt
from .presets import PRESET_NAMES
from .recipe import RECIPE_NEEDS, RecipeConfig

__all__ = [
    "COMPILE_MODES",
    "RECIPE_NEEDS",
    "AugmentationConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "DistributedConfig",
    "EvalConfig",
    "HardwareConfig",
    "HealthConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "RecipeConfig",
    "ScheduleConfig",
]


#: torch.compile's modes, for ``hardware.compile_mode`` and ``optimize_model``.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


class ConfigError(ValueError):
    """A configuration that cannot be used. ``errors`` holds one message per
    problem found (the message of the exception joins them)."""

    def __init__(self, errors: str | list[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


# ---------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Where the images come from and how the loader delivers them."""

    root: str | None = _opt(
        None,
        "the training data: an ImageFolder directory, a file list (.txt/.csv), tar shards "
        "(a .tar, a folder of them, a pattern such as shards-{0000..0127}.tar) or a Hugging "
        "Face data set (a save_to_disk folder, Parquet files); null: the built-in data set",
        check="nonempty",
    )
    batch_size: int = _opt(64, "images per batch per GPU (DINO: 64)", ge=1)
    # the loader gives the same batches whatever its threads: these may change on resume
    num_workers: int | None = _opt(
        None, "loader threads; null: the cores available", ge=1, resume=True
    )
    pin_memory: bool = _opt(
        True, "batches in pinned memory for faster copies to the GPU", resume=True
    )
    persistent_workers: bool = _opt(True, "keep the loader's workers alive between epochs")
    prefetch: int = _opt(4, "batches prepared ahead of the training step", ge=1, resume=True)
    dtype: str = _opt(
        "float32",
        "dtype of the crops the loader outputs",
        choices=("float32", "bfloat16", "float16"),
    )
    photometric: str = _opt(
        "cpu",
        "where colour augmentation runs: loader threads or a GPU kernel",
        choices=("cpu", "gpu"),
    )
    on_error: str = _opt(
        "raise",
        "an unreadable image: raise, or skip it (replaced by another image)",
        choices=("raise", "skip"),
    )
    max_side: int | None = _opt(
        None, "prepared data: resize images so that their longer side is at most this", ge=1
    )
    format: str = _opt(
        "auto",
        "what data.root is; auto: found from the name (docs/loader.md)",
        choices=("auto", "folder", "shards", "list", "hf"),
    )
    shuffle_buffer: int = _opt(
        1024, "tar shards: samples shuffled together within a rank's stream of shards", ge=1
    )
    index_dir: str | None = _opt(
        None,
        "folder for the shard indexes; null: beside each shard, else ~/.cache/dino_opt/shard-index",
        check="nonempty",
    )
    list_root: str | None = _opt(
        None,
        "folder a file list's relative paths start from; null: the list's folder",
        check="nonempty",
    )
    image_column: str | None = _opt(
        None,
        "Hugging Face data: the image column; null: found by its feature or name",
        check="nonempty",
    )
    label_column: str | None = _opt(
        None,
        "Hugging Face data: the label column; null: a ClassLabel or a column named label",
        check="nonempty",
    )
    builtin_variant: str = _opt(
        "rgb",
        "with data.root null: the built-in data set as JPEGs (rgb), 16-bit one-channel PNGs "
        "(gray16) or 6-channel uint16 .npy arrays (multichannel; both need data.image_mode: "
        "native)",
        choices=("rgb", "gray16", "multichannel"),
    )
    image_mode: str = _opt(
        "rgb",
        "how images are read: rgb (every image as 8-bit RGB), native (at their stored depth "
        "and channels: 16-bit, 1 to N channels, .npy arrays; docs/loader.md)",
        choices=("rgb", "native"),
    )
    mean: tuple[float, ...] | None = _opt(
        None,
        "per-channel normalisation mean, in units of value / 255 (value / 65535 for 16-bit); "
        "null: ImageNet's for 8-bit RGB, else measured on the data when the run starts",
    )
    std: tuple[float, ...] | None = _opt(
        None, "per-channel normalisation std (units as data.mean); null: as data.mean", gt=0
    )


@dataclass
class AugmentationConfig:
    """DINO's multi-crop and photometric augmentation (docs/design.md, "The algorithm")."""

    global_crop_size: int | tuple[int, ...] = _opt(
        224,
        "side of the 2 global crops; a list: one side per crop-size pair, each step's batch "
        "at one pair drawn with crop_size_ratios (high-resolution adaptation, docs/dinov3.md)",
        ge=1,
    )
    local_crop_size: int | tuple[int, ...] = _opt(
        96, "side of the local crops; a list: one per pair (as global_crop_size)", ge=1
    )
    crop_size_ratios: tuple[float, ...] | None = _opt(
        None,
        "the probability of each (global_crop_size, local_crop_size) pair per step, summing "
        "to 1 (DINOv3's global_local_crop_pairs_ratios); null: uniform",
        ge=0,
        le=1,
    )
    num_local_views: int = _opt(8, "local crops per image (DINO: 8)", ge=0)
    global_crops_scale: tuple[float, float] = _opt(
        (0.4, 1.0), "area fraction range of the global crops", check="scale"
    )
    local_crops_scale: tuple[float, float] = _opt(
        (0.05, 0.4), "area fraction range of the local crops", check="scale"
    )
    flip_p: float = _opt(0.5, "horizontal flip probability", ge=0, le=1)
    jitter_p: float = _opt(0.8, "colour jitter probability", ge=0, le=1)
    brightness: float = _opt(0.4, "colour jitter brightness strength", ge=0)
    contrast: float = _opt(0.4, "colour jitter contrast strength", ge=0)
    saturation: float = _opt(0.2, "colour jitter saturation strength", ge=0)
    hue: float = _opt(0.1, "colour jitter hue strength", ge=0, le=0.5)
    grayscale_p: float = _opt(0.2, "grayscale probability", ge=0, le=1)
    blur_sigma: tuple[float, float] = _opt(
        (0.1, 2.0), "Gaussian blur sigma range", gt=0, check="pair"
    )
    blur_p_global1: float = _opt(1.0, "blur probability, global crop 1", ge=0, le=1)
    blur_p_global2: float = _opt(0.1, "blur probability, global crop 2", ge=0, le=1)
    blur_p_local: float = _opt(0.5, "blur probability, local crops", ge=0, le=1)
    solarize_p_global2: float = _opt(0.2, "solarisation probability, global crop 2", ge=0, le=1)
    noise_p: float = _opt(
        0.5, "images not 8-bit RGB: Gaussian noise probability per crop", ge=0, le=1
    )
    noise_std: tuple[float, float] = _opt(
        (0.0, 0.1),
        "images not 8-bit RGB: noise sigma range, in units of the normalised values",
        ge=0,
        check="pair",
    )

    @property
    def crop_size_pairs(self) -> list[tuple[int, int]]:
        """The (global, local) crop sides of each pair: one for two ints; an
        int beside a list stands for every pair."""
        g, loc = self.global_crop_size, self.local_crop_size
        n = max(len(v) if isinstance(v, tuple) else 1 for v in (g, loc))
        sides = [v if isinstance(v, tuple) else (v,) * n for v in (g, loc)]
        return list(zip(*sides, strict=False))

    @property
    def largest_crop_sizes(self) -> tuple[int, int]:
        """The largest global and the largest local side over the pairs (what
        memory estimates plan for)."""
        pairs = self.crop_size_pairs
        return max(p[0] for p in pairs), max(p[1] for p in pairs)


@dataclass
class ModelConfig:
    """Backbone and DINO head."""

    backbone: str = _opt(
        "vit_small",
        "backbone architecture (distill: or timm:NAME, torchvision:NAME, package.module:function)",
        choices=BACKBONE_NAMES,
    )
    patch_size: int = _opt(16, "ViT patch size (ViT backbones only)", choices=(8, 14, 16))
    in_channels: int | None = _opt(
        None,
        "channels of the images the backbone takes; null: the data's (3 for 8-bit RGB); "
        "released RGB weights are adapted (docs/loader.md)",
        ge=1,
    )
    drop_path_rate: float = _opt(0.1, "stochastic depth rate of the ViT blocks", ge=0, lt=1)
    out_dim: int = _opt(65536, "dimension of the head's output (prototypes)", ge=1)
    norm_last_layer: bool = _opt(True, "fix the norm of the head's weight-normalised last layer")
    use_bn_in_head: bool = _opt(False, "batch norm in the head's MLP")
    hidden_dim: int = _opt(2048, "hidden width of the head's MLP", ge=1)
    bottleneck_dim: int = _opt(256, "bottleneck width before the last layer", ge=1)
    num_register_tokens: int = _opt(0, "ViT register tokens (DINOv2 with registers: 4)", ge=0)
    layerscale_init: float | None = _opt(
        None, "LayerScale initial value of the ViT blocks (DINOv2: 1e-5); null: off", gt=0
    )
    ffn_layer: str | None = _opt(
        None,
        "ViT feed-forward layer: mlp (GELU), swiglu, or swiglufused (DINOv2's ViT-g sizing); "
        "null: the architecture's own (swiglufused for vit_giant2, else mlp)",
        choices=("mlp", "swiglu", "swiglufused"),
    )
    qkv_bias: bool = _opt(True, "bias in the ViT attention's qkv projection")
    proj_bias: bool = _opt(True, "bias in the ViT attention's output projection")
    ffn_bias: bool = _opt(True, "biases in the ViT feed-forward layer")
    drop_path_uniform: bool = _opt(False, "one stochastic depth rate in every block (DINOv2)")
    interpolate_offset: float = _opt(
        0.0,
        "position-embedding interpolation offset (DINOv2: 0.1; 0: resize to the exact grid)",
        ge=0,
    )
    interpolate_antialias: bool = _opt(
        False, "anti-aliased bicubic position-embedding interpolation"
    )
    depth: int | None = _opt(None, "ViT blocks; null: the architecture's own (12 for ViT-S)", ge=1)
    img_size: int | None = _opt(
        None,
        "image side the position embeddings are sized for (official DINOv2 weights: 518); "
        "null: 224 (DINO), augmentation.global_crop_size (the dinov2 recipe; a list: its first)",
        ge=1,
    )
    init_from: str | None = _opt(
        None,
        "weights a fresh run starts from (continued pretraining): a timm or Hugging Face "
        "export, an original DINO file, a dino_opt checkpoint or run folder",
        check="nonempty",
        resume=True,
    )
    trust_code: bool = _opt(
        False,
        "import and call a network named package.module:function in a file being read (a "
        "distillation teacher's run config; dino-opt knn --checkpoint's), as --trust-code "
        "does; never read from such a file itself",
        resume=True,
    )


@dataclass
class OptimConfig:
    """Optimiser; lr is per 256 images (see effective_lr)."""

    optimizer: str = _opt("adamw", "optimiser", choices=("adamw", "sgd"))
    lr: float = _opt(0.0005, "peak learning rate per 256 images (scaled by the batch)", gt=0)
    min_lr: float = _opt(1e-6, "learning rate at the end of the cosine schedule", ge=0)
    weight_decay: float = _opt(0.04, "weight decay at the start (cosine schedule)", ge=0)
    weight_decay_end: float = _opt(0.4, "weight decay at the end", ge=0)
    clip_grad: float = _opt(3.0, "global gradient norm clip; 0 disables", ge=0)
    freeze_last_layer: int = _opt(1, "epochs during which the head's last layer is frozen", ge=0)
    accumulation_steps: int = _opt(1, "micro-batches per optimiser step", ge=1)
    fused: bool | None = _opt(None, "fused optimiser kernel; null: where torch offers it")
    scaling_rule: str = _opt(
        "linear_wrt_256",
        "how optim.lr scales with the global batch: linear_wrt_256 (DINO: lr * batch / 256) or "
        "sqrt_wrt_1024 (DINOv2: lr * sqrt(batch / 1024))",
        choices=("linear_wrt_256", "sqrt_wrt_1024"),
    )
    layerwise_decay: float = _opt(
        1.0,
        "layer-wise learning-rate decay of the ViT: block i of n gets lr * decay^(n - i) "
        "(DINOv2: 0.9; 1: off)",
        gt=0,
        le=1,
    )
    patch_embed_lr_mult: float = _opt(
        1.0, "learning-rate multiplier of the patch embedding (DINOv2: 0.2)", gt=0
    )
    freeze_backbone_epochs: int = _opt(0, "epochs the backbone stays frozen (heads warm up)", ge=0)
    backbone_lr_mult: float = _opt(1.0, "learning-rate multiplier of the backbone", gt=0, le=1)


@dataclass
class ScheduleConfig:
    """Epochs, warm-ups, teacher momentum and the loss's temperatures."""

    epochs: int | str = _opt(
        100,
        "training epochs, or auto: chosen from the number of images and the batch, the warm-ups "
        "and optim.freeze_last_layer scaled with it (docs/training.md)",
        ge=1,
    )
    warmup_epochs: int = _opt(10, "linear learning rate warm-up epochs", ge=0)
    momentum_teacher: float = _opt(0.996, "teacher EMA momentum at the start", ge=0, le=1)
    teacher_temp: float = _opt(0.04, "teacher temperature after the warm-up", gt=0)
    warmup_teacher_temp: float = _opt(0.04, "teacher temperature at the start", gt=0)
    warmup_teacher_temp_epochs: int = _opt(
        0, "epochs of linear teacher temperature warm-up (DINO: optionally 30, to 0.07)", ge=0
    )
    student_temp: float = _opt(0.1, "student temperature", gt=0)
    center_momentum: float = _opt(0.9, "momentum of the teacher output centre", ge=0, le=1)


@dataclass
class HardwareConfig:
    """Device, numerics and memory/speed trade-offs."""

    device: str = _opt("auto", "auto, cpu, cuda or cuda:N", check="device", resume=True)
    precision: str = _opt(
        "auto",
        "autocast precision; auto: bf16 on a GPU that has it and on a CPU that computes it "
        "natively (avx512_bf16 or AMX), else fp32; the losses and the EMA stay fp32",
        choices=("auto", "bf16", "fp16", "fp32"),
    )
    activation_checkpointing: str = _opt(
        "none",
        "ViT blocks whose activations are recomputed in backward to save memory: none; full "
        "(keep only each block's input); selective (keep the linear layers' and attention's "
        "outputs, recompute norms, activations, drop path); auto: on a GPU, the first of none, "
        "selective at rising recompute_threshold, full whose memory estimate fits the device "
        "(resolved at start), none on the CPU. The old key hardware.grad_checkpointing: true "
        "reads as full",
        choices=("none", "full", "selective", "auto"),
    )
    recompute_threshold: float = _opt(
        0.0,
        "selective checkpointing keeps a matrix product's or attention's output only where "
        "recomputing it costs at least this many FLOPs per byte kept (a linear layer's "
        "2 x its input width / bytes per value; attention's about 2 x its keys), and recomputes "
        "the others; 0 keeps them all",
        ge=0,
    )
    checkpoint_every: int = _opt(
        1, "checkpoint every N-th block (blocks 0, N, 2N, ...); the others keep theirs", ge=1
    )
    crop_batch_size: int | None = _opt(
        None, "crops' worth per backbone pass; null: all crops at once", ge=1
    )
    channels_last: bool = _opt(False, "channels_last memory format (convolutional backbones)")
    preset: str = _opt(
        "off",
        "set batch size, local crops, backbone, precision and checkpointing from the device's "
        "memory (auto) or a named row (dino-opt presets); keys set in the config win",
        choices=PRESET_NAMES,
        resume=True,
    )
    compile: bool | None = _opt(
        None,
        "torch.compile each ViT block in place (whole graph, static shapes, its checkpointing "
        "inside), student and teacher; a ResNet whole; null: on a GPU, off on a CPU",
    )
    compile_mode: str = _opt(
        "default",
        "torch.compile's mode for what hardware.compile compiles: default; reduce-overhead "
        "(on a GPU each compiled graph replayed as a CUDA graph: fewer launches, more memory; "
        "on a CPU the same as default); max-autotune (also searches kernel configurations: "
        "minutes more at start)",
        choices=COMPILE_MODES,
    )
    gc_every_steps: int = _opt(
        50, "Python's garbage collector off in training: run every N steps; 0: automatic", ge=0
    )
    seed: int = _opt(0, "seed of every random choice", ge=0, le=2**32 - 1)

    @property
    def grad_checkpointing(self) -> bool:
        """Whether blocks are checkpointed (the old switch, now
        ``activation_checkpointing`` != none)."""
        return self.activation_checkpointing != "none"


@dataclass
class LoggingConfig:
    """Run folder and what goes into it."""

    MAY_CHANGE_ON_RESUME: ClassVar[bool] = True  # where things go and how they are reported

    output_dir: str | None = _opt(None, "run folder; null: runs/<timestamp>", check="nonempty")
    log_every: int = _opt(10, "steps between logged metrics", ge=1)
    tensorboard: bool = _opt(True, "write TensorBoard logs")
    progress: bool = _opt(True, "show a progress bar")
    profile: bool = _opt(True, "write the profile summary")
    curves: bool = _opt(True, "draw training_curves.png (the metrics over the steps) at the end")
    tsne: bool = _opt(True, "plot a t-SNE map of held-out features before and after training")
    histograms: bool = _opt(
        False, "TensorBoard histograms of the per-image teacher entropy at each logging step"
    )
    wandb: bool = _opt(
        False,
        "also log to Weights & Biases (pip install 'dino_opt[wandb]'; WANDB_MODE=offline "
        "works without a network)",
    )
    wandb_project: str = _opt("dino_opt", "Weights & Biases project", check="nonempty")
    mlflow: bool = _opt(
        False,
        "also log to MLflow: the config as parameters, metrics by step, figures, pictures and "
        "the exported teacher as artifacts (pip install 'dino_opt[mlflow]')",
    )
    mlflow_tracking_uri: str | None = _opt(
        None,
        "MLflow tracking URI (a server, a database, a folder); null: MLFLOW_TRACKING_URI, else "
        "the file store mlruns/ beside the run folder",
        check="nonempty",
    )
    mlflow_experiment: str = _opt("dino_opt", "MLflow experiment", check="nonempty")
    mlflow_weights: bool = _opt(
        True, "log the trained teacher's backbone (exported: timm's safetensors for a ViT)"
    )


@dataclass
class CheckpointConfig:
    """When to save, how many to keep, what to resume from."""

    MAY_CHANGE_ON_RESUME: ClassVar[bool] = True  # where things go and how they are reported

    every_epochs: int = _opt(1, "epochs between checkpoints; 0: only at the end", ge=0)
    every_steps: int = _opt(
        0, "optimizer steps between checkpoints inside an epoch (resume mid-epoch); 0: off", ge=0
    )
    keep: int = _opt(3, "most recent checkpoints kept (milestones are kept as well)", ge=1)
    milestone_every: int = _opt(
        0, "every this many epochs an end-of-epoch checkpoint is kept for good; 0: none", ge=0
    )
    resume: str | None = _opt(
        "auto",
        "auto: continue from the newest good checkpoint of the run folder when there is "
        "one; a checkpoint path; null: start fresh (refused if the run folder has checkpoints)",
        check="nonempty",
    )
    async_: bool = _opt(
        True,
        "write checkpoints in a background thread: the step waits only for a copy of the "
        "state (to pinned host memory on a GPU); one write in flight at a time",
        key="async",
    )


@dataclass
class EvalConfig:
    """The evaluation of the teacher: DINO's k-NN, DINOv2's linear probe on
    cached features, DINOv3's dense probe where the data has masks, and the
    attention and PCA pictures."""

    MAY_CHANGE_ON_RESUME: ClassVar[bool] = True  # where things go and how they are reported

    knn_k: int = _opt(20, "neighbours of the weighted k-NN vote", ge=1)
    knn_temperature: float = _opt(0.07, "temperature of the k-NN vote weights", gt=0)
    every_epochs: int = _opt(
        0, "epochs between evaluations of the teacher (k-NN, linear); 0: only at the end", ge=0
    )
    linear: bool = _opt(True, "the linear probe grid and logistic regression on cached features")
    linear_epochs: int = _opt(
        100, "epochs of the linear probe's classifiers (cached features)", ge=1
    )
    dense: bool = _opt(True, "the dense linear probe, where the data has masks")
    dense_epochs: int = _opt(32, "epochs of the dense probe's head", ge=1)
    pictures: int = _opt(4, "val images whose attention and PCA pictures are drawn", ge=0)
    train_root: str | None = _opt(
        None,
        "the k-NN's labelled training data (any data.root kind); null: data.root",
        check="nonempty",
    )
    val_root: str | None = _opt(
        None,
        "the k-NN's held-out data; null: beside data.root (val/, validation, train -> val)",
        check="nonempty",
    )
    test_root: str | None = _opt(
        None,
        "the k-NN's test data; null: beside data.root (test/, train -> test)",
        check="nonempty",
    )


@dataclass
class HealthConfig:
    """Training health checks at each logging interval (dino_opt.observe.health)."""

    MAY_CHANGE_ON_RESUME: ClassVar[bool] = True  # where things go and how they are reported

    enabled: bool = _opt(True, "check collapse, gradients, throughput and NaN steps while training")
    feature_std_min: float = _opt(
        0.1,
        "collapse alert below this std of the L2-normalised features x sqrt(dim) "
        "(isotropic features: 1)",
        ge=0,
    )
    entropy_uniform_max: float = _opt(
        0.98, "uniform-collapse alert above this teacher entropy / log(out_dim)", ge=0, le=1
    )
    entropy_dominant_min: float = _opt(
        1.0,
        "dominant-dimension alert below this entropy (nats) of the batch-mean teacher output",
        ge=0,
    )
    grad_norm_max: float = _opt(
        10.0, "gradient-explosion alert above this gradient norm (before clipping)", ge=0
    )
    throughput_drop: float = _opt(
        0.8,
        "throughput alert below this fraction of the first logged throughput; 0 disables",
        ge=0,
        le=1,
    )
    throughput_window: int = _opt(
        3, "logging intervals averaged for the throughput check (first vs last)", ge=1
    )
    max_nonfinite_steps: int = _opt(
        20,
        "act (health.on_nonfinite) after more than this many consecutive steps with a NaN/inf "
        "loss or gradient",
        ge=0,
    )
    on_nonfinite: str = _opt(
        "rollback",
        "after too many non-finite steps: rollback (reload the last good checkpoint, skip the "
        "failing batches, go on), stop (save and stop), skip (skip their updates, go on)",
        choices=("rollback", "stop", "skip"),
    )
    on_collapse: str = _opt(
        "warn",
        "on a collapse alert sustained for health.collapse_patience logging intervals: warn, "
        "or rollback (reload the last good checkpoint at a lower learning rate)",
        choices=("warn", "rollback"),
    )
    collapse_patience: int = _opt(
        3, "consecutive logging intervals with a collapse alert before on_collapse acts", ge=1
    )
    max_rollbacks: int = _opt(
        3, "rollbacks allowed in a run; one more failure stops it, its checkpoints kept", ge=0
    )
    rollback_lr_scale: float = _opt(
        1.0, "each rollback multiplies the learning rate from then on by this", gt=0, le=1
    )


@dataclass
class DistributedConfig:
    """Several processes: how the model is spread, collective timeouts, hang detection."""

    MAY_CHANGE_ON_RESUME: ClassVar[bool] = True  # where things go and how they are reported

    timeout_s: float = _opt(
        1800.0, "timeout of a collective of the process group (NCCL, gloo), seconds", gt=0
    )
    hang_timeout_s: float = _opt(
        900.0,
        "a rank without progress for this long ends the job, naming the stuck rank and its "
        "last completed step (the checkpoint in flight finished first); 0: off",
        ge=0,
    )
    strategy: str = _opt(
        "ddp",
        "ddp: every rank holds the whole student, teacher and optimizer (DistributedDataParallel); "
        "fsdp: each holds 1/world of them (torch's FSDP2 fully_shard per transformer block, the "
        "heads and the root; checkpoints sharded through torch.distributed.checkpoint)",
        choices=("ddp", "fsdp"),
    )
    student_groups: bool = _opt(
        False,
        "a distillation into several students (recipe.distill.students): each of its S students "
        "on its own group of world/S ranks (rank r trains student r // (world/S); ddp over the "
        "group, or fsdp sharding it over the group), the frozen teacher's forward of a batch "
        "split over the S ranks that read it and gathered; false: every rank trains every student",
    )
    reshard_after_forward: bool = _opt(
        True,
        "fsdp: free each block's gathered parameters after its forward and gather them again for "
        "the backward (less memory); false keeps them until the backward (less communication)",
    )
    max_restarts: int = _opt(
        3,
        "times the launcher of dino-opt train --nproc/--nnodes stops and restarts every worker "
        "after one fails (a signal, a non-zero exit, the hang watchdog's exit), each time "
        "resuming from the newest complete checkpoint; 0: the first failure ends the job. A "
        "single process (no launcher) is not restarted",
        ge=0,
    )


@dataclass
class DebugConfig:
    """Fault injection, for testing the fault tolerance of a run."""

    MAY_CHANGE_ON_RESUME: ClassVar[bool] = True  # where things go and how they are reported

    inject_nonfinite_at_step: int | None = _opt(
        None,
        "make the batch of this step (as the metrics count steps) all NaN, as a corrupt image "
        "would: the loss, the teacher's output and the center become non-finite",
        ge=1,
    )
    inject_hang_at_step: int | None = _opt(
        None,
        "at this step, rank debug.inject_hang_rank stops (sleeps) just before the metrics "
        "all-reduce, so the other ranks wait in it",
        ge=1,
    )
    inject_hang_rank: int = _opt(0, "the rank that stops at debug.inject_hang_at_step", ge=0)
    inject_kill_at_step: int | None = _opt(
        None,
        "when rank debug.inject_kill_rank has completed this step, it kills itself with SIGKILL "
        "(as the kernel's OOM killer or a lost node would)",
        ge=1,
    )
    inject_kill_rank: int = _opt(0, "the rank killed at debug.inject_kill_at_step", ge=0)
    inject_attempts: int = _opt(
        1,
        "the injected kill and hang fire on the first this many attempts of the run (the first "
        "start, then each restart by the launcher), so a restarted run goes past them",
        ge=1,
    )


# Section name -> section class, in the order they are written out.
_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "augmentation": AugmentationConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "recipe": RecipeConfig,
    "hardware": HardwareConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "health": HealthConfig,
    "distributed": DistributedConfig,
    "debug": DebugConfig,
}


# The recipe's keys before its nested sections (recipe.gram_loss_weight, now
# recipe.gram.loss_weight): old flat key -> its key now.
_FLAT_RECIPE_KEYS: dict[str, str] = {
    "dino_loss_weight": "dino.loss_weight",
    "ibot_loss_weight": "ibot.loss_weight",
    "koleo_loss_weight": "koleo.loss_weight",
    "mask_ratio_min_max": "ibot.mask_ratio_min_max",
    "mask_sample_probability": "ibot.mask_sample_probability",
    "ibot_separate_head": "ibot.separate_head",
    "ibot_out_dim": "ibot.out_dim",
    **{
        f"gram_{k}": f"gram.{k}"
        for k in (
            "use_loss",
            "loss_weight",
            "ckpt",
            "it_load_ema_teacher",
            "rep_update",
            "update_frequency",
            "it_first_update",
            "max_updates",
            "img_level",
            "normalized",
            "remove_neg",
            "remove_only_teacher_neg",
            "tokens_used",
            "teacher_crop_size",
            "loss_weight_start",
            "loss_weight_end",
            "loss_weight_warmup_epochs",
            "loss_weight_cosine_epochs",
        )
    },
    **{
        f"distill_{k}": f"distill.{k}"
        for k in (
            "teacher",
            "mode",
            "teacher_scale",
            "teacher_dim",
            "cls_weight",
            "patch_weight",
            "cosine_weight",
            "smooth_l1_weight",
            "local_weight",
            "standardize",
            "whiten",
            "projector_hidden",
            "students",
            "students_init_from",
        )
    },
}

# Old keys that are still read, each as a value of a current key:
# section -> old key -> (current key, {old value: current value}, or None: a
# key renamed, its values the same, read with a deprecation line).
_ALIASES: dict[str, dict[str, tuple[str, dict[Any, Any] | None]]] = {
    "hardware": {
        "grad_checkpointing": ("activation_checkpointing", {True: "full", False: "none"}),
    },
    "recipe": {old: (new, None) for old, new in _FLAT_RECIPE_KEYS.items()},
}
