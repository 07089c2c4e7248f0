"""Baseline multi-crop pipelines for the loader benchmark, written from the
augmentation of the original DINO (docs/design.md, "The algorithm"):

- :class:`PILMultiCrop`: torchvision.transforms on PIL images, blur with PIL's
  ``ImageFilter.GaussianBlur(radius=uniform(0.1, 2.0))`` as DINO did.
- :class:`V2MultiCrop`: the same with torchvision.transforms.v2 on uint8
  tensors, decoded with ``torchvision.io.decode_jpeg`` on the CPU.

Both are Datasets over a list of (path, label) returning
``(list of 2 + n_local crops, label)``; :func:`collate_multicrop` stacks them
crop-wise into ``[B, 3, H, W]`` tensors, as DataLoader hands them to training.

Blur in the v2 pipeline: v2.GaussianBlur draws sigma per call but needs a
fixed kernel size. sigma <= 2.0, and 2 * ceil(3 * 2.0) + 1 = 13 taps cover
+-3 sigma at the largest sigma, so a kernel of 13 gives the same blur as an
exact Gaussian for every sigma drawn (smaller sigmas just get near-zero tails)
and the cost of the widest blur DINO uses. (The 23-tap kernel of BYOL/SimCLR
code is for sigma relative to image size; it would overstate the cost.) The
same 13 is used for local crops, since DINO draws the same sigma range there.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as v2
from PIL import Image, ImageFilter
from torch.utils.data import default_collate
from torchvision.io import ImageReadMode, decode_jpeg

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SIGMA = (0.1, 2.0)
V2_BLUR_KERNEL = 13
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def list_image_folder(root: str | os.PathLike) -> list[tuple[str, int]]:
    """(path, label) pairs in torchvision ImageFolder order: class folders
    sorted by name, files sorted within each."""
    root = Path(root)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(root / name, followlinks=True)):
            for f in sorted(files):
                if f.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, f), label))
    return samples


class PILGaussianBlur:
    """PIL Gaussian blur with probability p and radius uniform in SIGMA."""

    def __init__(self, p: float):
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        if random.random() >= self.p:
            return img
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(*SIGMA)))


class PILMultiCropTransform:
    """DINO's multi-crop augmentation on a PIL image."""

    def __init__(
        self,
        global_size: int = 224,
        local_size: int = 96,
        n_local: int = 8,
        global_scale: tuple[float, float] = (0.4, 1.0),
        local_scale: tuple[float, float] = (0.05, 0.4),
    ):
        bicubic = T.InterpolationMode.BICUBIC
        flip_and_jitter = T.Compose(
            [
                T.RandomHorizontalFlip(p=0.5),
                # ColorJitter applies its four ops in a random order on each call.
                T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
                T.RandomGrayscale(p=0.2),
            ]
        )
        normalize = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        self.global1 = T.Compose(
            [
                T.RandomResizedCrop(global_size, scale=global_scale, interpolation=bicubic),
                flip_and_jitter,
                PILGaussianBlur(1.0),
                normalize,
            ]
        )
        self.global2 = T.Compose(
            [
                T.RandomResizedCrop(global_size, scale=global_scale, interpolation=bicubic),
                flip_and_jitter,
                PILGaussianBlur(0.1),
                T.RandomSolarize(128, p=0.2),
                normalize,
            ]
        )
        self.local = T.Compose(
            [
                T.RandomResizedCrop(local_size, scale=local_scale, interpolation=bicubic),
                flip_and_jitter,
                PILGaussianBlur(0.5),
                normalize,
            ]
        )
        self.n_local = n_local

    def __call__(self, img: Image.Image) -> list[torch.Tensor]:
        return [self.global1(img), self.global2(img)] + [
            self.local(img) for _ in range(self.n_local)
        ]


class V2MultiCropTransform:
    """The same augmentation with torchvision.transforms.v2 on a uint8
    [3, H, W] tensor; float conversion and normalisation come last, as the
    PIL pipeline's ToTensor does."""

    def __init__(
        self,
        global_size: int = 224,
        local_size: int = 96,
        n_local: int = 8,
        global_scale: tuple[float, float] = (0.4, 1.0),
        local_scale: tuple[float, float] = (0.05, 0.4),
    ):
        bicubic = v2.InterpolationMode.BICUBIC
        flip_and_jitter = [
            v2.RandomHorizontalFlip(p=0.5),
            v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            v2.RandomGrayscale(p=0.2),
        ]
        normalize = [
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]

        def blur(p: float) -> v2.Transform:
            return v2.RandomApply([v2.GaussianBlur(V2_BLUR_KERNEL, sigma=SIGMA)], p=p)

        def crop(size: int, scale: tuple[float, float]) -> v2.Transform:
            return v2.RandomResizedCrop(size, scale=scale, interpolation=bicubic, antialias=True)

        self.global1 = v2.Compose(
            [crop(global_size, global_scale), *flip_and_jitter, blur(1.0), *normalize]
        )
        self.global2 = v2.Compose(
            [
                crop(global_size, global_scale),
                *flip_and_jitter,
                blur(0.1),
                v2.RandomSolarize(threshold=128, p=0.2),
                *normalize,
            ]
        )
        self.local = v2.Compose(
            [crop(local_size, local_scale), *flip_and_jitter, blur(0.5), *normalize]
        )
        self.n_local = n_local

    def __call__(self, img: torch.Tensor) -> list[torch.Tensor]:
        return [self.global1(img), self.global2(img)] + [
            self.local(img) for _ in range(self.n_local)
        ]


class _MultiCropFolder(torch.utils.data.Dataset):
    """(path, label) samples through a decoder and a multi-crop transform."""

    transform_class: type

    def __init__(self, samples: Sequence[tuple[str, int]], **crop_args):
        self.samples = list(samples)
        self.transform = self.transform_class(**crop_args)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[list[torch.Tensor], int]:
        path, label = self.samples[i]
        return self.transform(self.decode(path)), label


class PILMultiCrop(_MultiCropFolder):
    """ImageFolder-style dataset: PIL decode + the PIL multi-crop transform."""

    transform_class = PILMultiCropTransform

    @staticmethod
    def decode(path: str) -> Image.Image:
        # As torchvision's ImageFolder loader: open, then convert (which decodes).
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")


class V2MultiCrop(_MultiCropFolder):
    """ImageFolder-style dataset: decode_jpeg (libjpeg-turbo, CPU) + the v2
    multi-crop transform on uint8 tensors."""

    transform_class = V2MultiCropTransform

    @staticmethod
    def decode(path: str) -> torch.Tensor:
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        return decode_jpeg(data, mode=ImageReadMode.RGB)


def collate_multicrop(
    batch: Sequence[tuple[list[torch.Tensor], int]],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[(crops, label)] -> ([crop_k stacked over the batch for each k], labels).

    This is what DataLoader's default_collate makes of these samples (and what
    DINO trained with); it is called rather than re-written because inside a
    worker it stacks straight into shared memory, which saves a copy of every
    batch on its way to the main process. A plain torch.stack would make the
    baselines slower than they are.
    """
    crops, labels = default_collate(batch)
    return crops, labels
