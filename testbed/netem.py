"""A bandwidth-limited cluster network on one machine: one network namespace per rank.

    with EmulatedNetwork(size=4, rate="1gbit") as net:
        subprocess.run(net.command(rank, ["python", ...]))      # runs inside rank's namespace
        net.address(0)                                          # '10.77.x.1', rank 0's address

Every rank gets a namespace with a veth pair to a bridge in the root namespace (a switch with
one port per node). Both ends of each veth are shaped by tc tbf to `rate`, so a rank sends at
most `rate` and receives at most `rate` (a full-duplex NIC), and the switch is not a
bottleneck. This kernel has no netem, so no latency can be added: the per-message cost alpha is
what the stack itself costs, and larger latencies belong in the cost model
(benchmarks.costmodel). Needs root (CAP_NET_ADMIN) and iproute2; everything is removed on exit,
also after an error.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

_networks = itertools.count()
RATE = re.compile(r"^\d+(\.\d+)?(kbit|mbit|gbit)$")
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits_per_s(rate: str) -> float:
    """'1gbit' -> 1e9. Raises ValueError naming the valid form."""
    if not RATE.match(rate):
        raise ValueError(f"bad rate {rate!r}; use a number and one of kbit, mbit, gbit (e.g. 1gbit)")
    number, unit = re.match(r"^([\d.]+)(\w+)$", rate).groups()
    return float(number) * UNITS[unit]


def rate_change(text: str) -> tuple[int, str]:
    """'40:100mbit' (a link reshaped to a rate at a step) -> (40, '100mbit'). Raises
    ValueError naming the valid form."""
    step, _, rate = text.partition(":")
    rate_bits_per_s(rate)
    if not step.isdigit():
        raise ValueError(f"STEP must be a step number >= 0, got {step!r}")
    return int(step), rate


def burst_bytes(bits_per_s: float) -> int:
    """The tbf bucket of a link shaped to `bits_per_s`: 10 ms of traffic, at least 64 KiB. An
    idle link passes this many bytes at the veth's own speed before the rate applies."""
    return max(64 * 1024, int(bits_per_s / 8 / 100))


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"sdprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def rank_env(rank: int, size: int, port: int, base: dict[str, str], master: str = "127.0.0.1",
             interface: str | None = None) -> dict[str, str]:
    """torch.distributed's env:// variables for one of `size` local ranks (loopback unless a
    master address and gloo interface are given)."""
    env = dict(base, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
               MASTER_PORT=str(port), MASTER_ADDR=master)
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
    return env


def reshape_own_link(rate: str) -> None:
    """Shape what this process's namespace sends (its gloo interface, GLOO_SOCKET_IFNAME) to
    `rate` from now on, as EmulatedNetwork shaped it at the start: every rank calling it at
    the same step makes the emulated link change its rate mid-run. RuntimeError when not on
    an emulated network (or tc fails)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    if not name or not Path(f"/sys/class/net/{name}").exists():
        raise RuntimeError("not on an emulated network: no GLOO_SOCKET_IFNAME interface here")
    bits = rate_bits_per_s(rate)
    _run("tc", "qdisc", "change", "dev", name, "root", "tbf", "rate", rate,
         "burst", str(burst_bytes(bits)), "latency", "100ms")


def interface_tx_bytes() -> int | None:
    """Bytes this process's namespace has sent through its gloo interface (GLOO_SOCKET_IFNAME):
    what crossed the emulated link, headers included. None when not on an emulated network."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    path = Path(f"/sys/class/net/{name}/statistics/tx_bytes") if name else None
    if path is None or not path.exists():
        return None
    return int(path.read_text())


def run_all(cmds: list[list[str]], envs: list[dict[str, str]], cwd: str | Path,
            timeout: float | None = None, stream: int | None = None) -> None:
    """Run the processes to completion. When one fails (or `timeout` seconds pass) the others
    are killed and RuntimeError carries every process's last output. `stream`: the index of
    a process whose output goes to this terminal instead of being captured."""
    logs = [None if i == stream else tempfile.TemporaryFile() for i in range(len(cmds))]
    procs = [subprocess.Popen(c, cwd=cwd, env=e, stdout=log,
                              stderr=None if log is None else subprocess.STDOUT)
             for c, e, log in zip(cmds, envs, logs)]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or \
                    (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(0.2)
    finally:
        stop(procs)
    if any(p.returncode != 0 for p in procs):
        tails = []
        for i, log in enumerate(logs):
            text = "(printed above)"
            if log is not None:
                log.seek(0)
                text = log.read().decode(errors="replace")[-3000:]
            tails.append(f"--- process {i} (exit {procs[i].returncode}):\n{text}")
        raise RuntimeError("workers failed\n" + "\n".join(tails))


def stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """End the processes still running: SIGTERM first, so that one holding an emulated network
    removes its namespaces, then SIGKILL after `grace_s` seconds."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


class EmulatedNetwork:
    """`size` namespaces on a bridge, every link shaped to `rate` (see the module docstring)."""

    def __init__(self, size: int, rate: str, interface_name: str | None = None):
        """interface_name: rename every namespace's interface to it (as every node of a
        cluster has its eth0), for launchers that select interfaces by a name common to all."""
        if not 1 <= size <= 250:
            raise ValueError(f"size must be 1..250, got {size}")
        self.size = size
        self.rate = rate
        self.bits_per_s = rate_bits_per_s(rate)
        # Unique per network, not only per process: a namespace's veth can outlive the
        # namespace's deletion for a moment, and the next network must not collide with it.
        tag = (os.getpid() + 997 * next(_networks)) % 10000
        self.prefix = f"sd{tag}"
        self.subnet = f"10.77.{tag % 250}"
        self.bridge = f"{self.prefix}br"
        self.interface_name = interface_name
        self._made: list[str] = []

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}n{rank}"

    def interface(self, rank: int) -> str:
        """The rank's interface inside its namespace (for GLOO_SOCKET_IFNAME)."""
        return self.interface_name or f"{self.prefix}r{rank}"

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def command(self, rank: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def rank_env(self, rank: int, port: int, base: dict[str, str]) -> dict[str, str]:
        """torch.distributed's env:// variables for `rank`, with gloo bound to the rank's
        shaped interface and rank 0's address as the master."""
        return rank_env(rank, self.size, port, base, self.address(0), self.interface(rank))

    def __enter__(self) -> "EmulatedNetwork":
        why = available()
        if why:
            raise RuntimeError(f"cannot emulate a network here: {why}")
        try:
            _run("ip", "link", "add", "name", self.bridge, "type", "bridge")
            self._made.append("bridge")
            _run("ip", "link", "set", self.bridge, "up")
            burst = str(burst_bytes(self.bits_per_s))
            tbf = ["root", "tbf", "rate", self.rate, "burst", burst, "latency", "100ms"]
            for rank in range(self.size):
                ns, inside, outside = self.namespace(rank), self.interface(rank), f"{self.prefix}h{rank}"
                created = f"{self.prefix}r{rank}"   # unique in the root namespace, where it is made
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
                _run("ip", "link", "add", outside, "type", "veth", "peer", "name", created)
                _run("ip", "link", "set", created, "netns", ns)
                if inside != created:
                    _run("ip", "-n", ns, "link", "set", created, "name", inside)
                _run("ip", "link", "set", outside, "master", self.bridge, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", inside)
                _run("ip", "-n", ns, "link", "set", inside, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("tc", "qdisc", "add", "dev", outside, *tbf)
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inside, *tbf)
            self._write_hosts()
        except BaseException:
            self.close()
            raise
        return self

    def _write_hosts(self) -> None:
        """Every namespace's name resolves to its address inside the namespaces, as node names
        do on a cluster: `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts, which
        it extends."""
        own = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        names = "".join(f"{self.address(r)} {self.namespace(r)}\n" for r in range(self.size))
        for rank in range(self.size):
            folder = Path("/etc/netns") / self.namespace(rank)
            self._made.append(f"hosts:{folder}")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(own.rstrip("\n") + "\n" + names)

    def close(self) -> None:
        """Remove what was made (deleting a namespace deletes its veth pair)."""
        for item in reversed(self._made):
            if item.startswith("hosts:"):
                shutil.rmtree(item[len("hosts:"):], ignore_errors=True)
            elif item == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", item], capture_output=True)
        self._made.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
