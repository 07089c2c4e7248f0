"""A run's process: device, precision, process group, collectives, a state sent between
ranks, signals, watchdog, garbage collection, what compilation cost."""

from .collector import StepCollector
from .compilation import compile_totals
from .device import computes_bf16, cpu_computes_bf16, resolve_device, resolve_precision, with_index
from .groups import StudentGroups, data_place, student_groups
from .process import (
    DistInfo,
    all_reduce_metrics,
    barrier,
    broadcast_object,
    gather_objects,
    init_distributed,
    is_distributed,
    launched_world,
    no_sync,
    rank,
    world_size,
    wrap_student,
)
from .sharding import is_sharded, replicated, shard_frozen_backbone, shard_model
from .signals import GracefulStop
from .transfer import recv_state, send_state
from .watchdog import (
    EXIT_HANG,
    HangWatchdog,
    TrainingHungError,
    describe_hang,
    host_store,
    join_store,
)

__all__ = [
    "DistInfo",
    "EXIT_HANG",
    "GracefulStop",
    "HangWatchdog",
    "StepCollector",
    "StudentGroups",
    "TrainingHungError",
    "all_reduce_metrics",
    "barrier",
    "broadcast_object",
    "compile_totals",
    "computes_bf16",
    "cpu_computes_bf16",
    "data_place",
    "describe_hang",
    "gather_objects",
    "host_store",
    "init_distributed",
    "is_distributed",
    "is_sharded",
    "join_store",
    "launched_world",
    "no_sync",
    "rank",
    "recv_state",
    "replicated",
    "resolve_device",
    "resolve_precision",
    "send_state",
    "with_index",
    "shard_frozen_backbone",
    "shard_model",
    "student_groups",
    "world_size",
    "wrap_student",
]
