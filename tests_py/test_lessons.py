"""Every name the course's lessons use is importable from dino_opt.lessons
and is the implementation of the module that owns it."""

import inspect

import dino_opt.lessons as lessons

COURSE_NAMES = {  # name -> where it lives
    "MemoryOptimizedDINOTrainer": "dino_opt.train.trainer",
    "MemoryTracker": "dino_opt.observe.memory",
    "VRAMProfiler": "dino_opt.observe.memory",
    "DataLoadingOptimizer": "dino_opt.data.loader",
    "ModelOptimizer": "dino_opt.tune.optimize",
    "DINOProfiler": "dino_opt.observe.profiler",
    "PerformanceMonitor": "dino_opt.observe.profiler",
    "PerformanceProfiler": "dino_opt.observe.profiler",
    "TrainingProfiler": "dino_opt.observe.profiler",
    "ThroughputOptimizer": "dino_opt.tune.throughput",
    "OptimizedDataLoader": "dino_opt.tune.throughput",
    "dynamic_batch_size": "dino_opt.tune.throughput",
    "DistributedDINOTrainer": "dino_opt.distributed.launch",
    "launch_distributed_training": "dino_opt.distributed.launch",
    "CheckpointedDINOTrainer": "dino_opt.job.job",
    "CheckpointManager": "dino_opt.checkpoint.manager",
    "TrainingHealthMonitor": "dino_opt.observe.health",
    "DINOTrainingAnalyzer": "dino_opt.observe.analysis",
}


def test_course_names_are_exported_from_their_modules():
    assert set(lessons.__all__) == set(COURSE_NAMES)
    for name, module in COURSE_NAMES.items():
        obj = getattr(lessons, name)
        assert obj.__module__ == module, name


def test_lesson_signatures():
    def params(f):
        return list(inspect.signature(f).parameters)

    assert params(lessons.MemoryOptimizedDINOTrainer)[:5] == [
        "model",
        "loss_fn",
        "optimizer",
        "config",
        "device",
    ]
    assert params(lessons.DistributedDINOTrainer)[:5] == [
        "rank",
        "world_size",
        "config",
        "master_addr",
        "master_port",
    ]
    assert params(lessons.launch_distributed_training)[:4] == [
        "config_path",
        "num_gpus",
        "master_addr",
        "master_port",
    ]
    assert params(lessons.ThroughputOptimizer)[:2] == ["model", "device"]
    assert params(lessons.ThroughputOptimizer.find_optimal_batch_size)[1:4] == [
        "dataloader",
        "max_batch_size",
        "target_memory_fraction",
    ]
    assert params(lessons.ModelOptimizer.optimize_model)[:2] == ["model", "config"]
    assert params(lessons.dynamic_batch_size)[:3] == ["gpu_memory_gb", "resolution", "network_dim"]
    assert "auto_resume" in params(lessons.CheckpointedDINOTrainer)
    assert params(lessons.TrainingHealthMonitor.check_training_health)[1] == "metrics"
