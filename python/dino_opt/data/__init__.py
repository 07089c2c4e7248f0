"""Images in: the data sources (folders, file lists, tar shards, Hugging Face
data sets), the native multi-crop loader, DINOv2's block masks, the
built-in data set (with per-pixel masks) and segmentation data (image/mask
pairs)."""

from .builtin import (
    BUILTIN_CLASSES,
    BUILTIN_MASK_CLASSES,
    BUILTIN_VERSION,
    builtin_dataset,
    default_root,
    render_image,
    render_image_and_mask,
)
from .loader import (
    AUGMENT_KEYS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    Batch,
    DataLoadingOptimizer,
    ImageError,
    LoaderError,
    MultiCropDataset,
    MultiCropLoader,
    NativeLoaderHandle,
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
from .segmentation import IGNORE_INDEX, SegmentationSource, segmentation_splits
from .shards import verify_shards, write_shards
from .sources import (
    FORMATS,
    IMAGE_EXTENSIONS,
    DataSource,
    SourceError,
    default_index_dir,
    detect_format,
    expand_pattern,
    find_images,
    open_source,
    sibling_split,
    source_exists,
)

__all__ = [
    "AUGMENT_KEYS",
    "BUILTIN_CLASSES",
    "BUILTIN_MASK_CLASSES",
    "BUILTIN_VERSION",
    "Batch",
    "DataSource",
    "FORMATS",
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
    "IGNORE_INDEX",
    "NativeLoaderHandle",
    "SegmentationSource",
    "SourceError",
    "builtin_dataset",
    "collate_data_and_cast",
    "default_index_dir",
    "default_root",
    "detect_format",
    "expand_pattern",
    "find_images",
    "mask_options",
    "mask_targets",
    "mask_upperbound",
    "multicrop_collate",
    "open_source",
    "render_image",
    "render_image_and_mask",
    "segmentation_splits",
    "sibling_split",
    "source_exists",
    "verify_shards",
    "write_shards",
]
