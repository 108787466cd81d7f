"""Data sets that install with the project (no downloads at run time).

Fashion-MNIST comes from the Debian package dataset-fashion-mnist (installed by
scripts/setup_env.sh) as IDX gzip files; a user may point --data-dir at another copy.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_IDX_DTYPES = {0x08: np.uint8}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (optionally gzip-compressed) as a numpy array of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, file holds {body.size} values")
    return body.reshape(shape)


def load_fashion_mnist(split: str = "train", data_dir: Path | str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 N x 1 x 28 x 28 scaled to [0, 1], labels int64 N) of 'train' or 'test'."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(data_dir) if data_dir is not None else FASHION_MNIST_DIR
    prefix = "train" if split == "train" else "t10k"
    images_path = root / f"{prefix}-images-idx3-ubyte.gz"
    labels_path = root / f"{prefix}-labels-idx1-ubyte.gz"
    if not images_path.exists() or not labels_path.exists():
        raise FileNotFoundError(
            f"Fashion-MNIST not found under {root}: install the Debian package "
            "(apt-get install dataset-fashion-mnist, done by scripts/setup_env.sh) or pass "
            "--data-dir pointing at the four *-idx*-ubyte.gz files")
    images = torch.from_numpy(read_idx(images_path).copy()).float().div_(255).unsqueeze(1)
    labels = torch.from_numpy(read_idx(labels_path).astype(np.int64))
    return images, labels
