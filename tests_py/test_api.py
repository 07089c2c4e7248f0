"""The public API did not move when the modules moved into folders: every
module path and name of the flat layout still imports (the same objects as
their new homes), and so does every ``dino_opt`` import that the README, the
docs and the notebooks show."""

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import dino_opt
import pytest
from dino_opt._compat import MODULE_ALIASES

ROOT = Path(__file__).resolve().parent.parent

# Each module of the flat layout and the public names (``__all__``) it had.
OLD_MODULES = {
    "dino_opt.analysis": ["DINOTrainingAnalyzer", "format_report"],
    "dino_opt.build": [
        "DataRoots",
        "build_loader",
        "build_loss",
        "build_models",
        "build_optimizer",
        "build_schedules",
        "data_roots",
        "trainer_options",
    ],
    "dino_opt.checkpoint": [
        "AsyncCheckpointWriter",
        "CheckpointManager",
        "CheckpointRecord",
        "CheckpointWriteError",
        "atomic_write",
        "capture_rng_state",
        "fsync_dir",
        "restore_rng_state",
        "run_metadata",
    ],
    "dino_opt.cli": ["main", "prepare_dataset"],
    "dino_opt.config": [
        "AugmentationConfig",
        "CheckpointConfig",
        "Config",
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
        "ScheduleConfig",
        "apply_overrides",
        "config_to_yaml",
        "default_config",
        "effective_lr",
        "load_config",
        "save_config",
        "validate",
    ],
    "dino_opt.data": [
        "AUGMENT_KEYS",
        "IMAGENET_MEAN",
        "IMAGENET_STD",
        "IMAGE_EXTENSIONS",
        "Batch",
        "DataLoadingOptimizer",
        "ImageError",
        "LoaderError",
        "MultiCropDataset",
        "MultiCropLoader",
        "find_images",
        "multicrop_collate",
    ],
    "dino_opt.datasets": [
        "BUILTIN_CLASSES",
        "BUILTIN_VERSION",
        "builtin_dataset",
        "default_root",
        "render_image",
    ],
    "dino_opt.distributed": ["DistributedDINOTrainer", "launch_distributed_training"],
    "dino_opt.ema": ["EMATeacher", "update_teacher"],
    "dino_opt.evaluate": ["evaluate_checkpoint", "evaluate_run", "load_checkpoint"],
    "dino_opt.hardware": [
        "PresetChoice",
        "detect_device_memory",
        "measure_batch_size",
        "resolve_hardware",
        "resolve_preset",
    ],
    "dino_opt.health": [
        "HealthAlert",
        "HealthThresholds",
        "CollapseError",
        "NonFiniteError",
        "TrainingHealthMonitor",
        "step_is_finite",
        "teacher_entropy_per_row",
    ],
    "dino_opt.job": ["PROFILE_PHASES", "CheckpointedDINOTrainer", "ResumeError", "run_training"],
    "dino_opt.knn": [
        "EvalImageFolder",
        "extract_features",
        "knn_classify",
        "knn_evaluate",
        "knn_evaluate_splits",
        "tsne",
        "tsne_plot",
    ],
    "dino_opt.loss": ["DINOLoss", "NonFiniteLossError", "dino_loss"],
    "dino_opt.memory": [
        "MemoryTracker",
        "VRAMProfiler",
        "device_index",
        "memory_snapshot",
        "nvml_status",
    ],
    "dino_opt.ops": [
        "IMAGENET_MEAN",
        "IMAGENET_STD",
        "PHOTOMETRIC_PARAM_COLUMNS",
        "dino_loss",
        "ema_update_",
        "multicrop_photometric",
    ],
    "dino_opt.optimize": [
        "COMPILE_MODES",
        "CONFIG_KEYS",
        "ModelOptimizer",
        "SDPAForward",
        "explicit_attention",
        "optimize_attention",
        "optimize_model",
        "optimize_model_report",
        "restore_attention",
    ],
    "dino_opt.plots": ["MEMORY_KEYS", "plot_training_curves", "read_metrics"],
    "dino_opt.presets": [
        "PRESETS",
        "PRESET_KEYS",
        "PRESET_NAMES",
        "HardwarePreset",
        "preset_for_memory",
    ],
    "dino_opt.profiler": [
        "DINOProfiler",
        "PerformanceMonitor",
        "PerformanceProfiler",
        "Profiler",
        "TrainingProfiler",
        "profile_summary",
    ],
    "dino_opt.runfiles": ["RunFolder"],
    "dino_opt.runlog": ["RunLog"],
    "dino_opt.runtime": [
        "DistInfo",
        "GracefulStop",
        "all_reduce_metrics",
        "barrier",
        "broadcast_object",
        "gather_objects",
        "init_distributed",
        "is_distributed",
        "launched_world",
        "no_sync",
        "rank",
        "resolve_device",
        "resolve_precision",
        "world_size",
        "wrap_student",
    ],
    "dino_opt.schedules": ["Schedules", "cosine_scheduler", "teacher_temp_schedule"],
    "dino_opt.throughput": ["OptimizedDataLoader", "ThroughputOptimizer", "dynamic_batch_size"],
    "dino_opt.trainer": ["DINOModel", "MemoryOptimizedDINOTrainer", "param_groups"],
    "dino_opt.watchdog": [
        "EXIT_HANG",
        "HangWatchdog",
        "TrainingHungError",
        "describe_hang",
        "host_store",
        "join_store",
    ],
    "dino_opt.weights": [
        "FORMATS",
        "ExportResult",
        "ExternalWeights",
        "evaluate_weights",
        "export_weights",
        "init_from",
        "read_weights",
    ],
}


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_every_name_of_the_flat_layout_still_imports(old):
    module = importlib.import_module(old)
    missing = [n for n in OLD_MODULES[old] if not hasattr(module, n)]
    assert not missing, f"{old} lost {missing}"


@pytest.mark.parametrize("old", sorted(MODULE_ALIASES))
def test_an_old_path_is_the_new_module_itself(old):
    new = importlib.import_module(MODULE_ALIASES[old])
    assert importlib.import_module(old) is new
    assert new.__spec__.name == MODULE_ALIASES[old]  # reload and pickle see the real name
    assert getattr(dino_opt, old.rsplit(".", 1)[1]) is new


def test_an_old_path_imports_in_a_fresh_process_without_the_package_first():
    code = (
        "from dino_opt.trainer import MemoryOptimizedDINOTrainer as T\n"
        "import dino_opt.train.trainer as m\n"
        "assert T is m.MemoryOptimizedDINOTrainer\n"
        "import pickle\n"
        "from dino_opt.memory import MemoryTracker\n"
        "assert MemoryTracker.__module__ == 'dino_opt.observe.memory'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_aliases_cover_every_moved_module_and_nothing_else():
    package = ROOT / "python" / "dino_opt"
    for old, new in MODULE_ALIASES.items():
        assert importlib.util.find_spec(new) is not None, new
        rel = old.split(".", 1)[1]
        assert not (package / f"{rel}.py").exists(), f"{old} is a module again: drop its alias"
        assert not (package / rel / "__init__.py").exists(), f"{old} is a folder: drop its alias"
    moved = {m for m in OLD_MODULES if importlib.util.find_spec(m).name != m}
    assert moved <= set(MODULE_ALIASES)


def _user_imports():
    """(where, module, name) for each import of dino_opt and each
    ``dino_opt.module.Name`` reference in the README, docs and notebooks."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for path in [*texts, *sorted((ROOT / "notebooks").glob("*.ipynb"))]:
        text = path.read_text()
        if path.suffix == ".ipynb":
            cells = json.loads(text)["cells"]
            text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for m in re.finditer(r"^\s*from (dino_opt[\w.]*) import ([\w, ]+)", text, re.M):
            found += [(path.name, m[1], n.strip()) for n in m[2].split(",") if n.strip()]
        for m in re.finditer(r"`(dino_opt(?:\.[a-z_]+)+)\.([A-Za-z_]\w*)", text):
            found.append((path.name, m[1], m[2]))
    return found


USER_IMPORTS = _user_imports()


def test_the_docs_show_imports():
    assert len(USER_IMPORTS) > 40


@pytest.mark.parametrize("where,module,name", USER_IMPORTS, ids=lambda x: str(x))
def test_what_the_docs_import_exists(where, module, name):
    try:
        target = importlib.import_module(module)
    except ImportError:  # `dino_opt.a.b` where b is a name of dino_opt.a
        module, attr = module.rsplit(".", 1)
        target = getattr(importlib.import_module(module), attr)
    ok = hasattr(target, name) or importlib.util.find_spec(f"{module}.{name}") is not None
    assert ok, f"{where}: {module}.{name} does not exist"
