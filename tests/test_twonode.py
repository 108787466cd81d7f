"""Two nodes, 2 ranks each, launched by the docs' recipe (docs/guide/multi-node.md): each node
is a network namespace with its own eth0, hostname and name resolution; mpirun and horovodrun
reach node 1 through an ssh stand-in that enters its namespace (benchmarks/netns_ssh.py)."""
from __future__ import annotations

import re

import pytest

from benchmarks import twonode
from benchmarks.netns_ssh import parse
from conftest import require, require_netns

REPORT = re.compile(r"loss (\d+\.\d+) -> (\d+\.\d+) over 60 steps; replicas identical: True")


def test_ssh_stand_in_reads_hosts_and_commands_as_ssh_does():
    assert parse(["-o", "StrictHostKeyChecking=no", "10.0.0.2", "-o", "ConnectTimeout=5", "true"]) \
        == ("10.0.0.2", ["true"])
    assert parse(["-x", "-p", "22", "user@node1", "orted", "-mca", "x", "1"]) \
        == ("node1", ["orted", "-mca", "x", "1"])
    assert parse(["node1", "--", "ls", "-l"]) == ("node1", ["ls", "-l"])
    with pytest.raises(SystemExit, match="no host"):
        parse(["-o", "A=b"])


def test_every_launcher_trains_the_same_model_across_two_nodes():
    """torchrun (c10d rendezvous, one command per node), mpirun and horovodrun (gloo and MPI,
    one command on node 0): the example trains with identical replicas on all 4 ranks, both
    nodes' links carry the synchronisation, and every launcher gives the same losses."""
    require_netns()
    require("horovod")
    reports = {}
    for launcher, script in [("torchrun", "examples/ddp_comm_hook.py"),
                             ("mpirun", "examples/mpirun_optimizer.py"),
                             ("horovodrun", "examples/horovod_optimizer.py"),
                             ("horovodrun-mpi", "examples/horovod_optimizer.py")]:
        run = twonode.run(launcher, [script], timeout=240)
        detail = f"{launcher}:\n" + "\n".join(o[-2000:] + e[-3000:] for o, e in zip(run.stdout, run.stderr))
        assert run.returncodes == [0] * len(run.returncodes), detail
        match = REPORT.search(run.stdout[0])
        assert match, detail
        assert float(match[2]) < 0.5 * float(match[1]), detail
        # 60 steps of SparDL on 4 ranks: well over 100 KB leave each node.
        assert min(run.tx_bytes) > 100_000, (launcher, run.tx_bytes)
        reports[launcher] = match.groups()
    assert len(set(reports.values())) == 1, reports


def test_a_node_that_fails_ends_the_launch_with_its_output(monkeypatch):
    """One node's launcher exits with an error while the other would wait for it forever: the
    launch returns both exit statuses and the failed node's output after the grace period,
    not after the timeout."""
    import subprocess
    import time
    monkeypatch.setattr(twonode, "FAILED_NODE_GRACE_S", 1.0)
    procs = [subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
             for cmd in (["sh", "-c", "sleep 600"], ["sh", "-c", "echo lost >&2; exit 3"])]
    start = time.monotonic()
    outputs = twonode._communicate_all(procs, timeout=120)
    assert time.monotonic() - start < 30
    assert [p.returncode for p in procs][1] == 3 and procs[0].returncode != 0
    assert outputs[1] == ("", "lost\n")
    slow = subprocess.Popen(["sh", "-c", "sleep 600"], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    with pytest.raises(subprocess.TimeoutExpired):
        twonode._communicate_all([slow], timeout=1)
    assert slow.poll() is not None
