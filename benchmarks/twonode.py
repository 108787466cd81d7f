"""Two nodes on this machine, launched as on a real cluster, with 2 ranks per node.

    python -m benchmarks.twonode --launcher torchrun examples/ddp_comm_hook.py
    python -m benchmarks.twonode --launcher mpirun examples/mpirun_optimizer.py
    python -m benchmarks.twonode --launcher horovodrun examples/horovod_optimizer.py

Each node is a network namespace of testbed.netem with one interface, eth0 (the same name
on both, as on a cluster), on a shared bridge. The commands are the docs' two-node recipe
(docs/guide/multi-node.md), run as a user types them:
- torchrun: one `torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint NODE0:PORT` per
  node, each started inside its node;
- mpirun and horovodrun (gloo or MPI): one command on node 0 with `-H NODE0:2,NODE1:2`; they
  reach node 1 through `ssh`, which here is benchmarks/netns_ssh.py: it enters node 1's
  namespace in place of logging in, and like ssh passes on only a login's environment.
Needs root (namespaces). Prints each node's output and the bytes each node's eth0 sent.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .launch import BIN, ROOT, launch_env
from testbed.netem import EmulatedNetwork, available
from .netns_ssh import on_node

LAUNCHERS = ("torchrun", "mpirun", "horovodrun", "horovodrun-mpi")
INTERFACE = "eth0"
PORT = 29531


@dataclass
class Run:
    """What a two-node launch left: the exit status and output of each node's launcher (one
    for mpirun and horovodrun, which run on node 0 only) and the bytes each node sent."""
    returncodes: list[int]
    stdout: list[str]
    stderr: list[str]
    tx_bytes: list[int]


def hosts(net: EmulatedNetwork, per_node: int) -> str:
    """mpirun's and horovodrun's -H: every node's address with its slots."""
    return ",".join(f"{net.address(node)}:{per_node}" for node in range(net.size))


def commands(launcher: str, net: EmulatedNetwork, per_node: int, script: list[str]) -> list[list[str]]:
    """The command each node runs (node 0 first; mpirun and horovodrun run on node 0 only)."""
    python, nodes, total = sys.executable, net.size, net.size * per_node
    if launcher == "torchrun":
        return [[python, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                 f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={net.address(0)}:{PORT}", "--rdzv-id=twonode", *script]] * nodes
    if launcher == "mpirun":
        return [["mpirun", "-np", str(total), "-H", hosts(net, per_node),
                 "--mca", "oob_tcp_if_include", INTERFACE, "--mca", "btl_tcp_if_include", INTERFACE,
                 "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "PATH", python, *script]]
    if launcher in ("horovodrun", "horovodrun-mpi"):
        mode = "--mpi" if launcher == "horovodrun-mpi" else "--gloo"
        return [[str(BIN / "horovodrun"), "-np", str(total), "-H", hosts(net, per_node), mode,
                 "--network-interface", INTERFACE, python, *script]]
    raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")


@contextmanager
def ssh_to_nodes(net: EmulatedNetwork, base: dict[str, str]) -> Iterator[dict[str, str]]:
    """`base` with `ssh` on PATH standing for benchmarks/netns_ssh.py, which enters a node's
    namespace in place of logging in, and gloo bound to the nodes' INTERFACE: the environment
    in which mpirun and horovodrun, started on node 0, reach the other nodes."""
    with tempfile.TemporaryDirectory(prefix="netns-ssh-") as shim:
        os.symlink(ROOT / "benchmarks" / "netns_ssh.py", Path(shim) / "ssh")
        env = dict(base)
        env.update({"PATH": f"{shim}{os.pathsep}{env['PATH']}", "GLOO_SOCKET_IFNAME": INTERFACE,
                    "SPARDL_NETNS_HOSTS": ",".join(f"{net.address(n)}={net.namespace(n)}"
                                                   for n in range(net.size))})
        yield env


def _tx_bytes(net: EmulatedNetwork, node: int) -> int:
    out = subprocess.run(net.command(node, ["cat", f"/sys/class/net/{INTERFACE}/statistics/tx_bytes"]),
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def run(launcher: str, script: list[str], per_node: int = 2, rate: str = "10gbit",
        timeout: float = 300.0) -> Run:
    """Run `python SCRIPT` on 2 emulated nodes x per_node ranks under `launcher`. Raises
    RuntimeError when namespaces cannot be made here, subprocess.TimeoutExpired after
    `timeout` seconds (every launcher is killed first)."""
    why = available()
    if why:
        raise RuntimeError(f"two emulated nodes need network namespaces: {why}")
    with EmulatedNetwork(2, rate, interface_name=INTERFACE) as net, \
            ssh_to_nodes(net, launch_env()) as env:
        before = [_tx_bytes(net, node) for node in range(net.size)]
        procs: list[subprocess.Popen] = []
        try:
            for node, cmd in enumerate(commands(launcher, net, per_node, script)):
                procs.append(subprocess.Popen(on_node(net.namespace(node), cmd), cwd=ROOT,
                                              env=env, text=True, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, start_new_session=True))
            outputs = _communicate_all(procs, timeout)
        finally:
            for proc in procs:
                _kill(proc)
        sent = [_tx_bytes(net, node) - before[node] for node in range(net.size)]
    return Run([p.returncode for p in procs], [o for o, _ in outputs], [e for _, e in outputs], sent)


FAILED_NODE_GRACE_S = 30.0


def _kill(proc: subprocess.Popen) -> None:
    """Kill `proc` and its process group if it leads one (the launchers here do), then reap it."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Every process's (stdout, stderr), read at the same time. When one exits with an error
    the others get FAILED_NODE_GRACE_S to end too (a node waiting for a dead peer never would)
    and are then killed with their process groups (their workers hold the pipes), so a
    failure returns its output instead of waiting out `timeout`; subprocess.TimeoutExpired
    after `timeout` seconds (everything killed first)."""
    outputs: list[tuple[str, str]] = [("", "")] * len(procs)

    def read(i: int) -> None:
        outputs[i] = procs[i].communicate()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for reader in readers:
        reader.start()
    deadline, failed_at = time.monotonic() + timeout, None
    while any(reader.is_alive() for reader in readers):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + FAILED_NODE_GRACE_S):
            for proc in procs:
                _kill(proc)
            for reader in readers:
                reader.join(timeout=10)
            if now > deadline:
                raise subprocess.TimeoutExpired(procs[0].args, timeout)
            break
        time.sleep(0.2)
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", choices=LAUNCHERS, default="torchrun")
    parser.add_argument("--per-node", type=int, default=2, help="ranks per node")
    parser.add_argument("--rate", default="10gbit", help="each node's link, e.g. 1gbit")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="python script and its arguments")
    args = parser.parse_args(argv)
    if not args.script:
        parser.error("name the script to run, e.g. examples/ddp_comm_hook.py")
    result = run(args.launcher, args.script, args.per_node, args.rate)
    for node, (out, err) in enumerate(zip(result.stdout, result.stderr)):
        print(f"--- node {node}: exit {result.returncodes[node]}\n{out}{err}", end="")
    print(f"bytes sent by each node's {INTERFACE}: {result.tx_bytes}")
    return max(result.returncodes)


if __name__ == "__main__":
    sys.exit(main())
