"""Models for the experiments, by the SparDL CLI's --dnn names."""
from __future__ import annotations

from torch import nn

from .cnn import VGG, AlexNet, CifarResNet, ResNet50
from .rnn import LSTMClassifier, LSTMLanguageModel, MiniLMClassifier
from .small import FashionCNN, MnistCNN
from .transformer import DecoderLM

MODELS = {
    "resnet20": lambda c, k: CifarResNet(20, c, k),
    "resnet56": lambda c, k: CifarResNet(56, c, k),
    "resnet110": lambda c, k: CifarResNet(110, c, k),
    "resnet50": lambda c, k: ResNet50(c, k),
    "vgg16": lambda c, k: VGG(16, c, k),
    "vgg19": lambda c, k: VGG(19, c, k),
    "alexnet": lambda c, k: AlexNet(c, k),
    "fashioncnn": lambda c, k: FashionCNN(k) if c == 1 else _channels_error("fashioncnn", c),
    "mnistcnn": lambda c, k: MnistCNN(c, k),
    # Text models: c is the vocabulary size.
    "lstmimdb": lambda c, k: LSTMClassifier(c, k),
    "lstm": lambda c, k: LSTMLanguageModel(c),
    "transformer": lambda c, k: DecoderLM(c),  # 4 pre-norm blocks, 96 wide: 0.45M parameters
    "bert": lambda c, k: MiniLMClassifier(k),  # reads WordPiece ids (its own tokenizer)
}
# What each model reads: 'image' (N x C x H x W), 'text' (N x L ids -> class) or 'lm' (N x L
# ids -> next ids); testbed.datasets.DATASET_TASKS says the same of each data set.
MODEL_TASKS = {name: "image" for name in MODELS} | {"lstmimdb": "text", "lstm": "lm", "bert": "text",
                                                   "transformer": "lm"}


def _channels_error(name: str, channels: int):
    raise ValueError(f"{name} takes 1-channel images, the data set has {channels}")


def build_model(name: str, in_channels: int, classes: int) -> nn.Module:
    """The --dnn model for images of `in_channels` channels (text: a vocabulary of that many
    ids) and `classes` classes."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(sorted(MODELS))}")
    return MODELS[name](in_channels, classes)


__all__ = ["FashionCNN", "MnistCNN", "CifarResNet", "ResNet50", "VGG", "AlexNet", "LSTMClassifier",
           "LSTMLanguageModel", "MiniLMClassifier", "DecoderLM", "MODELS", "MODEL_TASKS", "build_model"]
