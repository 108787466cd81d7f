"""The SparDL training CLI: train a model on a data set with any algorithm of the project.

    python -m experiments.main_trainer --dnn resnet20 --dataset fashion-mnist --nworkers 4 \\
        --compression --compressor spardl --density 0.01 --max-epochs 5

Its arguments and what they mean are experiments.cli's (`--help` prints them); this module
starts the workers (itself, or under torchrun, mpirun or horovodrun) and runs the training loop,
with the synchronisation paths of experiments.syncs, evaluation from experiments.evaluation and
records from experiments.run_log.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from experiments import recipe
from experiments.cli import is_baseline, library_warms_up, parse_args
from experiments.evaluation import evaluate, flat_outputs
from experiments.run_log import Logger, new_run_id
from experiments.syncs import build_sync
from spardl_grace import launch
from spardl_grace.checkpoint import load_agreed_checkpoint, save_checkpoint
from spardl_grace.warmup import warmup_density
from testbed.load import LoadBurst
from testbed.netem import interface_tx_bytes, reshape_own_link

# The sparse all-reduces' own split of a sync (seconds); GRACE's loop reports none of them.
TIME_SPLIT = ("selection_s", "comm_s", "coding_s")
_INIT_LOCK = threading.Lock()


# --------------------------------------------------------------------------- launching
def train_device(device: str, rank: int) -> torch.device:
    """This rank's device: GPU (local rank mod the GPUs here) under --device cuda."""
    if device != "cuda":
        return torch.device("cpu")
    index = launch.local_rank(default=rank) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    train_device(args.device, rank)
    launch.start_torch_distributed(launch.torch_backend(args.device, world), args.timeout,
                                   f"tcp://127.0.0.1:{port}", rank, world)
    from spardl_grace.transport.torch_dist import TorchDistTransport, destroy_and_exit
    train(args, TorchDistTransport(timeout=args.timeout))
    destroy_and_exit()


def _exit_through_python_on_sigterm() -> None:
    """For the process that started the workers itself: terminated, it exits through Python,
    so that its with-blocks remove the emulated network's namespaces and multiprocessing ends
    the spawned workers. Never in a worker: its main thread may sit in a backend's wait, where
    a Python handler runs only once the wait ends, and a launcher's SIGTERM must stop it now."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def launch_on_emulated_network(args: argparse.Namespace) -> None:
    """--nworkers processes, each in its own network namespace behind a link shaped to
    --bandwidth, joining over env:// (rank 0's address); rank 0's output is shown."""
    from testbed.netem import EmulatedNetwork, available, run_all
    why = available()
    if why:
        raise SystemExit(f"--bandwidth {args.bandwidth} emulates the network with namespaces, "
                         f"which is not possible here: {why}. Run without --bandwidth (loopback) "
                         "or as root with iproute2 installed")
    out = Path(args.out)
    config = out / "worker-config.json"
    options = {k: v for k, v in vars(args).items() if k not in ("config", "bandwidth")}
    config.write_text(json.dumps(options))
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    worker = [sys.executable, "-m", "experiments.main_trainer", "--config", str(config.resolve())]
    port = launch.free_port()
    _exit_through_python_on_sigterm()
    with EmulatedNetwork(args.nworkers, args.bandwidth) as net:
        run_all([net.command(r, worker) for r in range(args.nworkers)],
                [net.rank_env(r, port, env) for r in range(args.nworkers)], root, stream=0)


def start(args: argparse.Namespace) -> None:
    """Join the launcher's ranks, or launch --nworkers local ones."""
    kind = launch.detect_launcher()
    if args.bandwidth is not None:
        if kind != "none" or args.nworkers < 2:
            raise SystemExit("--bandwidth launches --nworkers (>= 2) workers itself on an emulated "
                             f"network; started by {kind} with --nworkers {args.nworkers}, shape "
                             "your launcher's network instead")
        launch_on_emulated_network(args)
        return
    if kind == "none" and args.nworkers == 1 and is_baseline(args):
        raise SystemExit(f"{args.compressor} is DistributedDataParallel: use --nworkers >= 2 or "
                         "a launcher (torchrun)")
    if kind == "none" and args.nworkers > 1:
        import torch.multiprocessing as mp
        _exit_through_python_on_sigterm()
        mp.spawn(_spawned, args=(args.nworkers, launch.free_port(), args), nprocs=args.nworkers)
        return
    if kind == "none":
        from spardl_grace.transport import run_local
        run_local(1, lambda t: train(args, t))
        return
    backend = "gloo"
    if kind == "torchrun":
        train_device(args.device, int(os.environ["RANK"]))
        world = int(os.environ["WORLD_SIZE"])
        backend = launch.torch_backend(args.device, launch.local_world_size(world))
    train(args, launch.join(args.timeout, kind, backend))
    if kind == "torchrun":
        from spardl_grace.transport.torch_dist import destroy_and_exit
        destroy_and_exit()


class Clock:
    """Training seconds: running while training, stopped during evaluation."""

    def __init__(self) -> None:
        self.total = 0.0
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> float:
        if self._since is not None:
            self.total += time.perf_counter() - self._since
            self._since = None
        return self.total


def spread_subset(inputs: torch.Tensor, labels: torch.Tensor, count: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` samples evenly spaced over the whole set (all of them when count is None or
    larger): a data set stored by class (the tweets are) keeps its class mixture, where its
    first `count` samples would all be of one class."""
    if count is None or count >= len(labels):
        return inputs, labels
    chosen = torch.arange(count) * len(labels) // count
    return inputs[chosen], labels[chosen]


def train(args: argparse.Namespace, transport) -> dict[str, Any]:
    """Train on this rank; returns the final summary (identical metrics on every rank)."""
    if args.nworkers not in (1, transport.size) and transport.rank == 0:
        logging.getLogger(__name__).warning(
            "--nworkers %d launches workers from a plain command; this run has the "
            "launcher's %d ranks", args.nworkers, transport.size)
    return Trainer(args, transport).run()


class Trainer:
    """One rank's run of the training CLI: the data, the model and its synchronisation path,
    the learning-rate schedule, the checkpoint it resumes from, and the records (rank 0's log,
    the clock that excludes evaluation, the bytes sent)."""

    def __init__(self, args: argparse.Namespace, transport):
        from spardl_grace.transport.counting import ring_allreduce_bytes
        self.args, self.transport = args, transport
        self.rank, self.world = transport.rank, transport.size
        self._load_data()
        self._build_model()
        self.dense_bytes = ring_allreduce_bytes(4 * self.n_params, self.world)  # fp32, dense
        self.out = Path(args.out)
        self.checkpoint = self.out / f"ckpt-rank{self.rank}.pt"
        self.first_step, self.resumed, self.run_id = self._resume()
        self.logger = self._start_logger()
        # Each start of the run, fresh or resumed, is on record: a launcher's restarts show.
        self.logger.log({"kind": "start", "step": self.first_step,
                         "resumed": self.resumed is not None}, self.first_step)
        if self.rank == 0 and args.compression and args.compressor == "auto":
            _record_plans(self.logger)
        self.progress = _progress(self.rank, args.max_epochs * self.steps_per_epoch)
        # One machine's cores: rank 0 alone starts the other work.
        self.load = LoadBurst(*args.load_burst) if args.load_burst and self.rank == 0 else None
        self.clock = Clock()
        self._tally: dict[str, Any] | None = None  # the epoch's so far (checkpointed with it)
        self.totals = {"time_to_target_s": None, "steps_to_target": None, "steps": 0,
                       "stopped": False, "stopped_by_budget": False, "stopped_at_target": False,
                       "last_eval": None, "bytes_at_start": self.sync.bytes_sent,
                       "wire_at_start": interface_tx_bytes()}
        # The bytes since the last evaluation: a resumed process counts from its first step.
        self.window = {"step": self.first_step, "bytes": self.sync.bytes_sent,
                       "wire": interface_tx_bytes()}
        # The last finished epoch's summary: a run resumed after its last step (killed while
        # it was ending) has no epoch left to train and reports the one its checkpoint holds.
        self.summary: dict[str, Any] = \
            dict(self.resumed.get("summary", {})) if self.resumed is not None else {}

    def _start_logger(self) -> Logger:
        """Rank 0's logs (W&B's run among them), or SystemExit on every rank saying why rank 0
        could not start them (the others took rank 0's exit for a peer's failure before,
        a minute later, and said nothing of W&B)."""
        from spardl_grace.broadcast import broadcast_object

        logger, failure = None, None
        try:
            logger = Logger(self.args, self.rank, {**vars(self.args), "grace": self.params,
                                                   "workers": self.world},
                            append=self.resumed is not None)
        except (Exception, SystemExit) as exc:  # W&B raises its own errors, and SystemExit
            failure = f"{type(exc).__name__}: {exc}"
        own, failure = failure, broadcast_object(failure, 0, self.transport, "trainer.logger")
        if failure is not None:
            raise SystemExit(f"--log {self.args.log}: rank 0 could not start its logs: {failure}")
        if logger is None:
            raise SystemExit(f"--log {self.args.log}: rank {self.rank} could not start: {own}")
        return logger

    def _load_data(self) -> None:
        from testbed.datasets import load_dataset

        args = self.args
        tokenizer = "wordpiece" if args.dnn == "bert" else "words"
        images, labels = load_dataset(args.dataset, "train", args.data_dir, tokenizer)
        self.images, self.labels = spread_subset(images, labels, args.train_samples)
        self.test_images = self.test_labels = None
        if self.rank == 0:  # the replicas are identical: rank 0 evaluates for all
            test_images, test_labels = load_dataset(args.dataset, "test", args.data_dir, tokenizer)
            self.test_images, self.test_labels = spread_subset(test_images, test_labels,
                                                               args.test_samples)

    def _build_model(self) -> None:
        import spardl_grace
        from testbed.datasets import DATASETS
        from testbed.models import build_model

        args = self.args
        _, channels, classes = DATASETS[args.dataset]
        self.device = train_device(args.device, self.rank)
        with _INIT_LOCK:  # local workers are threads sharing torch's global generator
            torch.manual_seed(args.seed)
            self.model = build_model(args.dnn, channels, classes).to(self.device)
        spardl_grace.broadcast_parameters(self.model.state_dict(), 0, self.transport)
        self.shard = torch.arange(self.rank, len(self.images), self.world)
        self.steps_per_epoch = len(self.shard) // args.batch_size
        if args.max_steps is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, args.max_steps)
        self.sync, self.params = build_sync(args, self.model, self.transport, self.steps_per_epoch)
        # GRACE's compressors warm up through set_density, on the library's schedule.
        self.warmup = (round(args.density_warmup * self.steps_per_epoch),
                       args.density_warmup_start, args.density)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.sync.optimizer,
            lambda s: recipe.lr_factor(s, self.steps_per_epoch, args, self.world))
        self.n_params = sum(p.numel() for p in self.model.parameters())

    def _resume(self) -> tuple[int, dict[str, Any] | None, str]:
        """(first step, the checkpoint resumed from or None, the run's id), with the state
        restored from the newest checkpoint every rank holds when --resume asks for it."""
        args = self.args
        resumed = None
        if args.resume != "never":
            try:
                resumed = load_agreed_checkpoint(self.transport, self.checkpoint)
            except ValueError as exc:  # raised on every rank alike
                raise SystemExit(f"--resume {args.resume}: {exc}") from None
            if resumed is None and args.resume == "always":
                raise SystemExit(f"--resume: no rank holds a checkpoint in {self.out} "
                                 "(--resume auto starts fresh then)")
        if resumed is None:
            return 0, None, new_run_id(self.transport)
        saved = resumed[0]
        now = self._settings()
        changed = {k: (v, now.get(k)) for k, v in saved.get("settings", {}).items()
                   if now.get(k) != v}
        if changed:  # every rank loaded the same step's checkpoint: every rank exits
            said = "; ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in changed.items())
            raise SystemExit(
                f"--resume: the checkpoint in {self.out} was written with other settings ({said}). "
                "A resumed run continues its own algorithm and learning-rate schedule (the saved "
                "schedule would win over a new --lr in silence): keep the settings, or start a "
                "new run in another --out (or with --resume never)")
        self.model.load_state_dict(saved["model"])
        self.sync.optimizer.load_state_dict(saved["optimizer"])
        self.sync.load_compression_state(saved["compression"])
        self.scheduler.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(saved["cuda_rng"], self.device)
        return saved["step"], saved, saved["run_id"]

    def _settings(self) -> dict[str, Any]:
        """What a resumed run must share with the run it resumes (checkpointed with it)."""
        args = self.args
        return {"grace": self.params, "lr": args.lr, "batch_size": args.batch_size,
                "dnn": args.dnn, "dataset": args.dataset, "seed": args.seed}

    def save(self, step: int) -> None:
        """This rank's whole state after `step` steps (crash-safe; the previous one is kept)."""
        state = None if self.args.fsdp else self.sync.compression_state()
        if state is None:
            return
        cuda = {"cuda_rng": torch.cuda.get_rng_state(self.device)} \
            if self.device.type == "cuda" else {}
        save_checkpoint({"model": self.model.state_dict(),
                         "optimizer": self.sync.optimizer.state_dict(),
                         "compression": state, "scheduler": self.scheduler.state_dict(),
                         "rng": torch.get_rng_state(), "step": step, "run_id": self.run_id,
                         "summary": self.summary, "settings": self._settings(), **cuda,
                         **({"epoch_tally": t} if (t := self._tally_to_save()) else {})},
                        self.checkpoint)

    def evaluation(self, step: int, epoch: float) -> dict[str, Any]:
        """Evaluate on rank 0 with the clock stopped; every rank gets the same figures."""
        args, totals, window = self.args, self.totals, self.window
        figures = torch.zeros(5, dtype=torch.float64)
        scored = self.sync.evaluation_model(self.rank) if args.fsdp else self.model  # all gather
        if self.rank == 0:
            train_s = self.clock.stop()
            loss, acc = evaluate(scored, self.test_images, self.test_labels)
            over_budget = args.time_budget is not None and train_s >= args.time_budget
            at_target = args.stop_at_target and acc >= args.target_accuracy
            figures = torch.tensor([loss, acc, float(over_budget), float(at_target), train_s],
                                   dtype=torch.float64)
        else:
            self.clock.stop()
        # Rank 0's clock is the run's: every rank logs and stops on the same figures.
        figures = self.transport.broadcast(figures, 0, f"trainer.eval.{step}")
        test_loss, test_acc, over_budget, at_target, train_s = figures.tolist()
        if args.target_accuracy is not None and totals["time_to_target_s"] is None \
                and test_acc >= args.target_accuracy:
            totals["time_to_target_s"], totals["steps_to_target"] = train_s, step
        steps = max(step - window["step"], 1)
        wire = interface_tx_bytes()
        record = {"kind": "eval", "step": step, "epoch": epoch, "train_s": train_s,
                  "test_loss": test_loss, "test_accuracy": test_acc,
                  "eval/loss": test_loss, "eval/top-1": test_acc,
                  "bytes_sent_per_step": (self.sync.bytes_sent - window["bytes"]) / steps,
                  "time_to_target_s": totals["time_to_target_s"]}
        if wire is not None and window["wire"] is not None:
            record["wire_bytes_per_step"] = (wire - window["wire"]) / steps
        window.update(step=step, bytes=self.sync.bytes_sent, wire=wire)
        self.logger.log(record, step)
        totals["stopped_by_budget"] = bool(over_budget)
        totals["stopped_at_target"] = bool(at_target)
        totals["stopped"], totals["last_eval"] = bool(over_budget or at_target), record
        self.clock.start()
        return record

    def run(self) -> dict[str, Any]:
        """Every epoch from the one resumed, then the run's summary and final parameters."""
        first_epoch, first_in_epoch = divmod(self.first_step, max(self.steps_per_epoch, 1))
        try:
            for epoch in range(first_epoch, self.args.max_epochs):
                self._epoch(epoch, first_in_epoch if epoch == first_epoch else 0)
                if self.totals["stopped"]:
                    break
        finally:
            if self.load is not None:
                self.load.stop()
        self.progress.close()
        return self._finish()

    def _epoch(self, epoch: int, start: int) -> None:
        """Train one epoch from its step `start`, evaluate, log its summary, checkpoint."""
        args, sync, spe = self.args, self.sync, self.steps_per_epoch
        order = self.shard[torch.randperm(len(self.shard), generator=torch.Generator().manual_seed(
            args.seed * 1000 + epoch * 100 + self.rank))]
        tally = {"sync_s": 0.0, "losses": [], "correct": 0, "seen": 0, "samples": 0, "done": 0,
                 "split": dict.fromkeys(TIME_SPLIT, 0.0), "sent_before": sync.bytes_sent,
                 "clock_before": self.clock.total, "before": start}
        if start and self.resumed is not None and "epoch_tally" in self.resumed:
            self._carry_on(tally, self.resumed["epoch_tally"])
        self._tally = tally
        self.clock.start()
        for i in range(start, spe):
            step = epoch * spe + i
            self._step(step, epoch, order[i * args.batch_size:(i + 1) * args.batch_size], tally)
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and i + 1 < spe:
                self.save(step + 1)
            if args.eval_every and (step + 1) % args.eval_every == 0 and i + 1 < spe:
                self.evaluation(step + 1, epoch + (i + 1) / spe)
                if self.totals["stopped"]:
                    break
        done = tally["before"] + tally["done"]  # the epoch's steps, those resumed past too
        # Stopped by the budget: the evaluation that said so is this epoch's last.
        last = self.totals["last_eval"] if self.totals["stopped"] else \
            self.evaluation(epoch * spe + done, epoch + done / max(spe, 1))
        self.clock.stop()
        self.summary = self._epoch_summary(epoch, tally, last)
        self.logger.log(self.summary, self.summary["step"])
        self._tally = None
        self.save(epoch * spe + done)

    def _carry_on(self, tally: dict[str, Any], saved: dict[str, Any]) -> None:
        """Start `tally` from the one a mid-epoch checkpoint holds (its steps' losses,
        accuracy counts, bytes and seconds), so the epoch's summary covers the whole epoch."""
        for key in ("sync_s", "losses", "correct", "seen", "samples", "split"):
            tally[key] = saved[key]
        tally["before"] = 0
        tally["done"] = saved["done"]
        tally["sent_before"] -= saved["sent"]
        tally["clock_before"] -= saved["clock_s"]

    def _tally_to_save(self) -> dict[str, Any] | None:
        """The epoch's tally so far, with its bytes and seconds as amounts (None between
        epochs, and for a tally that does not start at the epoch's beginning)."""
        tally = self._tally
        if tally is None or tally["before"]:
            return None
        return {**{k: tally[k] for k in ("sync_s", "losses", "correct", "seen", "samples",
                                         "split", "done")},
                "sent": self.sync.bytes_sent - tally["sent_before"],
                "clock_s": self.clock.total - tally["clock_before"]}

    def _step(self, step: int, epoch: int, batch: torch.Tensor, tally: dict[str, Any]) -> None:
        """One training step on `batch` (indices), its record logged and tallied."""
        args, sync = self.args, self.sync
        density = None
        if args.density_warmup:
            density = warmup_density(step, *self.warmup)
            if not library_warms_up(args):
                sync.set_density(density)
        if args.bandwidth_change is not None and step == args.bandwidth_change[0]:
            reshape_own_link(args.bandwidth_change[1])
        if self.load is not None:
            self.load.at_step(step)
        x, y = self.images[batch].to(self.device), self.labels[batch].to(self.device)
        step_start = time.perf_counter()
        sync.optimizer.zero_grad()
        logits, y = flat_outputs(sync.model(x), y)
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        t0 = time.perf_counter()
        sync.synchronize()
        tally["sync_s"] += time.perf_counter() - t0
        recipe.clip(sync.model, args.clip_norm)
        sync.step()
        self.scheduler.step()
        step_s = time.perf_counter() - step_start
        tally["losses"].append(loss.item())
        tally["correct"] += int((logits.argmax(1) == y).sum())
        tally["seen"] += y.numel()  # tokens for a language model
        tally["samples"] += len(x)
        tally["done"] += 1
        self.totals["steps"] += 1
        times = {k: float(sync.last_stats.get(k, 0.0)) for k in TIME_SPLIT}
        for k, v in times.items():
            tally["split"][k] += v
        record = {"kind": "step", "step": step, "epoch": epoch, "loss": loss.item(),
                  "lr": self.scheduler.get_last_lr()[0], "step_s": step_s, **times}
        if density is not None:
            record["density"] = density
        # 'communicator': 'auto''s plan: its choice, predicted step, link (W&B shows them too)
        record.update({k: float(v) for k, v in sync.last_stats.items() if k.startswith("auto_")})
        self.logger.log(record, step)
        self.progress.update(1)

    def _epoch_summary(self, epoch: int, tally: dict[str, Any], last: dict[str, Any]
                       ) -> dict[str, Any]:
        elapsed = self.clock.total - tally["clock_before"]
        done, world = tally["done"], self.world
        bytes_per_step = (self.sync.bytes_sent - tally["sent_before"]) / max(done, 1)
        rate = tally["samples"] * world / max(elapsed, 1e-9)
        return {"kind": "epoch", "step": epoch * self.steps_per_epoch + tally["before"] + done,
                "epoch": epoch,
                "train_loss": sum(tally["losses"]) / max(len(tally["losses"]), 1),
                "train_accuracy": tally["correct"] / max(tally["seen"], 1),
                "test_loss": last["test_loss"], "test_accuracy": last["test_accuracy"],
                "samples_per_s": rate, "throughput": rate,
                "bytes_sent_per_step": bytes_per_step,
                "compression_ratio": bytes_per_step / self.dense_bytes if self.dense_bytes else 1.0,
                "train_s": self.clock.total, "sync_s": tally["sync_s"],
                "compute_s": elapsed - tally["sync_s"], **tally["split"],
                "residual_norm": self.sync.residual_norm(),
                "lr": self.scheduler.get_last_lr()[0],
                "time_to_target_s": self.totals["time_to_target_s"]}

    def _finish(self) -> dict[str, Any]:
        """The run's summary, logged, and this rank's final parameters saved beside it."""
        totals, sync = self.totals, self.sync
        steps = max(totals["steps"], 1)
        summary = {**self.summary, "steps_run": totals["steps"],
                   "time_to_target_s": totals["time_to_target_s"],
                   "steps_to_target": totals["steps_to_target"],
                   "stopped_by_budget": totals["stopped_by_budget"],
                   "stopped_at_target": totals["stopped_at_target"],
                   "bytes_sent_per_step_run": (sync.bytes_sent - totals["bytes_at_start"]) / steps,
                   "dense_bytes_per_step": self.dense_bytes, "parameters": self.n_params}
        wire = interface_tx_bytes()
        if wire is not None and totals["wire_at_start"] is not None:
            summary["wire_bytes_per_step_run"] = (wire - totals["wire_at_start"]) / steps
        self.logger.log({**summary, "kind": "run"}, summary["step"])
        self.logger.close()
        digest = (sync.local_parameters() if self.args.fsdp else
                  torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])).cpu()
        torch.save({"rank": self.rank, "params": digest, "summary": summary},
                   self.out / f"final-rank{self.rank}.pt")
        return summary


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(rank: int, total: int):
    """tqdm on rank 0 when installed and attached to a terminal."""
    if rank != 0 or not sys.stderr.isatty():
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="step")


class _PlanRecords(logging.Handler):
    """Writes each of 'communicator': 'auto''s plans (the `auto_plan` its log records carry)
    into the run's log.jsonl as a 'plan' record: what it predicted for every candidate, which
    the step records' auto_* figures leave out."""

    def __init__(self, logger: Logger):
        super().__init__(logging.INFO)
        self.logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        plan = getattr(record, "auto_plan", None)
        if plan is not None:
            self.logger.write({"kind": "plan", **plan})


def _record_plans(logger: Logger) -> None:
    """Print 'communicator': 'auto''s one-line plans (its logger's INFO records) on stdout and
    keep each whole plan in `logger`'s log.jsonl (this run's: a handler of an earlier run in
    this process is replaced)."""
    plans = logging.getLogger("spardl_grace.auto")
    plans.setLevel(logging.INFO)
    for handler in list(plans.handlers):
        if isinstance(handler, _PlanRecords):
            plans.removeHandler(handler)
    if not plans.handlers:
        plans.addHandler(logging.StreamHandler(sys.stdout))
    plans.addHandler(_PlanRecords(logger))


def main(argv: list[str] | None = None) -> None:
    # Several ranks share a machine's cores; the spawned workers inherit this.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    start(args)


if __name__ == "__main__":
    main()
