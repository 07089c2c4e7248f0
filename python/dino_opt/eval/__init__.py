"""Evaluating features: DINO's weighted k-NN and t-SNE, DINOv2's linear
probe grid and logistic regression, DINOv3's dense linear probe, the
attention and PCA pictures, embeddings of any images, and the evaluation
of checkpoints and runs."""

from .dense import DenseLinearHead, dense_probe, dense_probe_root, segmentation_metrics
from .embed import (
    EMBED_FORMATS,
    Embeddings,
    check_embeddings_output,
    embed_images,
    write_embeddings,
)
from .evaluate import (
    draw_pictures,
    evaluate_backbone,
    evaluate_checkpoint,
    evaluate_run,
    evaluate_teacher,
    load_checkpoint,
    report_keys,
    verdict,
)
from .features import EvalImageFolder, EvalLoader, extract_features
from .knn import (
    knn_classify,
    knn_evaluate,
    knn_evaluate_splits,
    tsne,
    tsne_plot,
)
from .linear import (
    LinearProbeGrid,
    ProbeData,
    ProbeFeatures,
    linear_probe,
    logistic_regression,
    probe_table,
)
from .pictures import (
    attention_maps,
    check_attention,
    pca_maps,
    picture_arrays,
    save_attention_grid,
    save_pca_grid,
    show,
)

__all__ = [
    "EMBED_FORMATS",
    "DenseLinearHead",
    "Embeddings",
    "EvalImageFolder",
    "EvalLoader",
    "LinearProbeGrid",
    "ProbeData",
    "ProbeFeatures",
    "attention_maps",
    "check_attention",
    "dense_probe",
    "dense_probe_root",
    "draw_pictures",
    "embed_images",
    "evaluate_backbone",
    "evaluate_checkpoint",
    "evaluate_run",
    "evaluate_teacher",
    "extract_features",
    "knn_classify",
    "knn_evaluate",
    "knn_evaluate_splits",
    "linear_probe",
    "load_checkpoint",
    "logistic_regression",
    "pca_maps",
    "picture_arrays",
    "probe_table",
    "report_keys",
    "save_attention_grid",
    "save_pca_grid",
    "segmentation_metrics",
    "show",
    "tsne",
    "tsne_plot",
    "verdict",
    "write_embeddings",
    "check_embeddings_output",
]
