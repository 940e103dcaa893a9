"""Images from file batches: decode, label by parent folder, scale (DL4J's ``ImageRecordReader``,
``ParentPathLabelGenerator`` and ``ImagePreProcessingScaler`` behind a ``RecordReaderFileBatchLoader``).
"""

from __future__ import annotations

import io
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from dlscale.data import loaders
from dlscale.data.dataset import DataSet, DataShapeError
from dlscale.data.filebatch import FileBatch
from dlscale.errors import CorruptDataError, LabelError
from dlscale.storage import find_files

MODES = {1: "L", 3: "RGB", 4: "RGBA"}
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP", "PPM")
"""Formats the loader decodes; others (EPS, which runs Ghostscript, among them) are refused."""


def _parent(path: str) -> str:
    return posixpath.basename(posixpath.dirname(path))


def parent_path_labels(
    src_url: str, extensions: Sequence[str] | None = None, *, storage_options: dict[str, Any] | None = None
) -> list[str]:
    """The sorted distinct parent-folder names of the files under ``src_url``: the class labels."""
    _, files = find_files(src_url, storage_options, True, extensions)
    return sorted({_parent(p) for p in files})


@dataclass
class ImageFileBatchLoader:
    """Load a file batch of images as a ``DataSet``: ``loader(url)``.

    Features are float32 ``[N, channels, height, width]`` with pixel values 0..255, resized
    (bilinear) to ``height`` x ``width`` when given; without a size, all images of a batch must
    have the same size. Labels are int64 indices into ``labels`` of each image's parent folder.
    ``preprocessor`` (e.g. :class:`ImagePreProcessingScaler`) is applied last. The loader is
    picklable, so it can be shipped to workers.
    """

    labels: Sequence[str]
    height: int | None = None
    width: int | None = None
    channels: int = 3
    preprocessor: Callable[[DataSet], DataSet] | None = None
    storage_options: dict[str, Any] | None = None
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.labels = list(self.labels)
        self._index = {label: i for i, label in enumerate(self.labels)}
        if not self.labels or len(self._index) != len(self.labels):
            raise ValueError(f"labels must be a non-empty list of distinct names, got {self.labels}")
        if self.channels not in MODES:
            raise ValueError(f"channels must be one of {sorted(MODES)}, got {self.channels}")
        if (self.height is None) != (self.width is None):
            raise ValueError("give both height and width, or neither")
        if self.height is not None and (self.height < 1 or self.width < 1):
            raise ValueError(f"height and width must be positive, got {self.height} x {self.width}")

    def __call__(self, url: str) -> DataSet:
        batch = FileBatch.read(url, self.storage_options)
        if not batch.paths:
            raise DataShapeError(f"{url}: the file batch holds no images")
        images = [self._decode(path, data, url) for path, data in zip(batch.paths, batch.contents)]
        for path, image in zip(batch.paths, images):
            if image.shape != images[0].shape:
                raise DataShapeError(
                    f"{path} in {url} is {image.shape[1]}x{image.shape[0]} but {batch.paths[0]} is "
                    f"{images[0].shape[1]}x{images[0].shape[0]}; give the loader a height and width to resize"
                )
        features = torch.from_numpy(np.stack(images)).reshape(len(images), *images[0].shape[:2], -1)
        labels = torch.tensor([self._label(p) for p in batch.paths], dtype=torch.int64)
        ds = DataSet(features.permute(0, 3, 1, 2).to(torch.float32).contiguous(), labels)
        return self.preprocessor(ds) if self.preprocessor is not None else ds

    def _label(self, path: str) -> int:
        label = self._index.get(_parent(path))
        if label is None:
            raise LabelError(f"{path}: folder {_parent(path)!r} is not one of the labels {self.labels}")
        return label

    def _decode(self, path: str, data: bytes, url: str) -> np.ndarray:
        """The image as uint8 ``[height, width]`` or ``[height, width, channels]``."""
        try:
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                # Pillow only warns between MAX_IMAGE_PIXELS and twice that; refuse as it does above
                limit = Image.MAX_IMAGE_PIXELS
                if limit is not None and img.width * img.height > limit:
                    raise CorruptDataError(
                        f"{path} in {url}: {img.width}x{img.height} pixels is more than "
                        f"PIL.Image.MAX_IMAGE_PIXELS ({limit}), a possible decompression bomb"
                    )
                img = img.convert(MODES[self.channels])
                if self.height is not None:
                    img = img.resize((self.width, self.height), Image.Resampling.BILINEAR)
                return np.asarray(img, dtype=np.uint8)
        except (CorruptDataError, MemoryError):
            raise
        except Exception as e:  # Pillow's decoders raise many kinds of error on malformed bytes
            raise CorruptDataError(f"{path} in {url}: cannot decode image: {e}") from e


loaders.REGISTRY.register("image", ImageFileBatchLoader)


@dataclass(frozen=True)
class ImagePreProcessingScaler:
    """Map features from [0, max_pixel] to [min_range, max_range]; labels and masks are kept."""

    min_range: float = 0.0
    max_range: float = 1.0
    max_pixel: float = 255.0

    def __post_init__(self) -> None:
        if self.max_pixel <= 0:
            raise ValueError(f"max_pixel must be positive, got {self.max_pixel}")

    def __call__(self, ds: DataSet) -> DataSet:
        x = ds.features if ds.features.is_floating_point() else ds.features.to(torch.float32)
        x = x / self.max_pixel * (self.max_range - self.min_range) + self.min_range
        return DataSet(x, ds.labels, ds.features_mask, ds.labels_mask)
