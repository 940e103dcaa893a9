"""Small real data sets bundled with dlscale, for examples, the main job and tests without a download.

``load_digits``: the 1,797 handwritten digits (8x8 images, 16 grey levels) of the UCI Machine
Learning Repository's "Optical Recognition of Handwritten Digits" test set (Alpaydin and Kaynak,
1998; CC BY 4.0), as scikit-learn also ships them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_DIGITS = Path(__file__).resolve().parent / "digits.npz"


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: float32 ``[1797, 1, 8, 8]`` scaled to [0, 1], and int64 classes 0-9."""
    with np.load(_DIGITS, allow_pickle=False) as data:
        images, labels = data["images"], data["labels"]
    return torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
