"""examples/: every script runs as its docstring says, under its launcher, on 2 ranks."""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import ROOT, _env, launcher_command, require

EXAMPLES = ROOT / "examples"
LOSS = re.compile(r"loss (\d+\.\d+) -> (\d+\.\d+) over \d+ steps; replicas identical: True")


def run_example(backend: str, script: str, *args: str, env: dict[str, str] | None = None,
                nprocs: int = 2) -> str:
    require(backend)
    cmd = launcher_command(backend, nprocs, [str(EXAMPLES / script), *args])
    proc = subprocess.run(cmd, cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout


def trained(output: str) -> tuple[float, float]:
    """(first, last) mean loss of the example's report, which must say the replicas agree."""
    match = LOSS.search(output)
    assert match, f"no report with identical replicas in:\n{output}"
    first, last = float(match[1]), float(match[2])
    assert last < 0.5 * first, f"the loss did not fall: {first} -> {last}"
    return first, last


@pytest.mark.parametrize("backend,script", [
    ("gloo", "ddp_comm_hook.py"), ("gloo", "grace_loop.py"), ("mpi", "mpirun_optimizer.py"),
    ("gloo", "fsdp_flat.py"), ("gloo", "diloco_sparse.py"),
    ("horovod-gloo", "horovod_optimizer.py"), ("horovod-mpi", "horovod_optimizer.py"),
    ("horovod-gloo", "horovod_migration.py"), ("horovod-mpi", "horovod_migration.py"),
    ("horovod-gloo", "grace_migration.py"), ("horovod-mpi", "grace_migration.py")])
def test_example_trains_with_identical_replicas(backend, script):
    trained(run_example(backend, script))


def test_trainer_examples_train_and_the_accelerate_one_resumes_bit_identically(tmp_path):
    """examples/lightning_ddp.py and accelerate_ddp.py under torchrun (Lightning and Accelerate
    create the process group themselves, after the hook's parameters are given)."""
    trained(run_example("gloo", "lightning_ddp.py"))
    output = run_example("gloo", "accelerate_ddp.py", env={"CHECKPOINT_DIR": str(tmp_path)})
    trained(output)
    assert "resumed run bit-identical: True" in output


def test_fsdp_example_trains_with_the_same_shards_on_both_nodes():
    """examples/fsdp_hybrid.py as its docstring runs it: 4 ranks, a 2 x 2 mesh, no argument."""
    trained(run_example("gloo", "fsdp_hybrid.py", nprocs=4))


def test_examples_compute_the_same_spardl_under_every_launcher():
    """The DDP hook, Horovod and plain MPI all run SparDL on the same batches: the same losses."""
    reports = {trained(run_example(backend, script)) for backend, script in [
        ("gloo", "ddp_comm_hook.py"), ("mpi", "mpirun_optimizer.py"),
        ("horovod-gloo", "horovod_optimizer.py")]}
    assert len(reports) == 1, reports


def test_deepreduce_example_codes_fewer_bytes_and_still_trains():
    output = run_example("gloo", "deepreduce_codecs.py")
    sent = dict(re.findall(r"; (uncoded|bloom \+ polyfit): (\d+) bytes sent per step", output))
    assert set(sent) == {"uncoded", "bloom + polyfit"}, output
    assert int(sent["bloom + polyfit"]) < int(sent["uncoded"])
    assert len(LOSS.findall(output)) == 2
    for line in output.splitlines():
        if LOSS.search(line):
            trained(line)


def test_checkpoint_example_resumes_bit_identically(tmp_path):
    output = run_example("gloo", "checkpoint_resume.py", env={"CHECKPOINT_DIR": str(tmp_path)})
    assert ("bit-identical to the uninterrupted run: True; replicas identical: True"
            in output), output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-rank0.pt",
                                                          "checkpoint-rank1.pt"]


def test_horovod_migration_runs_with_and_without_fp16():
    """Horovod's --fp16-allreduce (Compression.fp16) is accepted and changes nothing: the
    default communicator's compact wire already sends 16-bit values, so the bytes are the
    same."""
    sent = {}
    for flag in ((), ("--fp16-allreduce",)):
        output = run_example("horovod-gloo", "horovod_migration.py", *flag)
        trained(output)
        sent[bool(flag)] = int(re.search(r"bytes sent per step: (\d+)", output)[1])
    assert sent[True] == sent[False], sent
