"""The training CLI (experiments/main_trainer.py): models, data loaders on fixtures in the real
file formats, every compressor name on 2 workers, config files, resume, and real launches."""
from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, _env, require_netns
from experiments import cli, main_trainer
from testbed import text
from testbed.datasets import DATASET_TASKS, DATASETS, load_dataset
from testbed.models import MODEL_TASKS, MODELS, build_model
from spardl_grace import launch
from spardl_grace.transport import run_local
from spardl_grace.warmup import warmup_density
from testbed.records import open_run, read_log


# ------------------------------------------------------------------------------- models
IMAGE_MODELS = sorted(n for n, task in MODEL_TASKS.items() if task == "image")


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 8, 8)], ids=["28px", "32px", "8px"])
def test_every_model_runs_forward_and_backward_on_its_inputs(name, shape):
    if name == "fashioncnn" and shape[0] != 1:
        with pytest.raises(ValueError, match="1-channel"):
            build_model(name, shape[0], 10)
        return
    model = build_model(name, shape[0], 7)
    logits = model(torch.randn(2, *shape))
    assert logits.shape == (2, 7)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name,expected", [("lstmimdb", (3, 5)), ("lstm", (3, 12, 50))])
def test_text_models_run_forward_and_backward_on_token_ids(name, expected):
    model = build_model(name, 50, 5)
    ids = torch.randint(0, 50, (3, 12))
    ids[0, 6:] = text.PAD
    logits = model(ids)
    assert logits.shape == expected
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_minilm_is_the_packaged_pretrained_model_with_its_tokenizer():
    model = build_model("bert", text.VOCAB, 3).eval()
    assert sum(p.numel() for p in model.encoder.parameters()) == 22_713_216
    ids, labels = load_dataset("tweets", "test", tokenizer="wordpiece")
    assert ids.shape[1] == text.TWEET_LENGTH and int(ids[0, 0]) == 101  # [CLS]
    with torch.no_grad():
        assert model(ids[:2]).shape == (2, 3)
    with pytest.raises(ValueError, match="valid choices: words, wordpiece"):
        load_dataset("tweets", "test", tokenizer="bpe")


def test_padding_does_not_change_a_classifiers_output():
    torch.manual_seed(0)
    model = build_model("lstmimdb", 50, 2).eval()
    ids = torch.randint(2, 50, (1, 7))
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.int64)], 1)
    assert torch.allclose(model(ids), model(padded), atol=1e-6)


def test_every_model_has_data_sets_and_mismatches_are_refused(tmp_path, capsys):
    assert set(MODEL_TASKS) == set(MODELS) and set(DATASET_TASKS) == set(DATASETS)
    for task in set(MODEL_TASKS.values()):
        assert task in DATASET_TASKS.values()
    with pytest.raises(SystemExit):
        cli.parse_args(["--dnn", "lstm", "--dataset", "fashion-mnist"])
    assert "--dnn lstm reads lm data; data sets for it: wikipedia-chars, wikitext" in capsys.readouterr().err


def test_device_choice_and_its_transport(monkeypatch, capsys):
    """--device auto resolves to what is visible; cuda without a GPU is refused by name. The
    backend choice is checked with device_count mocked (no GPU here; tests/test_cuda.py runs
    the CLI on a real one)."""
    auto = cli.parse_args([]).device
    assert auto == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            cli.parse_args(["--device", "cuda"])
        assert "--device cuda: no CUDA device is visible here; use --device cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "tpu"])
    assert "invalid choice: 'tpu' (choose from 'auto', 'cpu', 'cuda')" in capsys.readouterr().err
    assert launch.torch_backend("cpu", 4) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch.torch_backend("cuda", 4) == "nccl"
    assert launch.torch_backend("cuda", 8) == "gloo"  # ranks would share GPUs: NCCL refuses
    # 16 ranks on 4 nodes of 4 GPUs: each node's ranks have a GPU each, so NCCL (it took gloo
    # whenever the GPUs here were fewer than the job's ranks, i.e. for every multi-node job)
    ranks_here = launch.local_world_size(16, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "16"})
    assert ranks_here == 4 and launch.torch_backend("cuda", ranks_here) == "nccl"
    assert launch.local_world_size(16, {}) == 16
    assert launch.local_world_size(16, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2
    assert main_trainer.train_device("cpu", 3) == torch.device("cpu")


def test_model_sizes_match_the_papers():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(build_model("resnet20", 3, 10)) == 272_474  # 0.27M in He et al.
    assert 0.85e6 < count(build_model("resnet56", 3, 10)) < 0.86e6
    assert 25.5e6 < count(build_model("resnet50", 3, 1000)) < 25.6e6
    assert count(build_model("mnistcnn", 1, 10)) == 1_199_882  # Keras's mnist_cnn.py summary


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="valid choices: alexnet"):
        build_model("resnet21", 3, 10)


# ------------------------------------------------------------------------------- data sets
def _write_cifar(root, classes):
    rng = np.random.default_rng(0)
    folder = root / ("cifar-10-batches-py" if classes == 10 else "cifar-100-python")
    folder.mkdir()
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if classes == 10 \
        else ["train", "test"]
    key = b"labels" if classes == 10 else b"fine_labels"
    for name in names:
        batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8),
                 key: rng.integers(0, classes, 4).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return folder


@pytest.mark.parametrize("classes", [10, 100])
def test_cifar_loader_reads_the_python_pickle_format(tmp_path, classes):
    folder = _write_cifar(tmp_path, classes)
    images, labels = load_dataset(f"cifar{classes}", "train", tmp_path)
    assert images.shape == ((20 if classes == 10 else 4), 3, 32, 32)
    with open(folder / ("data_batch_1" if classes == 10 else "train"), "rb") as f:
        first = pickle.load(f, encoding="bytes")
    assert torch.equal(images[0], torch.from_numpy(first[b"data"][0].reshape(3, 32, 32)).float() / 255)
    assert labels[:4].tolist() == first[b"labels" if classes == 10 else b"fine_labels"]
    assert load_dataset(f"cifar{classes}", "test", tmp_path)[0].shape == (4, 3, 32, 32)


def test_mnist_loader_reads_idx_files(tmp_path):
    images = np.arange(3 * 28 * 28, dtype=np.uint64).reshape(3, 28, 28) % 256
    header = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (3, 28, 28))
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(
        gzip.compress(header + images.astype(np.uint8).tobytes()))
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + bytes([7, 1, 4])))
    x, y = load_dataset("mnist", "train", tmp_path)
    assert x.shape == (3, 1, 28, 28) and y.tolist() == [7, 1, 4]
    assert float(x[0, 0, 0, 5]) == pytest.approx(5 / 255)


def test_imdb_loader_reads_the_aclimdb_folders(tmp_path):
    reviews = {"train": {"neg": ["Bad, bad film.", "Boring"], "pos": ["A great film!"]},
               "test": {"neg": ["bad"], "pos": ["great great unseen"]}}
    for split, kinds in reviews.items():
        for kind, texts in kinds.items():
            folder = tmp_path / "aclImdb" / split / kind
            folder.mkdir(parents=True)
            for i, t in enumerate(texts):
                (folder / f"{i}_7.txt").write_text(t)
    x, y = load_dataset("imdb", "train", tmp_path)
    assert x.shape == (3, text.IMDB_LENGTH) and y.tolist() == [0, 0, 1]
    vocab = {"bad": 2, "film": 3}  # the most frequent training words first, ties by the word
    assert x[0, :3].tolist() == [vocab["bad"], vocab["bad"], vocab["film"]]
    assert int(x[0, 3]) == text.PAD
    tx, ty = load_dataset("imdb", "test", tmp_path)
    assert ty.tolist() == [0, 1] and int(tx[1, 2]) == text.UNK  # 'unseen' is not in train


def test_imagenet_loader_reads_class_folders_lazily(tmp_path):
    from PIL import Image
    for split in ("train", "val"):
        for c, colour in (("n01", (255, 0, 0)), ("n02", (0, 0, 255))):
            (tmp_path / split / c).mkdir(parents=True)
            Image.new("RGB", (300, 250), colour).save(tmp_path / split / c / "a.JPEG")
    images, labels = load_dataset("imagenet", "train", tmp_path)
    assert len(images) == 2 and labels.tolist() == [0, 1]
    batch = images[torch.tensor([1, 0])]
    assert batch.shape == (2, 3, 224, 224)
    assert float(batch[0, 2].mean()) > 0.95 and float(batch[0, 0].mean()) < 0.05  # blue
    assert len(images[:1]) == 1
    assert len(load_dataset("imagenet", "test", tmp_path)[0]) == 2


@pytest.mark.parametrize("name,match", [("cifar10", "cs.toronto.edu"), ("mnist", "--data-dir"),
                                        ("imdb", "ai.stanford.edu"), ("imagenet", "image-net.org")])
def test_a_missing_data_set_says_how_to_get_it(tmp_path, name, match):
    with pytest.raises(FileNotFoundError, match=match):
        load_dataset(name, "train", None if name == "mnist" else tmp_path)


def test_mnist_in_an_empty_folder_names_mnist_not_fashion_mnist(tmp_path):
    """It said 'Fashion-MNIST not found ... apt-get install dataset-fashion-mnist'."""
    with pytest.raises(FileNotFoundError, match="MNIST not found under .*exdb/mnist") as caught:
        load_dataset("mnist", "train", tmp_path)
    assert "Fashion" not in str(caught.value)


def test_installed_data_sets_load():
    x, y = load_dataset("fashion-mnist", "test")
    assert x.shape == (10000, 1, 28, 28) and int(y.max()) == 9
    x, y = load_dataset("digits", "train")
    assert x.shape == (1437, 1, 8, 8) and float(x.max()) == 1.0
    x, y = load_dataset("tweets", "train")
    tx, ty = load_dataset("tweets", "test")
    assert len(x) + len(tx) == 38_158 and x.shape[1] == text.TWEET_LENGTH
    assert set(y.tolist()) == {0, 1, 2} and int(x.max()) < text.VOCAB
    x, y = load_dataset("wikitext", "train")
    assert x.shape[1] == text.BPTT and torch.equal(x[0, 1:], y[0, :-1])  # the next word
    assert torch.equal(x[1, 0], y[0, -1]) and len(x) > 1000
    x, y = load_dataset("wikipedia-chars", "train")
    tx, _ = load_dataset("wikipedia-chars", "test")
    assert x.shape[1] == text.CHAR_CONTEXT and torch.equal(x[0, 1:], y[0, :-1])
    assert len(x) > 40_000 and 0.09 < len(tx) / (len(x) + len(tx)) < 0.11
    assert int(x.max()) == text.CHAR_VOCAB - 1 and (x == 0).float().mean() < 0.001  # rare: other
    with pytest.raises(ValueError, match="valid choices"):
        load_dataset("svhn", "train")
    assert set(DATASETS) >= {"fashion-mnist", "mnist", "digits", "cifar10", "cifar100"}


# ------------------------------------------------------------------------------- training
def _args(tmp_path, *extra):
    return cli.parse_args([
        "--dnn", "fashioncnn", "--dataset", "digits", "--batch-size", "16", "--max-epochs", "1",
        "--max-steps", "3", "--lr", "0.05", "--density", "0.05", "--out", str(tmp_path), *extra])


@pytest.mark.parametrize("compressor", [c for c in cli.COMPRESSORS
                                        if c not in cli.BASELINES])
def test_every_compressor_trains_identical_replicas_on_two_workers(tmp_path, compressor):
    args = _args(tmp_path, "--compression", "--compressor", compressor)
    summaries = run_local(2, lambda t: main_trainer.train(args, t))
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
    assert summaries[0]["test_accuracy"] == summaries[1]["test_accuracy"]
    assert np.isfinite(summaries[0]["train_loss"])


@pytest.mark.parametrize("dnn,dataset,recipe", [
    ("lstmimdb", "tweets", []), ("lstm", "wikitext", []), ("bert", "tweets", []),
    ("transformer", "wikipedia-chars", ["--optimizer", "adamw", "--clip-norm", "1"])])
def test_text_models_train_identical_replicas(tmp_path, dnn, dataset, recipe):
    args = cli.parse_args([
        "--dnn", dnn, "--dataset", dataset, "--batch-size", "4", "--max-steps", "2",
        "--test-samples", "40", "--compression", "--compressor", "spardl", "--out", str(tmp_path),
        *recipe])
    summaries = run_local(2, lambda t: main_trainer.train(args, t))
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
    assert 0 <= summaries[0]["test_accuracy"] <= 1 and np.isfinite(summaries[0]["test_loss"])


def test_the_cli_runs_diloco_through_the_grace_keys_and_refuses_them_alone(tmp_path):
    """--exchange update --exchange-period 3 with DiLoCo's outer step: 6 AdamW steps end on an
    exchange, so the replicas end identical, and a local step's bytes are none (2 exchanges'
    worth in 6 steps); the outer options alone are refused."""
    diloco = ["--compression", "--compressor", "spardl", "--optimizer", "adamw", "--max-steps", "6",
              "--exchange", "update", "--exchange-period", "3", "--outer-lr", "0.7",
              "--outer-momentum", "0.9"]
    args = _args(tmp_path / "diloco", *diloco)
    assert {k: v for k, v in cli.grace_params(args).items()
            if k in ("exchange", "exchange_period", "outer_lr", "outer_momentum")} == {
        "exchange": "update", "exchange_period": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
    every = run_local(2, lambda t: main_trainer.train(args, t))[0]
    finals = [torch.load(tmp_path / "diloco" / f"final-rank{r}.pt", weights_only=True)
              for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
    each = _args(tmp_path / "each", *diloco[:-6])
    assert 2.5 < run_local(2, lambda t: main_trainer.train(each, t))[0][
        "bytes_sent_per_step"] / every["bytes_sent_per_step"] < 3.5
    with pytest.raises(SystemExit):
        _args(tmp_path, "--compression", "--compressor", "spardl", "--exchange-period", "3")


def test_log_files_hold_every_step_and_epoch(tmp_path):
    args = _args(tmp_path, "--compression", "--compressor", "spardl", "--max-epochs", "2")
    run_local(2, lambda t: main_trainer.train(args, t))
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["start"] + (["step"] * 3 + ["eval", "epoch"]) * 2 + ["run"]
    assert records[0] == {"kind": "start", "step": 0, "resumed": False}
    epoch = records[-1]
    assert 0 < epoch["compression_ratio"] < 0.5 and epoch["bytes_sent_per_step"] > 0
    assert len((tmp_path / "epochs.csv").read_text().splitlines()) == 3


def _assert_same_final_params(a: Path, b: Path, ranks: int = 2) -> None:
    for r in range(ranks):
        assert torch.equal(torch.load(a / f"final-rank{r}.pt", weights_only=True)["params"],
                           torch.load(b / f"final-rank{r}.pt", weights_only=True)["params"])


def test_resume_continues_bit_identically(tmp_path):
    full = _args(tmp_path / "full", "--compression", "--compressor", "oktopk", "--max-epochs", "2")
    run_local(2, lambda t: main_trainer.train(full, t))
    first = _args(tmp_path / "cut", "--compression", "--compressor", "oktopk", "--max-epochs", "1")
    run_local(2, lambda t: main_trainer.train(first, t))
    rest = _args(tmp_path / "cut", "--compression", "--compressor", "oktopk", "--max-epochs", "2",
                 "--resume")
    run_local(2, lambda t: main_trainer.train(rest, t))
    _assert_same_final_params(tmp_path / "full", tmp_path / "cut")


def test_resume_within_an_epoch_from_the_previous_checkpoint_is_bit_identical(tmp_path):
    """--checkpoint-every 2 over 6 steps saves after steps 2, 4 and 6; with the newest lost (a
    crash while writing it), --resume takes the previous one (step 4) and ends where an
    uninterrupted run ends."""
    opts = ("--compression", "--compressor", "spardl", "--max-steps", "6")
    full = _args(tmp_path / "full", *opts)
    run_local(2, lambda t: main_trainer.train(full, t))
    cut = _args(tmp_path / "cut", *opts, "--checkpoint-every", "2")
    run_local(2, lambda t: main_trainer.train(cut, t))
    for r in range(2):
        (tmp_path / "cut" / f"ckpt-rank{r}.pt").unlink()
        assert torch.load(tmp_path / "cut" / f"ckpt-rank{r}.pt.prev", weights_only=True)["step"] == 4
    rest = _args(tmp_path / "cut", *opts, "--checkpoint-every", "2", "--resume")
    run_local(2, lambda t: main_trainer.train(rest, t))
    _assert_same_final_params(tmp_path / "full", tmp_path / "cut")
    # the epoch's record covers the whole epoch (it said step 2 and the last 2 steps' loss)
    full_epoch, cut_epoch = (
        [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()
         if '"kind": "epoch"' in line][-1] for run in ("full", "cut"))
    for key in ("step", "train_loss", "train_accuracy"):
        assert cut_epoch[key] == full_epoch[key], key
    # over the whole epoch too, within a few bytes: the resumed process sent 16 more in 6 steps,
    # the ranks' agreement on its 2 buckets (an 8-byte digest each) before their first exchange
    assert cut_epoch["bytes_sent_per_step"] * 6 == pytest.approx(
        full_epoch["bytes_sent_per_step"] * 6 + 16, abs=1e-6)
    # the evaluation after the resume averages over the 2 steps the process ran (it took 6)
    resumed = read_log(tmp_path / "cut")
    assert resumed["eval"][-1]["bytes_sent_per_step"] == resumed["run"][-1][
        "bytes_sent_per_step_run"] > full_epoch["bytes_sent_per_step"] / 2


@pytest.mark.parametrize("changed, says", [
    (["--lr", "0.5"], "lr: 0.05 there, 0.5 now"),
    (["--compressor", "topka"], "'communicator': 'spardl'"),
    (["--density", "0.1"], "'compress_ratio': 0.05"),
])
def test_resume_with_other_settings_is_refused_naming_them(tmp_path, changed, says):
    """A new --lr was ignored in silence (the saved schedule won), and another algorithm took
    over mid-run (dense dropped SparDL's residuals)."""
    opts = ["--compression", "--compressor", "spardl", "--density", "0.05", "--lr", "0.05"]
    run_local(2, lambda t: main_trainer.train(_args(tmp_path, *opts), t))
    again = _args(tmp_path, *opts, *changed, "--max-epochs", "2", "--resume")
    results = run_local(2, lambda t: _exit_of(lambda: main_trainer.train(again, t)))
    for said in results:
        assert "written with other settings" in said and says in said


def test_resume_takes_the_step_every_rank_holds_and_stays_bit_identical(tmp_path):
    """Rank 1's newest checkpoint (step 6) is lost, as a crash during its save would leave it:
    both ranks resume from step 4, which both hold, and end where an uninterrupted run ends."""
    opts = ("--compression", "--compressor", "spardl", "--max-steps", "6")
    run_local(2, lambda t: main_trainer.train(_args(tmp_path / "full", *opts), t))
    cut = ("--checkpoint-every", "2")
    run_local(2, lambda t: main_trainer.train(_args(tmp_path / "cut", *opts, *cut), t))
    (tmp_path / "cut" / "ckpt-rank1.pt").unlink()
    run_local(2, lambda t: main_trainer.train(_args(tmp_path / "cut", *opts, *cut, "--resume"), t))
    _assert_same_final_params(tmp_path / "full", tmp_path / "cut")


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    """--resume auto is one command for a job and its restarts: with no checkpoint it trains
    from the start (the bare --resume refuses on every rank instead), with one it continues,
    bit-identical to a run never stopped."""
    opts = ("--compression", "--compressor", "spardl", "--max-epochs", "2")
    run_local(2, lambda t: main_trainer.train(_args(tmp_path / "full", *opts), t))
    with pytest.raises(SystemExit, match="no rank holds a checkpoint"):
        run_local(2, lambda t: main_trainer.train(_args(tmp_path / "cut", *opts, "--resume"), t))
    first = _args(tmp_path / "cut", "--compression", "--compressor", "spardl", "--max-epochs", "1",
                  "--resume", "auto")
    run_local(2, lambda t: main_trainer.train(first, t))
    run_local(2, lambda t: main_trainer.train(_args(tmp_path / "cut", *opts, "--resume", "auto"), t))
    _assert_same_final_params(tmp_path / "full", tmp_path / "cut")
    records = [json.loads(line) for line in (tmp_path / "cut" / "log.jsonl").read_text().splitlines()]
    starts = [r for r in records if r["kind"] == "start"]
    assert starts == [{"kind": "start", "step": 0, "resumed": False},
                      {"kind": "start", "step": 3, "resumed": True}]


def test_resume_auto_after_the_last_step_ends_with_the_run_it_resumed(tmp_path):
    """A run killed while it was ending (every step done and checkpointed) and started again:
    nothing is left to train, and it ends as the finished run did, with its last epoch's
    figures and parameters."""
    opts = ("--compression", "--compressor", "spardl", "--max-epochs", "2", "--resume", "auto")
    run_local(2, lambda t: main_trainer.train(_args(tmp_path, *opts), t))
    finished = torch.load(tmp_path / "final-rank0.pt", weights_only=True)
    again = run_local(2, lambda t: main_trainer.train(_args(tmp_path, *opts), t))
    assert torch.equal(torch.load(tmp_path / "final-rank0.pt", weights_only=True)["params"],
                       finished["params"])
    assert again[0]["test_accuracy"] == finished["summary"]["test_accuracy"]
    assert again[0]["steps_run"] == 0


def test_config_file_gives_the_same_options_as_the_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("dnn: vgg16\ndataset: digits\nmax-epochs: 3\ncompression: true\n"
                      "compressor: gtopk\ndensity: 0.02\n")
    from_file = cli.parse_args(["--config", str(config), "--density", "0.05"])
    from_cli = cli.parse_args(["--dnn", "vgg16", "--dataset", "digits", "--max-epochs", "3",
                                        "--compression", "--compressor", "gtopk", "--density", "0.05"])
    assert vars(from_file) == {**vars(from_cli), "config": str(config)}
    (tmp_path / "bad.json").write_text(json.dumps({"dnn": "vgg16", "epochs": 3}))
    with pytest.raises(SystemExit, match="unknown option 'epochs'"):
        cli.parse_args(["--config", str(tmp_path / "bad.json")])


@pytest.mark.parametrize("launch_with", ["self", "torchrun"])
def test_real_launches(tmp_path, launch_with):
    """As a plain command with --nworkers 2 (it spawns its own gloo workers), and under
    torchrun with 2 processes."""
    options = ["-m", "experiments.main_trainer", "--dnn", "fashioncnn", "--dataset", "digits",
               "--compression", "--compressor", "spardl", "--batch-size", "16", "--max-steps", "4",
               "--out", str(tmp_path), "--timeout", "60"]
    if launch_with == "self":
        cmd = [sys.executable, *options, "--nworkers", "2"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               *options]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
    assert (tmp_path / "epochs.csv").exists()


def test_density_warmup_follows_dgcs_schedule_within_an_epoch(tmp_path):
    """0.75 epochs of warm-up at density 0.01 become the library's warm-up over 6 of the 8
    steps: 0.25, 0.0625, 0.015625 for a quarter epoch each, then 0.01; the densities logged
    follow, and the bytes sent are more than without the warm-up."""
    options = ["--compression", "--compressor", "spardl", "--max-steps", "8", "--density", "0.01",
               "--min-entries", "0"]
    args = _args(tmp_path / "warm", *options, "--density-warmup", "0.75",
                 "--density-warmup-start", "0.25")
    assert cli.library_warmup(args, 8) == {"density_warmup_steps": 6,
                                                     "density_warmup_start": 0.25}
    schedule = [warmup_density(s, 6, 0.25, 0.01) for s in range(8)]
    assert schedule == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01]
    across = _args(tmp_path, "--density", "0.01", "--compression", "--density-warmup", "3",
                   "--density-warmup-start", "0.25")
    assert cli.library_warmup(across, 10)["density_warmup_steps"] == 30
    warm = run_local(2, lambda t: main_trainer.train(args, t))[0]
    records = [json.loads(line) for line in (tmp_path / "warm" / "log.jsonl").read_text().splitlines()]
    assert [r["density"] for r in records if r["kind"] == "step"] == schedule
    cold = run_local(2, lambda t: main_trainer.train(
        _args(tmp_path / "cold", *options, "--density-warmup", "0"), t))[0]
    assert warm["bytes_sent_per_step"] > 2 * cold["bytes_sent_per_step"]


def test_density_warmup_start_sets_the_first_stage(tmp_path, capsys):
    """The default warm-up, cheaper on slow links than DGC's: 0.0625 then 0.015625 over a
    quarter epoch each."""
    args = _args(tmp_path, "--compression", "--density", "0.01", "--density-warmup", "0.5")
    assert args.density_warmup_start == cli.DEFAULT_WARMUP_START == 0.0625
    assert cli.library_warmup(args, 8) == {"density_warmup_steps": 4,
                                                     "density_warmup_start": 0.0625}
    assert [warmup_density(s, 4, 0.0625, 0.01) for s in range(6)] == \
        [0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01]
    assert warmup_density(0, 8, 0.04, 0.05) == 0.05  # nothing above --density: no stage
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            _args(tmp_path, "--density-warmup-start", bad)
        assert "--density-warmup-start must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--compression", "--compressor", "qsgd"]])
def test_density_warmup_needs_a_compressor_with_a_density(tmp_path, extra, capsys):
    with pytest.raises(SystemExit):
        _args(tmp_path, "--density-warmup", "1", *extra)
    err = capsys.readouterr().err
    assert "--density-warmup needs --compression with one of topka, gaussiank, topkdsa, gtopk, " \
           "oktopk, spardl, topk, randomk, dgc" in err


@pytest.mark.parametrize("baseline", cli.BASELINES)
def test_torchs_own_ddp_hooks_train_identical_replicas(tmp_path, baseline):
    """PyTorch's DDP, its fp16 hook, its PowerSGD hook and post-local SGD (as they ship) through
    the CLI on 2 real gloo workers; PowerSGD starts compressing after 2 steps and then sends
    less; post-local SGD all-reduces gradients for 3 steps, then averages the models at steps
    3 and 5 (period 2) and trains locally at step 4: the last step averaged, so the replicas
    end identical, and the last 3 steps sent 2 of 3 dense steps' bytes. DiLoCo (H = 3) takes
    its outer steps after steps 3 and 6: one dense all-reduce in 3 steps, identical replicas."""
    cmd = [sys.executable, "-m", "experiments.main_trainer", "--dnn", "fashioncnn",
           "--dataset", "digits", "--compression", "--compressor", baseline, "--batch-size", "16",
           "--max-steps", "6", "--powersgd-rank", "2", "--powersgd-start-iter", "2",
           "--postlocal-start-iter", "3", "--postlocal-period", "2", "--diloco-period", "3",
           "--eval-every", "3", "--nworkers", "2", "--out", str(tmp_path), "--timeout", "60"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
    summary = finals[0]["summary"]
    dense = summary["dense_bytes_per_step"]
    evals = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    late = evals[-1]["bytes_sent_per_step"]
    expected = {"torch_ddp": dense, "torch_fp16": dense / 2, "torch_postlocal": 2 * dense / 3,
                "diloco": dense / 3}
    if baseline in expected:
        assert late == expected[baseline]
    else:
        assert evals[0]["bytes_sent_per_step"] > late > 0 and late < 0.5 * dense
    assert not list(tmp_path.glob("ckpt-rank*.pt")), "torch's hook state is not checkpointed"


def _cli(out, *extra) -> None:
    cmd = [sys.executable, "-m", "experiments.main_trainer", "--dnn", "fashioncnn",
           "--dataset", "digits", "--compression", "--compressor", "spardl", "--batch-size", "16",
           "--max-steps", "6", "--density", "0.05", "--nworkers", "2", "--out", str(out),
           "--timeout", "60", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _final_params(out) -> list[torch.Tensor]:
    return [torch.load(out / f"final-rank{r}.pt", weights_only=True)["params"] for r in range(2)]


def test_the_ddp_hook_path_trains_like_the_optimizer_and_resumes(tmp_path):
    """--ddp-hook on 2 real gloo workers: with one bucket, bit for bit the model that
    DistributedOptimizer trains, and a resume from the checkpoint of step 4 ends where the
    uninterrupted run ended; with several small DDP buckets (communicated while backward goes
    on), identical replicas, and the resumed run picks up the saved state. Its result differs
    from the uninterrupted run's: DDP's first step after it is built fuses every gradient into
    one bucket and later steps into the rebuilt ones, so the resumed step 5 selects over
    other buckets."""
    _cli(tmp_path / "optimizer")
    hook = tmp_path / "hook"
    _cli(hook, "--ddp-hook", "--checkpoint-every", "2")
    optimizer, full = _final_params(tmp_path / "optimizer"), _final_params(hook)
    assert torch.equal(full[0], full[1]) and torch.equal(full[0], optimizer[0])
    for r in range(2):
        (hook / f"ckpt-rank{r}.pt").unlink()
    _cli(hook, "--ddp-hook", "--checkpoint-every", "2", "--resume")
    assert all(torch.equal(a, b) for a, b in zip(_final_params(hook), full))
    buckets = tmp_path / "buckets"
    _cli(buckets, "--ddp-hook", "--bucket-cap-mb", "0.01", "--checkpoint-every", "2")
    assert torch.equal(*_final_params(buckets))
    saved = torch.load(buckets / "ckpt-rank0.pt.prev", weights_only=True)["compression"]
    assert saved["steps"] == 4 and saved["grace"]["memory"]
    for r in range(2):
        (buckets / f"ckpt-rank{r}.pt").unlink()
    _cli(buckets, "--ddp-hook", "--bucket-cap-mb", "0.01", "--checkpoint-every", "2", "--resume")
    assert torch.equal(*_final_params(buckets))
    assert torch.load(buckets / "ckpt-rank0.pt", weights_only=True)["compression"]["steps"] == 6


def test_the_sharded_modes_train_as_plain_ddp_does_at_density_one(tmp_path):
    """--fsdp hybrid (2 nodes of 2) and flat on 4 real gloo workers, SparDL at density 1 and no
    warm-up: every step is a dense average, so the runs log plain SparDL's training losses
    (within float rounding: the reductions' order differs) and its test accuracy, which rank 0
    scores on the weights gathered from the shards; and the two modes' own communicators send
    what they should (hybrid: only across the nodes, so less than plain SparDL)."""
    options = ["--nworkers", "4", "--density", "1.0", "--density-warmup", "0", "--max-steps", "4"]
    _cli(tmp_path / "plain", *options)
    _cli(tmp_path / "hybrid", *options, "--fsdp", "hybrid")
    _cli(tmp_path / "flat", *options, "--fsdp", "flat")
    logs = {name: read_log(tmp_path / name) for name in ("plain", "hybrid", "flat")}
    for name in ("hybrid", "flat"):
        assert [s["loss"] for s in logs[name]["step"]] == pytest.approx(
            [s["loss"] for s in logs["plain"]["step"]], rel=1e-4)
        assert logs[name]["epoch"][-1]["test_accuracy"] == pytest.approx(
            logs["plain"]["epoch"][-1]["test_accuracy"], abs=0.02)
        assert 0 < logs[name]["epoch"][-1]["bytes_sent_per_step"] \
            < logs["plain"]["epoch"][-1]["bytes_sent_per_step"]
    finals = [torch.load(tmp_path / "hybrid" / f"final-rank{r}.pt", weights_only=True)["params"]
              for r in range(4)]
    assert torch.equal(finals[0], finals[2]) and torch.equal(finals[1], finals[3])  # replicas


def test_the_sharded_modes_refuse_what_they_cannot_do(tmp_path, capsys):
    for options, error in [
            (["--compression", "--compressor", "torch_powersgd", "--fsdp", "hybrid"],
             "this library's algorithms, not DDP"),
            (["--compression", "--fsdp", "hybrid", "--resume"], "keeps no checkpoints"),
            (["--compression", "--nworkers", "4", "--fsdp", "hybrid", "--fsdp-nodes", "3"],
             "--fsdp-nodes >= 2 dividing --nworkers"),
            (["--compression", "--compressor", "topka", "--fsdp", "flat"],
             "needs --compression --compressor spardl"),
            (["--compression", "--nworkers", "2", "--fsdp", "hybrid", "--bucket-cap-mb", "1"],
             "FSDP's units are its buckets")]:
        assert error in _refused(tmp_path, capsys, *options)


def test_grace_benchmarks_config_string_trains(tmp_path):
    """GRACE-benchmarks' --grace_config, single quotes and all, on 2 workers."""
    config = ("{'compressor': 'topk', 'memory': 'residual', 'communicator': 'allgather', "
              "'compress_ratio': 0.05}")
    args = _args(tmp_path, "--grace_config", config)
    assert cli.grace_params(args) == {"compressor": "topk", "memory": "residual",
                                               "communicator": "allgather",
                                               "compress_ratio": 0.05, "seed": 0}
    assert (args.compression, args.compressor, args.density) == (True, "topk", 0.05)
    run_local(2, lambda t: main_trainer.train(args, t))
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
    sparse = _args(tmp_path, "--grace-config", "{'communicator': 'spardl', 'compressor': 'topk', "
                   "'memory': 'global_residual'}")
    assert sparse.compressor == "spardl" and sparse.density_warmup == cli.DEFAULT_WARMUP_EPOCHS


@pytest.mark.parametrize("config,message", [
    ("{'compressor': 'topk'", "expected a dict of GRACE params"),
    ("['topk']", "expected a dict of GRACE params"),
    ("{'compressor': 'zip'}", "unknown compressor 'zip'; valid choices"),
])
def test_grace_config_errors_name_the_fix(tmp_path, capsys, config, message):
    with pytest.raises(SystemExit):
        _args(tmp_path, "--grace_config", config)
    assert message in capsys.readouterr().err


def test_bucket_options_refuse_what_cannot_work(tmp_path, capsys):
    for extra, message in (
            (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be > 0"),
            (["--compression", "--compressor", "torch_powersgd", "--bucket-cap-mb", "25"],
             "PowerSGD hook fails on gloo"),
            (["--compression", "--compressor", "torch_ddp", "--ddp-hook"], "is DDP already"),
            (["--compression", "--compressor", "torch_fp16", "--no-overlap"], "is DDP's own")):
        with pytest.raises(SystemExit):
            _args(tmp_path, *extra)
        assert message in capsys.readouterr().err


def _refused(tmp_path, capsys, *options) -> str:
    """The training CLI's error for `options` (it must refuse them)."""
    with pytest.raises(SystemExit):
        _args(tmp_path, *options)
    return capsys.readouterr().err


def test_baselines_refuse_what_they_cannot_do(tmp_path, capsys):
    for options, error in [
            (["torch_powersgd", "--resume"], "hook state is not checkpointed"),
            (["torch_fp16", "--momentum-correction", "0.9"], "torch's own DDP path"),
            (["torch_powersgd", "--wire", "compact"], "--min-entries belong to this library's"),
            (["torch_fp16", "--min-entries", "0"], "--min-entries belong to this library's"),
            (["torch_postlocal", "--postlocal-period", "1"], "--postlocal-period must be >= 2")]:
        assert error in _refused(tmp_path, capsys, "--compression", "--compressor", *options)
    args = _args(tmp_path, "--compression", "--compressor", "torch_ddp")
    with pytest.raises(SystemExit, match="use --nworkers >= 2"):
        main_trainer.start(args)


def test_the_wire_option_reaches_the_library_and_is_checked_there(tmp_path, capsys):
    args = _args(tmp_path, "--compression", "--compressor", "spardl", "--wire", "compact")
    assert cli.grace_params(args)["wire"] == "compact"
    assert "wire" not in cli.grace_params(_args(tmp_path, "--compression"))
    assert "'wire' is how the sparse all-reduces" in _refused(
        tmp_path, capsys, "--compression", "--compressor", "topk", "--wire", "compact")


def test_the_floor_option_reaches_the_library_and_is_checked_there(tmp_path, capsys):
    args = _args(tmp_path, "--compression", "--compressor", "spardl", "--min-entries", "0")
    assert cli.grace_params(args)["min_entries"] == 0
    assert "min_entries" not in cli.grace_params(_args(tmp_path, "--compression"))
    assert "set the density of the sparse all-reduces" in _refused(
        tmp_path, capsys, "--compression", "--compressor", "topk", "--min-entries", "100")
    assert "min_entries must be an int >= 0" in _refused(
        tmp_path, capsys, "--compression", "--compressor", "spardl", "--min-entries", "-1")


def test_momentum_correction_settings_are_checked_when_parsed(tmp_path, capsys):
    assert "momentum_correction is an option of memory" in _refused(
        tmp_path, capsys, "--compression", "--compressor", "topk", "--momentum-correction", "0.9")
    assert "momentum_correction must be a number in [0, 1)" in _refused(
        tmp_path, capsys, "--compression", "--compressor", "spardl", "--momentum-correction", "1.5")
    assert "which is off" in _refused(
        tmp_path, capsys, "--compression", "--compressor", "spardl", "--no-momentum-masking")
    assert "torch's own DDP path" in _refused(
        tmp_path, capsys, "--compression", "--compressor", "torch_fp16", "--no-momentum-masking")
    args = _args(tmp_path, "--compression", "--compressor", "spardl", "--momentum-correction",
                 "0.9", "--no-momentum-masking")
    assert cli.grace_params(args)["momentum_masking"] is False
    assert "momentum_masking" not in cli.grace_params(_args(tmp_path, "--compression"))


def test_auto_takes_dgcs_techniques_and_trains_with_them(tmp_path):
    """--compressor auto passes --momentum-correction, --no-momentum-masking and
    --local-clip-norm on to its memory (they were dropped without a word), and trains
    identical replicas with momentum correction."""
    args = _args(tmp_path, "--compression", "--compressor", "auto", "--momentum-correction",
                 "0.9", "--no-momentum-masking", "--local-clip-norm", "5", "--max-steps", "12")
    params = cli.grace_params(args)
    assert (params["momentum_correction"], params["momentum_masking"],
            params["local_clip_norm"]) == (0.9, False, 5.0)
    args = _args(tmp_path, "--compression", "--compressor", "auto", "--momentum-correction",
                 "0.9", "--max-steps", "12")
    run_local(2, lambda t: main_trainer.train(args, t))
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
    saved = torch.load(tmp_path / "ckpt-rank0.pt", weights_only=True)["compression"]

    def velocities(state):  # the memory's, wherever the sync nests it
        if not isinstance(state, dict):
            return []
        found = list(state["velocities"].values()) if "velocities" in state else []
        return found + [v for value in state.values() for v in velocities(value)]

    held = velocities(saved)
    assert held and all(float(v.abs().sum()) > 0 for v in held)


def test_auto_s_plans_are_kept_whole_in_the_run_s_log(tmp_path):
    """Each plan of --compressor auto goes into log.jsonl as a 'plan' record with what it
    predicted for every candidate (the step records carry the choice only); a second run in
    the same process writes its plans to its own log, not to the first's as well."""
    from spardl_grace.planner import DEFAULT_CANDIDATES
    from testbed.records import read_log
    for run in ("first", "second"):
        args = _args(tmp_path / run, "--compression", "--compressor", "auto", "--max-steps", "12")
        run_local(2, lambda t: main_trainer.train(args, t))
    for run in ("first", "second"):
        log = read_log(tmp_path / run)
        [plan] = log["plan"]
        assert plan["step"] == 10 and set(plan["predicted_step_s"]) == set(DEFAULT_CANDIDATES)
        assert plan["choice"] == DEFAULT_CANDIDATES[int(log["step"][-1]["auto_choice"])]
        assert plan["predicted_step_s"][plan["choice"]] == log["step"][-1]["auto_predicted_step_s"]


def test_time_budget_target_and_evaluations(tmp_path):
    """Evaluations every 2 steps; a budget of 0 s stops at the first one; a target of 0 is
    reached there; evaluation time is not training time."""
    args = _args(tmp_path, "--compression", "--compressor", "spardl", "--max-epochs", "2",
                 "--eval-every", "2", "--target-accuracy", "0", "--time-budget", "0")
    summaries = run_local(2, lambda t: main_trainer.train(args, t))
    same = ("test_accuracy", "time_to_target_s", "steps_to_target", "steps_run", "stopped_by_budget",
            "stopped_at_target")
    assert [{k: s[k] for k in same} for s in summaries] == [{k: summaries[0][k] for k in same}] * 2
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["start", "step", "step", "eval", "epoch", "run"]
    run = records[-1]
    assert run["stopped_by_budget"] and run["steps_run"] == 2 and run["steps_to_target"] == 2
    assert not run["stopped_at_target"]  # reached, but --stop-at-target was not asked for
    assert 0 < run["time_to_target_s"] == records[3]["train_s"] <= records[4]["train_s"]
    assert records[3]["eval/top-1"] == records[4]["test_accuracy"] == run["test_accuracy"]


def test_stop_at_target_is_not_reported_as_the_budget(tmp_path):
    """A run stopped by --stop-at-target says so, and not that its time budget ran out."""
    args = _args(tmp_path, "--compression", "--compressor", "spardl", "--max-epochs", "2",
                 "--eval-every", "2", "--target-accuracy", "0", "--stop-at-target")
    summaries = run_local(2, lambda t: main_trainer.train(args, t))
    assert [(s["stopped_at_target"], s["stopped_by_budget"], s["steps_run"]) for s in summaries] \
        == [(True, False, 2)] * 2


def test_bandwidth_needs_root_or_says_why(tmp_path):
    from testbed import netem
    args = _args(tmp_path, "--bandwidth", "100mbit", "--nworkers", "2")
    if netem.available() is None:
        pytest.skip("namespaces can be made here: test_bandwidth_runs_workers_in_namespaces runs")
    with pytest.raises(SystemExit, match="not possible here"):
        main_trainer.start(args)


def test_bandwidth_runs_workers_in_namespaces(tmp_path):
    """--bandwidth 100mbit: 2 workers in their own namespaces, joined over the shaped link;
    the bytes that crossed it are logged beside the payload's."""
    require_netns()
    cmd = [sys.executable, "-m", "experiments.main_trainer", "--dnn", "fashioncnn",
           "--dataset", "digits", "--compression", "--compressor", "spardl", "--batch-size", "16",
           "--max-steps", "4", "--bandwidth", "100mbit", "--nworkers", "2", "--out", str(tmp_path),
           "--timeout", "60"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = [torch.load(tmp_path / f"final-rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(finals[0]["params"], finals[1]["params"])
    summary = finals[0]["summary"]
    assert summary["wire_bytes_per_step_run"] > summary["bytes_sent_per_step_run"] > 0
    with pytest.raises(SystemExit):
        cli.parse_args(["--bandwidth", "fast"])


def wandb_history_keys(run_file) -> set[str]:
    """Every history key in an offline W&B run file: a 7-byte header, then leveldb-style log
    records (4-byte checksum, 2-byte length, 1-byte type; FULL, FIRST, MIDDLE, LAST) in 32 KiB
    blocks, each record a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    keys, pos, pending = set(), 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                keys |= {item.key or "/".join(item.nested_key) for item in record.history.item}
    return keys


def test_wandb_and_tensorboard_log_every_key_offline(tmp_path, monkeypatch):
    """--log wandb,tensorboard without an API key: W&B runs offline, and its run file holds
    GRACE-benchmarks' names (loss, lr, epoch, eval/top-1, throughput), the bytes and the time
    split."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = _args(tmp_path, "--compression", "--compressor", "spardl", "--log", "csv,wandb,tensorboard",
                 "--eval-every", "2")
    run_local(2, lambda t: main_trainer.train(args, t))
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "W&B must run offline without a key"
    keys = wandb_history_keys(runs[0])
    assert {"loss", "lr", "epoch", "eval/top-1", "eval/loss", "throughput", "bytes_sent_per_step",
            "compression_ratio", "selection_s", "comm_s", "coding_s", "sync_s",
            "train_s"} <= keys
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_logger_rank_0_cannot_start_stops_every_rank_saying_why(tmp_path, monkeypatch):
    """W&B online without an API key: rank 0's wandb.init raised, and the other ranks said, a
    minute later, that a peer failed at its first synchronisation, nothing of W&B."""
    def refuse(*args, **kwargs):
        raise RuntimeError("No API key configured")  # what wandb.init raises online, keyless

    wandb = pytest.importorskip("wandb")
    monkeypatch.setattr(wandb, "init", refuse)
    args = _args(tmp_path, "--log", "csv,wandb")
    results = run_local(2, lambda t: _exit_of(lambda: main_trainer.train(args, t)))
    for said in results:
        assert "rank 0 could not start its logs: RuntimeError: No API key configured" in said


def _exit_of(fn) -> str:
    try:
        fn()
    except SystemExit as exc:
        return str(exc)
    return ""


def test_sparse_allreduces_warm_their_density_up_by_default(tmp_path):
    """The recorded ablation chose DGC's density warm-up over a quarter epoch for the sparse
    all-reduces; GRACE's compressors, dense and an explicit 0 keep the density fixed."""
    assert _args(tmp_path, "--compression", "--compressor", "spardl").density_warmup == 0.25
    assert _args(tmp_path, "--compression", "--compressor", "oktopk").density_warmup == 0.25
    assert _args(tmp_path, "--compression", "--compressor", "topk").density_warmup == 0
    assert _args(tmp_path).density_warmup == 0
    assert _args(tmp_path, "--compression", "--density-warmup", "0").density_warmup == 0


def test_ablation_configs_name_the_training_cli_options():
    from testbed import configs
    assert configs.config_options("dense") == []
    assert configs.config_options("spardl@0.01+mcnomask")[-3:] == [
        "--momentum-correction", "0.9", "--no-momentum-masking"]
    assert configs.config_options("dense+lrwarmup") == ["--warmup-epochs", "0.25"]
    assert configs.config_options("spardl+warmup")[-2:] == ["--density-warmup-start", "0.25"]
    assert configs.config_options("spardl+warmup16") == [
        "--compression", "--compressor", "spardl", "--min-entries", "0", "--density-warmup",
        "0.25", "--density-warmup-start", "0.0625"]
    assert configs.config_options("spardl") == [
        "--compression", "--compressor", "spardl", "--density-warmup", "0", "--min-entries", "0"]
    assert configs.config_options("spardl@0.001+floor")[-2:] == ["--min-entries", "2048"]
    assert "--min-entries" not in configs.config_options("dense")
    # auto as its users get it: the library's floor, no density of the harness's
    assert configs.config_options("auto") == [
        "--compression", "--compressor", "auto", "--density-warmup", "0"]
    assert configs.config_options("auto+floor")[-2:] == ["--min-entries", "2048"]
    with pytest.raises(ValueError, match="auto chooses its own density"):
        configs.config_options("auto@0.01")
    with pytest.raises(ValueError, match="only the learning-rate techniques: lrwarmup"):
        configs.config_options("dense+warmup")
    with pytest.raises(ValueError, match="unknown technique 'nope'"):
        configs.config_options("spardl+nope")


def test_ablation_configs_for_the_accuracy_per_byte_front():
    """Densities per config, the wire, and PyTorch's own answers starting at 10% of the run's
    steps (post-local SGD up to a period later, so that its last step averages)."""
    from testbed import configs
    assert configs.config_options("spardl@0.003+warmup2ep+compact") == [
        "--density", "0.003", "--compression", "--compressor", "spardl", "--min-entries", "0",
        "--density-warmup", "2", "--density-warmup-start", "0.25", "--wire", "compact"]
    assert configs.config_options("topka@0.003+exact")[-2:] == ["--wire", "exact"]
    # The fixes tried on the front: PowerSGD's dense start as a warm-up, and per-layer selection
    assert configs.config_options("spardl@0.1+warmupdense")[-4:] == [
        "--density-warmup", "0.8", "--density-warmup-start", "1"]
    from spardl_grace.optimizer import plan_buckets
    layer = configs.config_options("spardl@0.1+layer+floor")
    cap = float(layer[layer.index("--bucket-cap-mb") + 1])
    named = list(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Conv2d(2, 2, 1)).named_parameters())
    assert [[n for n, _ in b] for b in plan_buckets(named, cap)] == [[n] for n, _ in reversed(named)]
    assert configs.config_options("powersgd4", 3744) == [
        "--compression", "--compressor", "torch_powersgd", "--density-warmup", "0",
        "--powersgd-rank", "4", "--powersgd-start-iter", "374"]
    assert configs.config_options("fp16", 3744) == [
        "--compression", "--compressor", "torch_fp16", "--density-warmup", "0"]
    for period in (4, 16, 64):
        options = configs.config_options(f"postlocal{period}", 3744)
        start = int(options[-1])
        assert options[-4:-1] == ["--postlocal-period", str(period), "--postlocal-start-iter"]
        assert 374 <= start < 374 + period and (3743 - start) % period == 0
    # the transformer front's: AdamW frozen after PowerSGD's dense start, and DiLoCo
    assert configs.config_options("spardl@0.01+adamfreeze", 3744)[-2:] == [
        "--adam-freeze-step", "374"]
    assert configs.config_options("spardl@0.01+adamfreeze25", 1000)[-2:] == [
        "--adam-freeze-step", "250"]
    assert configs.config_options("spardl@0.01+update", 1000)[-2:] == ["--exchange", "update"]
    assert configs.config_options("spardl@0.25+update+every5", 1000)[-4:] == [
        "--exchange", "update", "--exchange-period", "5"]
    assert configs.config_options("spardl@0.4+update+every4+coded", 1000)[-10:] == [
        "--exchange", "update", "--exchange-period", "4",
        "--deepreduce", "both", "--index", "delta", "--value", "qsgd"]
    assert configs.config_options("diloco20", 3744) == [
        "--compression", "--compressor", "diloco", "--density-warmup", "0",
        "--diloco-period", "20"]
    for bad, match in [("powersgd", "write powersgdN"), ("powersgd0", "a whole number"),
                       ("fp162", "write fp16"), ("spardl@1.5", "must be a number in"),
                       ("dense@0.1", "only the learning-rate"), ("postlocal4+mc", "PyTorch's own"),
                       ("spardl@0.01+adamfreeze100", "0 < PCT < 100"),
                       ("spardl@0.01+adamfreezex", "0 < PCT < 100"),
                       ("spardl@0.4+update+every0", "write everyN"),
                       ("spardl@0.4+update+everyx", "write everyN")]:
        with pytest.raises(ValueError, match=match):
            configs.config_options(bad, 3744)


def test_ablation_runs_in_parallel_give_what_sequential_runs_give(tmp_path):
    """--parallel only overlaps whole runs (each its own processes): the same seeds give the
    same results as one run at a time, and every config lands in the summary, also after a
    later command in the same folder."""
    from experiments import ablation
    common = ["--dnn", "fashioncnn", "--configs", "dense,spardl+warmup16", "--seeds", "0",
              "--workers", "2", "--train-samples", "512", "--test-samples", "200",
              "--extra", "--max-steps 3 --device cpu"]
    together = ablation.main([*common, "--parallel", "2", "--out", str(tmp_path / "together")])
    alone = ablation.main([*common, "--out", str(tmp_path / "alone")])
    assert [r["config"] for r in together] == ["dense", "spardl+warmup16"]
    for a, b in zip(together, alone):
        assert a["test_accuracy"] == b["test_accuracy"] and a["train_loss"] == b["train_loss"]
    assert together[1]["bytes_run"]["mean"] < together[0]["bytes_run"]["mean"]
    # A later command in the same folder (one config, already finished: not run again) keeps
    # every finished run in the folder's summary, not only its own.
    again = ablation.main([*common[:3], "dense", *common[4:], "--out", str(tmp_path / "together")])
    assert again == together


def test_an_ablation_run_cut_off_resumes_and_reports_the_whole_run(tmp_path):
    """A run with an epoch's checkpoint and no result continues from it (--resume): it ends
    where an uninterrupted run ends, and its bytes per step and steps are the whole run's
    (the density warm-up's first epoch sends more than the second), not the resumed part's."""
    from experiments import ablation
    common = ["--dnn", "fashioncnn", "--configs", "spardl+warmup1", "--seeds", "0",
              "--workers", "2", "--train-samples", "512", "--test-samples", "200",
              "--extra", "--max-steps 3 --device cpu"]
    whole = ablation.main([*common, "--max-epochs", "2", "--out", str(tmp_path / "whole")])
    ablation.main([*common, "--max-epochs", "1", "--out", str(tmp_path / "cut")])
    # cut off after its first epoch: the logs and checkpoint as they were, no run.json, unpacked
    cut = tmp_path / "cut" / "spardl+warmup1-seed0"
    subprocess.run(["tar", "xJf", f"{cut}.tar.xz", "-C", str(cut.parent)], check=True)
    Path(f"{cut}.tar.xz").unlink()
    (cut / "run.json").unlink()
    resumed = ablation.main([*common, "--max-epochs", "2", "--out", str(tmp_path / "cut")])
    for key in ("test_accuracy", "train_loss"):
        assert resumed[0][key] == whole[0][key]
    # The resumed process agrees on every gradient's settings once more (a few bytes).
    assert resumed[0]["bytes_run"]["mean"] == pytest.approx(whole[0]["bytes_run"]["mean"], rel=1e-3)
    runs = [json.loads(open_run(tmp_path / d / "spardl+warmup1-seed0").read_text("run.json"))
            for d in ("whole", "cut")]
    assert runs[0]["steps"] == runs[1]["steps"] == 6
    log = read_log(tmp_path / "cut" / "spardl+warmup1-seed0")
    assert [s["step"] for s in log["step"]] == list(range(6)), "epoch 0 must not run again"
    assert log["epoch"][0]["bytes_sent_per_step"] > log["epoch"][1]["bytes_sent_per_step"]


def test_sample_limits_keep_the_class_mix_of_a_set_stored_by_class():
    """The tweets are stored by class: their first 2,000 test tweets are all negative, so a
    prefix would measure how often a model says 'negative'. Evenly spaced subsets keep the mix."""
    from testbed.text import load_tweets
    inputs, labels = load_tweets("test")
    assert torch.bincount(labels[:2000], minlength=3).tolist() == [2000, 0, 0]
    sub_inputs, sub_labels = main_trainer.spread_subset(inputs, labels, 2000)
    share = torch.bincount(sub_labels, minlength=3) / 2000
    assert torch.allclose(share, torch.bincount(labels, minlength=3) / len(labels), atol=0.01)
    assert torch.equal(sub_inputs[1], inputs[len(labels) // 2000])
    assert main_trainer.spread_subset(inputs, labels, None)[1] is labels
    assert main_trainer.spread_subset(inputs, labels, 10 ** 9)[1] is labels


@pytest.mark.parametrize("bad, says", [
    (["--max-epochs", "0"], "--max-epochs must be >= 1"),  # KeyError: 'step' at the end
    (["--lr", "-0.1"], "--lr must be > 0"),  # torch's error on every rank, after the start
    (["--train-samples", "0"], "--train-samples >= 1"),  # 'upper bound and lower bound ...'
    (["--compression", "--compressor", "gtopk", "--teams", "2"],  # ignored: gTop-k ran alone
     "--teams sets SparDL's d: it needs --compression --compressor spardl, got gtopk"),
])
def test_bad_numbers_are_usage_errors_before_any_worker_starts(tmp_path, capsys, bad, says):
    with pytest.raises(SystemExit):
        _args(tmp_path, *bad)
    assert says in capsys.readouterr().err


def test_deepreduce_without_compression_names_dense():
    """It named the default --compressor (spardl), which a run without --compression never
    uses."""
    with pytest.raises(SystemExit, match="dense \\(no --compression\\) sends none"):
        cli.parse_args(["--deepreduce", "index"])
