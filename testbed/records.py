"""Recorded runs, as a folder or packed into one compressed file, read the same way.

A run is a folder the training CLI wrote (``log.jsonl``, ``epochs.csv``, ``output.log``, and
``run.json`` from ``experiments.ablation``). Once finished and recorded it is packed into
``FOLDER.tar.xz`` beside where the folder was (``tar xJf`` gives the folder back), so the
repository carries each run as one file of about a ninth of its size. Every driver reads runs
through :func:`open_run` and :func:`runs_under`, which take either form.

    python -m testbed.records pack experiments/results/front_resnet20_cpu

packs every finished run under a folder (any depth). Checkpoints and final parameters
(``*.pt``, never tracked) are left where they are; the folder goes once nothing else is in it.

A long run's step lines are most of its archive (a ResNet-20 run logs 4,000 of them: 170 KB
packed, where everything else is 5 KB), and once the run is summarised only its loss plot and
its whole-run seconds read them. So packing keeps, in a log of more than ``THIN_ABOVE`` step
lines, every ``STRIDE``-th step's line verbatim and one ``thinned`` record holding each step
field's sum and median over all the lines (:func:`thin_log`); ``--keep-steps`` keeps them all.

    python -m testbed.records thin experiments/results

thins the runs already packed the same way (an archive is rewritten only when it changes).
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SUFFIX = ".tar.xz"
LOG = "log.jsonl"
# What the repository never tracks in a run folder (.gitignore): it stays out of the archive.
UNPACKED = ("*.pt", "*.pt.prev", "*.pt.tmp", "worker-config.json")
THIN_ABOVE = 1000
STRIDE = 10
# Step fields that name the line, not a measurement; they are not summed.
STEP_KEYS = ("kind", "step", "epoch")


class Run:
    """One recorded run: the folder `path`, or `path` + '.tar.xz' when it has been packed.

    `name` is the folder's name either way; `members()` and `read_text()` see the same files.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.name.endswith(SUFFIX):
            path = path.with_name(path.name[: -len(SUFFIX)])
        self.path = path
        self.archive = path.with_name(path.name + SUFFIX)
        self._files: dict[str, bytes] | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def packed(self) -> bool:
        """Whether the run is read from its archive (a folder holding its log wins otherwise)."""
        folder, archive = (self.path / LOG).exists(), self.archive.exists()
        if folder and archive:
            raise ValueError(f"{self.path} is both a folder with {LOG} and {self.archive}; "
                             "keep one (the archive is the packed copy of a finished run)")
        return archive

    def _archive_files(self) -> dict[str, bytes]:
        if self._files is None:
            self._files = self._read_archive(self.archive)
        return self._files

    @staticmethod
    def _read_archive(path: Path) -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        with tarfile.open(path, "r:xz") as tar:
            for member in tar.getmembers():
                handle = tar.extractfile(member) if member.isfile() else None
                if handle is not None:
                    files[member.name.split("/", 1)[1]] = handle.read()
        return files

    def members(self) -> list[str]:
        """The run's files, relative to its folder, sorted."""
        if self.packed:
            return sorted(self._archive_files())
        return sorted(str(f.relative_to(self.path)) for f in self.path.rglob("*") if f.is_file())

    def has(self, member: str) -> bool:
        if self.packed:
            return member in self._archive_files()
        return (self.path / member).is_file()

    def read_bytes(self, member: str) -> bytes:
        if self.packed:
            try:
                return self._archive_files()[member]
            except KeyError:
                raise FileNotFoundError(f"{self.archive} holds no {member}") from None
        return (self.path / member).read_bytes()

    def read_text(self, member: str) -> str:
        return self.read_bytes(member).decode()

    def __repr__(self) -> str:
        return f"Run({str(self.archive if self.archive.exists() else self.path)!r})"


def open_run(path: str | Path | Run) -> Run:
    """The run at `path` (its folder, or the folder's path or archive once packed); raises
    FileNotFoundError when neither form exists."""
    run = path if isinstance(path, Run) else Run(path)
    if not (run.path.is_dir() or run.archive.exists()):
        raise FileNotFoundError(f"no run at {run.path} (neither the folder nor {run.archive.name})")
    return run


def runs_under(folder: str | Path, member: str = LOG) -> list[Run]:
    """The runs directly under `folder` that hold `member`, folders and archives alike, sorted
    by name."""
    folder = Path(folder)
    names = {p.name[: -len(SUFFIX)] for p in folder.glob("*" + SUFFIX)}
    names |= {p.name for p in folder.iterdir() if p.is_dir()}
    runs = [Run(folder / name) for name in sorted(names)]
    return [run for run in runs if run.has(member)]


def read_log(run: str | Path | Run) -> dict[str, list[dict[str, Any]]]:
    """A run's log.jsonl by kind: 'start' (each start of the run, with the step it began at),
    'step', 'eval', 'epoch' and 'run' (the run's summary), each in the order written."""
    records: dict[str, list[dict[str, Any]]] = {}
    for line in open_run(run).read_text(LOG).splitlines():
        record = json.loads(line)
        records.setdefault(record["kind"], []).append(record)
    return records


def _unpacked(path: Path) -> bool:
    return any(path.match(pattern) for pattern in UNPACKED)


def thin_log(text: str, stride: int = STRIDE) -> str:
    """`text` (a log.jsonl) with its step lines thinned when there are more than THIN_ABOVE:
    the lines of steps that are multiples of `stride`, and the last step line, stay verbatim
    and in order; the others go, and a 'thinned' record at the end gives the stride, the
    number of step lines there were, and each numeric step field's sum and median over all of
    them (so the run's total seconds, say, survive). A log that is short or already
    thinned, or `stride` 1, comes back unchanged."""
    lines = text.splitlines()
    records = [json.loads(line) for line in lines]
    steps = [i for i, r in enumerate(records) if r["kind"] == "step"]
    if (stride <= 1 or len(steps) <= THIN_ABOVE
            or any(r["kind"] == "thinned" for r in records)):
        return text
    fields: dict[str, list[float]] = {}
    for i in steps:
        for key, value in records[i].items():
            if key not in STEP_KEYS and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                fields.setdefault(key, []).append(value)
    kept = [line for i, (line, r) in enumerate(zip(lines, records))
            if r["kind"] != "step" or r["step"] % stride == 0 or i == steps[-1]]
    summary = {"kind": "thinned", "stride": stride, "step_lines": len(steps),
               "kept": len(kept) - (len(lines) - len(steps)),
               "sum": {k: sum(v) for k, v in fields.items()},
               "median": {k: statistics.median(v) for k, v in fields.items()}}
    return "".join(line + "\n" for line in kept) + json.dumps(summary) + "\n"


def _write_archive(archive: Path, name: str, content: dict[str, bytes]) -> None:
    """Write `content` (member -> bytes) as the reproducible archive of the folder `name`
    (members sorted, times and owners zeroed), through a temporary file, and check that it
    reads back as `content`."""
    partial = archive.with_name(archive.name + ".tmp")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for member, data in sorted(content.items()):
            info = tarfile.TarInfo(f"{name}/{member}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    if Run._read_archive(partial) != content:
        partial.unlink()
        raise RuntimeError(f"{archive} did not read back as written; nothing was changed")
    partial.replace(archive)


def pack(folder: str | Path, thin: bool = True) -> Path:
    """Pack the run folder into FOLDER.tar.xz and remove what it packed; returns the archive.

    The archive is reproducible (members sorted, times and owners zeroed), and it is read back
    and compared with what it packs before anything is removed. Its log.jsonl is the folder's,
    thinned by :func:`thin_log` unless `thin` is False. Files the repository never tracks
    (checkpoints, final parameters) stay in the folder."""
    folder = Path(folder)
    if not (folder / LOG).is_file():
        raise ValueError(f"{folder} is not a run folder (it holds no {LOG})")
    archive = folder.with_name(folder.name + SUFFIX)
    if archive.exists():
        raise ValueError(f"{archive} exists already; remove it to pack {folder} again")
    files = sorted(f for f in folder.rglob("*") if f.is_file() and not _unpacked(f))
    content = {str(f.relative_to(folder)): f.read_bytes() for f in files}
    if thin:
        content[LOG] = thin_log(content[LOG].decode()).encode()
    _write_archive(archive, folder.name, content)
    for f in files:
        f.unlink()
    for sub in sorted((d for d in folder.rglob("*") if d.is_dir()), reverse=True) + [folder]:
        if not any(sub.iterdir()):
            sub.rmdir()
    return archive


def thin_archive(archive: str | Path, stride: int = STRIDE) -> tuple[int, int]:
    """Rewrite a packed run with its log thinned (:func:`thin_log`); returns its size before
    and after (equal, and the file untouched, when the log needs no thinning)."""
    run = Run(archive)
    content = dict(run._archive_files())
    before = run.archive.stat().st_size
    log = content[LOG].decode()
    thinned = thin_log(log, stride)
    if thinned == log:
        return before, before
    content[LOG] = thinned.encode()
    _write_archive(run.archive, run.name, content)
    return before, run.archive.stat().st_size


def run_folders(root: str | Path, unfinished: bool = False) -> Iterator[Path]:
    """Every run folder under `root` (any depth) whose log records the run's end, or every
    one with a log when `unfinished`."""
    for log in sorted(Path(root).rglob(LOG)):
        lines = log.read_text().splitlines()
        if unfinished or any(json.loads(line)["kind"] == "run" for line in lines):
            yield log.parent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pack_cmd = sub.add_parser("pack", help="pack every finished run under the folders")
    pack_cmd.add_argument("folders", nargs="+", type=Path)
    pack_cmd.add_argument("--unfinished", action="store_true",
                          help="also runs whose log has no end record (stopped, or logged "
                               "before the trainer wrote one)")
    pack_cmd.add_argument("--keep-steps", action="store_true",
                          help="keep every step line (by default a log of more than "
                               f"{THIN_ABOVE} keeps every {STRIDE}th)")
    thin_cmd = sub.add_parser("thin", help="thin the step lines of every packed run under "
                                           "the folders (any depth)")
    thin_cmd.add_argument("folders", nargs="+", type=Path)
    args = p.parse_args(argv)
    if args.command == "thin":
        for root in args.folders:
            for archive in sorted(root.rglob("*" + SUFFIX)):
                before, after = thin_archive(archive)
                if after != before:
                    print(f"{archive}: {before:,} -> {after:,} bytes")
        return
    for root in args.folders:
        for folder in run_folders(root, args.unfinished):
            before = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()
                         and not _unpacked(f))
            archive = pack(folder, thin=not args.keep_steps)
            print(f"{archive}: {before:,} -> {archive.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
