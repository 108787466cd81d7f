"""Recorded runs packed into one file each (testbed.records): the round trip, the errors, the
tree's size budget, and every recorded run still read by the tools that made its summaries."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from testbed import records

ROOT = Path(__file__).resolve().parent.parent
RESULTS = (ROOT / "experiments" / "results", ROOT / "benchmarks" / "results")
MB = 1 << 20
# The whole checkout (tracked files) and each recorded experiment's folder. A GPU machine takes
# at most 64 MiB of tree beside its data; recorded runs must leave room for both.
TREE_BUDGET = 25 * MB
FOLDER_BUDGET = 8 * MB


def _run_folder(path: Path, steps: int = 3) -> Path:
    path.mkdir(parents=True)
    lines = [{"kind": "step", "step": s, "loss": 1.0 / (s + 1)} for s in range(steps)]
    lines += [{"kind": "epoch", "epoch": 0, "step": steps, "test_accuracy": 0.5},
              {"kind": "run", "steps_run": steps}]
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "epochs.csv").write_text("kind,step\nepoch,3\n")
    (path / "run.json").write_text('{"config": "dense", "seed": 0}')
    (path / "wandb").mkdir()
    (path / "wandb" / "events").write_bytes(bytes(range(256)))
    (path / "ckpt-rank0.pt").write_bytes(b"checkpoint")
    return path


def _tracked() -> list[Path] | None:
    if not (ROOT / ".git").exists():
        return None
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def test_a_packed_run_reads_back_as_its_folder_and_keeps_the_checkpoints_out(tmp_path):
    folder = _run_folder(tmp_path / "out" / "dense-seed0")
    before = {m: (folder / m).read_bytes() for m in ("log.jsonl", "epochs.csv", "run.json",
                                                    "wandb/events")}
    log = records.read_log(folder)
    archive = records.pack(folder)
    assert archive == tmp_path / "out" / "dense-seed0.tar.xz"
    # only what git never tracks stays behind
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt-rank0.pt"]
    run = records.open_run(folder)
    assert run.packed and run.name == "dense-seed0"
    assert run.members() == sorted(before)
    assert {m: run.read_bytes(m) for m in before} == before
    assert records.read_log(archive) == records.read_log(folder) == log
    assert not run.has("ckpt-rank0.pt")
    assert [r.name for r in records.runs_under(tmp_path / "out", "run.json")] == ["dense-seed0"]
    with pytest.raises(FileNotFoundError, match="holds no missing.txt"):
        run.read_bytes("missing.txt")
    # tar gives the folder back
    subprocess.run(["tar", "xJf", str(archive), "-C", str(tmp_path)], check=True)
    assert (tmp_path / "dense-seed0" / "wandb" / "events").read_bytes() == bytes(range(256))


def test_packing_is_reproducible_so_a_repacked_run_is_no_change_to_git(tmp_path):
    first = records.pack(_run_folder(tmp_path / "a" / "run"))
    second = records.pack(_run_folder(tmp_path / "b" / "run"))
    assert first.read_bytes() == second.read_bytes()


def test_a_run_in_both_forms_or_in_neither_is_refused(tmp_path):
    folder = _run_folder(tmp_path / "run")
    records.pack(folder)
    (folder / "log.jsonl").write_text('{"kind": "step", "step": 0}\n')  # a second run begins
    with pytest.raises(ValueError, match="exists already"):
        records.pack(folder)
    # readers refuse to guess which of the two is the run
    with pytest.raises(ValueError, match="both a folder with log.jsonl and .*run.tar.xz"):
        records.read_log(folder)
    with pytest.raises(FileNotFoundError, match="neither the folder nor nothing.tar.xz"):
        records.open_run(tmp_path / "nothing")
    with pytest.raises(ValueError, match="not a run folder"):
        records.pack(tmp_path)


def test_the_pack_command_packs_finished_runs_and_leaves_a_running_one(tmp_path, capsys):
    _run_folder(tmp_path / "cfg" / "done-seed0")
    running = _run_folder(tmp_path / "cfg" / "running-seed0")
    log = running / "log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:-1]))
    records.main(["pack", str(tmp_path)])
    assert (tmp_path / "cfg" / "done-seed0.tar.xz").exists()
    assert not (tmp_path / "cfg" / "running-seed0.tar.xz").exists() and log.exists()
    assert "done-seed0.tar.xz" in capsys.readouterr().out
    records.main(["pack", "--unfinished", str(tmp_path)])
    assert (tmp_path / "cfg" / "running-seed0.tar.xz").exists()


def _long_log(steps: int) -> str:
    """A resumed run's log: steps 0..steps-1, the last 7 of them logged again after the
    restart, with evaluations and epochs between the step lines."""
    lines = []
    for s in [*range(steps), *range(steps - 7, steps)]:
        lines.append({"kind": "step", "step": s, "epoch": s // 500, "loss": 1.0 / (s + 1),
                      "step_s": 0.25 + (s % 3) / 8, "ok": True, "choice": "spardl@0.01"})
        if s % 500 == 499:
            lines.append({"kind": "eval", "step": s + 1, "test_accuracy": s / steps})
    lines.append({"kind": "run", "steps_run": steps})
    return "".join(json.dumps(r) + "\n" for r in lines)


def test_thinning_keeps_every_strideth_step_line_and_the_last_and_sums_what_it_drops():
    text = _long_log(1205)
    records_in = [json.loads(line) for line in text.splitlines()]
    thinned = records.thin_log(text, stride=10)
    out = [json.loads(line) for line in thinned.splitlines()]
    steps_in = [r for r in records_in if r["kind"] == "step"]
    kept = [r for r in records_in
            if r["kind"] != "step" or r["step"] % 10 == 0 or r is steps_in[-1]]
    assert out[:-1] == kept  # verbatim and in order, evaluations and the end included
    summary = out[-1]
    assert summary["kind"] == "thinned" and summary["stride"] == 10
    # 0, 10, .., 1200; 1200 again after the restart; the last line (1204)
    assert summary["step_lines"] == 1212 and summary["kept"] == 123
    assert set(summary["sum"]) == {"loss", "step_s"}  # not step, epoch, flags or names
    assert summary["sum"]["step_s"] == sum(r["step_s"] for r in steps_in)
    assert summary["median"]["step_s"] == 0.375
    # thinning twice changes nothing; a short log and stride 1 are left alone
    assert records.thin_log(thinned) == thinned
    short = _long_log(records.THIN_ABOVE - 7)
    assert records.thin_log(short) == short and records.thin_log(text, stride=1) == text


def test_packing_thins_a_long_log_unless_told_and_packed_runs_thin_in_place(tmp_path, capsys):
    text = _long_log(2000)
    folders = {}
    for way in ("pack", "keep", "later"):
        folders[way] = _run_folder(tmp_path / way / "run-seed0")
        (folders[way] / "log.jsonl").write_text(text)
    packed = records.pack(folders["pack"])
    assert records.open_run(packed).read_text("log.jsonl") == records.thin_log(text)
    records.main(["pack", "--keep-steps", str(tmp_path / "keep")])
    kept = tmp_path / "keep" / "run-seed0.tar.xz"
    assert records.open_run(kept).read_text("log.jsonl") == text
    capsys.readouterr()
    later = records.pack(folders["later"], thin=False)
    before, after = records.thin_archive(later)
    assert after < before / 5 and after == later.stat().st_size
    # a run thinned once packed is the archive packing would have written: no change for git
    assert later.read_bytes() == packed.read_bytes()
    assert records.thin_archive(later) == (after, after)
    records.main(["thin", str(tmp_path)])
    assert capsys.readouterr().out.splitlines() == [f"{kept}: {before:,} -> {after:,} bytes"]
    assert kept.read_bytes() == packed.read_bytes()


def test_the_checkout_stays_within_its_size_budget_and_recorded_runs_are_packed():
    """Fails when recorded runs outgrow the budget or a run's logs are tracked unpacked. Pack
    them: python -m testbed.records pack experiments/results/FOLDER."""
    tracked = _tracked()
    if tracked is None:
        pytest.skip("not a git checkout: the tracked files are unknown")
    existing = [p for p in tracked if p.is_file()]
    total = sum(p.stat().st_size for p in existing)
    assert total < TREE_BUDGET, f"tracked files take {total / MB:.1f} MB (budget 25)"
    unpacked = [str(p.relative_to(ROOT)) for p in existing
                if p.name == records.LOG and any(r in p.parents for r in RESULTS)]
    assert not unpacked, ("recorded runs tracked unpacked (python -m testbed.records pack "
                          f"FOLDER): {unpacked[:5]}")
    per_folder: dict[Path, int] = {}
    for p in existing:
        for results in RESULTS:
            if results in p.parents:
                top = results / p.relative_to(results).parts[0]
                per_folder[top] = per_folder.get(top, 0) + p.stat().st_size
    over = {str(k.relative_to(ROOT)): round(v / MB, 1) for k, v in per_folder.items()
            if v > FOLDER_BUDGET}
    assert not over, f"results folders over {FOLDER_BUDGET // MB} MB: {over}"


def _recorded(name: str) -> list[Path]:
    return sorted(p for results in RESULTS for p in results.rglob(name))


def test_every_recorded_ablation_run_reads_back_as_its_results_json_records_it():
    """experiments.ablation's OUT/results.json lists each run's run.json; the packed runs
    must hold the same records, and their logs the accuracy the record gives."""
    checked = 0
    for summary in _recorded("results.json"):
        recorded = json.loads(summary.read_text())
        for entry in recorded.get("runs", []):
            run = records.open_run(summary.parent / f"{entry['config']}-seed{entry['seed']}")
            assert json.loads(run.read_text("run.json")) == entry, run
            assert records.read_log(run)["run"][-1]["test_accuracy"] == entry["test_accuracy"]
            checked += 1
    assert checked >= 40


def test_every_recorded_comparison_run_reads_back_as_the_curve_its_results_json_plots():
    """experiments.compare's results.json holds each run's accuracy curve; the packed run's
    evaluations must give it again (runs are OUT/NAME/seedS, or OUT/NAME in older runs)."""
    checked = 0
    for summary in _recorded("*results.json"):
        for group in json.loads(summary.read_text()).get("results", []):
            for entry in group.get("runs", [group]):
                base = summary.parent / entry["algorithm"]
                path = base / f"seed{entry.get('seed')}"
                run = records.open_run(path if records.Run(path).has(records.LOG) else base)
                evals = records.read_log(run)["eval"]
                assert [[e["train_s"], e["test_accuracy"]] for e in evals] == entry["curve"], run
                checked += 1
    assert checked >= 55


def test_the_recorded_front_and_reports_regenerate_from_the_packed_runs():
    from experiments import front, report

    folder = ROOT / "experiments" / "results" / "front_resnet20_cpu"
    recorded = json.loads((folder / "front.json").read_text())
    runs = front.load_runs(folder)
    rows = front.summarise(runs)
    assert json.loads(json.dumps(rows)) == recorded["rows"]
    assert len(rows) >= 20 and sum(len(r["seeds"]) for r in rows) >= 50
    step_times = json.loads((folder / "step_times.json").read_text())
    timed = [front.time_to_accuracy(runs, step_times, t["target_epoch"])
             for t in recorded["time_to_accuracy"]]
    assert json.loads(json.dumps(timed)) == recorded["time_to_accuracy"]
    for summary in _recorded("summary.json"):
        runs = records.runs_under(summary.parent)
        rows = [report.summarise(r.name, report.read_run(r)) for r in runs]
        assert rows == json.loads(summary.read_text()), summary


def test_the_recorded_times_to_loss_regenerate_from_the_packed_runs_and_their_step_times():
    from experiments import time_to_loss

    recorded = _recorded("time_to_loss.json")
    assert recorded, "the transformer front's time to loss is recorded"
    for path in recorded:
        saved = json.loads(path.read_text())
        step_times = time_to_loss.merged_step_times([ROOT / s for s in saved["step_times"]])
        curves = time_to_loss.loss_curves(path.parent)
        timed = [time_to_loss.time_to_loss(curves, step_times, r["target_step"])
                 for r in saved["results"]]
        assert json.loads(json.dumps(timed)) == saved["results"], path


def test_every_recorded_run_is_readable():
    archives = _recorded("*" + records.SUFFIX)
    assert len(archives) >= 170
    for archive in archives:
        log = records.read_log(archive)
        assert log.get("step") and (log.get("epoch") or log.get("eval")), archive
