"""Images in: the native multi-crop loader, DINOv2's block masks and the built-in data set."""

from .builtin import BUILTIN_CLASSES, BUILTIN_VERSION, builtin_dataset, default_root, render_image
from .loader import (
    AUGMENT_KEYS,
    IMAGE_EXTENSIONS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    Batch,
    DataLoadingOptimizer,
    ImageError,
    LoaderError,
    MultiCropDataset,
    MultiCropLoader,
    find_images,
    multicrop_collate,
)
from .masking import (
    MASK_KEYS,
    MaskingGenerator,
    collate_data_and_cast,
    mask_options,
    mask_targets,
    mask_upperbound,
)

__all__ = [
    "AUGMENT_KEYS",
    "BUILTIN_CLASSES",
    "BUILTIN_VERSION",
    "Batch",
    "DataLoadingOptimizer",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "MASK_KEYS",
    "ImageError",
    "LoaderError",
    "MaskingGenerator",
    "MultiCropDataset",
    "MultiCropLoader",
    "builtin_dataset",
    "collate_data_and_cast",
    "default_root",
    "find_images",
    "mask_options",
    "mask_targets",
    "mask_upperbound",
    "multicrop_collate",
    "render_image",
]
