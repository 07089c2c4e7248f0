"""Evaluating features: DINO's weighted k-NN, t-SNE, the k-NN of checkpoints and runs."""

from .evaluate import evaluate_checkpoint, evaluate_run, load_checkpoint
from .knn import (
    EvalImageFolder,
    extract_features,
    knn_classify,
    knn_evaluate,
    knn_evaluate_splits,
    tsne,
    tsne_plot,
)

__all__ = [
    "EvalImageFolder",
    "evaluate_checkpoint",
    "evaluate_run",
    "extract_features",
    "knn_classify",
    "knn_evaluate",
    "knn_evaluate_splits",
    "load_checkpoint",
    "tsne",
    "tsne_plot",
]
