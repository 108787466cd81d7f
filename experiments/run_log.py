"""The training CLI's records: a run id, and rank 0's log (OUT/log.jsonl, OUT/epochs.csv, and
W&B or TensorBoard with --log).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch


def new_run_id(transport) -> str:
    """A fresh id for this run, drawn on rank 0 and the same on every rank; checkpoints carry it
    so that a resume never mixes the checkpoints of two runs."""
    drawn = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8)
    return bytes(transport.broadcast(drawn, 0, "trainer.run_id").tolist()).hex()

# --------------------------------------------------------------------------- training
class Logger:
    """JSONL of every record and a CSV of epoch summaries on rank 0; W&B and TensorBoard when
    asked for (W&B offline unless WANDB_API_KEY is set)."""

    def __init__(self, args: argparse.Namespace, rank: int, config: dict[str, Any],
                 append: bool = False):
        """`append`: continue the logs of a resumed run instead of starting them anew."""
        self.active = rank == 0
        self.out = Path(args.out)
        self.wandb = self.tensorboard = None
        if not self.active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        mode = "a" if append else "w"
        self.jsonl = open(self.out / "log.jsonl", mode)
        self.csv_path = self.out / "epochs.csv"
        logs = set(filter(None, args.log.split(",")))
        if "wandb" in logs:
            try:
                import wandb
            except ImportError as exc:
                raise SystemExit("--log wandb needs the wandb package: pip install wandb") from exc
            os.environ.setdefault("WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project="spardl-grace", config=config, dir=str(self.out))
        if "tensorboard" in logs:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise SystemExit("--log tensorboard needs the tensorboard package: "
                                 "pip install tensorboard") from exc
            self.tensorboard = SummaryWriter(str(self.out / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        """`record` into log.jsonl only (on rank 0): for records that are not a step's figures."""
        if self.active:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def log(self, record: dict[str, Any], step: int) -> None:
        if not self.active:
            return
        self.write(record)
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        if self.tensorboard is not None:
            for k, v in numbers.items():
                self.tensorboard.add_scalar(f"{record['kind']}/{k}", v, step)
        if record["kind"] == "epoch":
            new = not self.csv_path.exists()
            with open(self.csv_path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(record))
                if new:
                    writer.writeheader()
                writer.writerow(record)

    def close(self) -> None:
        if self.active:
            self.active = False
            self.jsonl.close()
            if self.wandb is not None:
                self.wandb.finish()
            if self.tensorboard is not None:
                self.tensorboard.close()
