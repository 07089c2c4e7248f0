"""Images in: the native multi-crop loader and the built-in data set."""

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

__all__ = [
    "AUGMENT_KEYS",
    "BUILTIN_CLASSES",
    "BUILTIN_VERSION",
    "Batch",
    "DataLoadingOptimizer",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "ImageError",
    "LoaderError",
    "MultiCropDataset",
    "MultiCropLoader",
    "builtin_dataset",
    "default_root",
    "find_images",
    "multicrop_collate",
    "render_image",
]
