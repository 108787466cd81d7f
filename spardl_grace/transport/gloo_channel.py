"""A private gloo process group for the library's messages, opened beside a launcher whose
own operations are collective only (Horovod).

The group is a torch.distributed ProcessGroupGloo used directly, never registered with
torch.distributed: `torch.distributed.is_initialized()` stays False and the user's own
process groups are untouched. Rank 0 serves the rendezvous store on a free port; its address
reaches the other ranks through the launcher's own broadcast, so nothing needs configuring.

Every channel of a process shares one gloo device (its listening socket and event-loop
thread): measured beside Horovod on 2 cores, each extra device slowed Horovod's own gloo
collectives (a job of 300 small all-reduces among 3 ranks: 11-12 s with no channel, 31 s and
over 100 s with six channels on devices of their own, 10-14 s with six sharing one), and jobs
with five channels had Horovod's background loop time out (30 s) in the user's own Horovod
ops between backward() and step().
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .base import Transport

#: seconds to reach rank 0's store and to connect the group's pairs
CONNECT_TIMEOUT_S = 60.0
_ADDRESS_BYTES = 256
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
# The gloo device every channel of this process uses, per interface (None: the host name's).
_DEVICES: dict[str | None, Any] = {}
_DEVICES_LOCK = threading.Lock()


class GlooChannel:
    """Point-to-point messages and collectives among the ranks of a private gloo group."""

    def __init__(
        self, group: dist.ProcessGroupGloo, store: dist.Store, timeout: float, device: Any
    ):
        # torch's stubs lack the backend's send and recv, which ProcessGroupGloo has.
        self.group: Any = group
        self._store = store  # rank 0 serves it; kept for as long as the group lives
        self._timeout = timeout
        self.device = device  # the process's shared gloo device (shared_device)

    def post(self, kind: str, tensor: torch.Tensor, peer: int):
        """Post one receive ('recv') or send ('send') of a contiguous CPU tensor."""
        if kind == "recv":
            return self.group.recv([tensor], peer, 0)
        return self.group.send([tensor], peer, 0)

    def allreduce(self, tensor: torch.Tensor):
        """Sum a contiguous CPU tensor in place over the group."""
        return self.group.allreduce([tensor])

    def allgather(self, parts: list[torch.Tensor], tensor: torch.Tensor):
        """Every rank's `tensor` (all of one size) into `parts`, in rank order."""
        return self.group.allgather([parts], [tensor])

    def broadcast(self, tensor: torch.Tensor, root: int):
        """Root's `tensor` into everyone's, in place."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        return self.group.broadcast([tensor], options)

    def allow(self, timeout: float) -> None:
        """Let gloo's own timeout be at least `timeout` seconds (the caller bounds each wait)."""
        if timeout > self._timeout:
            self.group.set_timeout(timedelta(seconds=timeout))
            self._timeout = timeout


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def _interface() -> str | None:
    """The interface horovodrun chose for gloo (HOROVOD_GLOO_IFACE), else GLOO_SOCKET_IFNAME."""
    return os.environ.get("HOROVOD_GLOO_IFACE") or os.environ.get("GLOO_SOCKET_IFNAME") or None


def _own_address() -> str:
    """The address the other ranks reach this host at: the launcher's interface's, else the
    host name's as horovodrun wrote it (HOROVOD_HOSTNAME), else this host's name's."""
    interface = _interface()
    if interface:
        try:
            return interface_address(interface)
        except OSError:
            pass
    return socket.gethostbyname(os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())


def shared_device(interface: str | None) -> Any:
    """This process's gloo device on `interface` (None: the one the host name resolves to),
    made on first use; a device serves any number of groups, each with its own pairs."""
    with _DEVICES_LOCK:
        device = _DEVICES.get(interface)
        if device is None:
            gloo: Any = dist.ProcessGroupGloo
            device = (
                gloo.create_device(interface=interface)
                if interface
                else gloo.create_default_device()
            )
            _DEVICES[interface] = device
        return device


def _encode(text: str) -> torch.Tensor:
    data = text.encode()[:_ADDRESS_BYTES]
    out = torch.zeros(_ADDRESS_BYTES, dtype=torch.uint8)
    out[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return out


def _decode(data: torch.Tensor) -> str:
    return bytes(data.tolist()).rstrip(b"\0").decode()


def _all_ok(transport: Transport, ok: bool, name: str, connect: timedelta) -> bool:
    """Whether every rank is ok. A rank that failed at once waits here while the others may
    still be connecting for up to `connect`: its wait is longer by that much."""
    timeout = transport.timeout
    transport.timeout = timeout + connect.total_seconds()
    try:
        flags = transport.allreduce(torch.tensor([int(ok)], dtype=torch.int64), name)
    finally:
        transport.timeout = timeout
    return int(flags.item()) == transport.size


def open_gloo_channel(transport: Transport, label: str) -> GlooChannel | None:
    """Open a gloo channel among `transport`'s ranks, using only its broadcast and allreduce.
    Collective: every rank calls it. Returns None on every rank, after a warning on each rank
    that saw why, when any rank could not join (an unreachable address, a closed port), so
    that the ranks never disagree on how they send."""
    rank, size = transport.rank, transport.size
    connect = timedelta(seconds=min(transport.timeout, CONNECT_TIMEOUT_S))
    store: dist.Store | None = None
    reason = ""
    where = _encode("")
    if rank == 0:
        try:
            store = dist.TCPStore("0.0.0.0", 0, size, True, connect, wait_for_workers=False)
            where = _encode(f"{_own_address()}:{store.port}")
        except (OSError, RuntimeError) as exc:
            reason = f"rank 0 could not serve the rendezvous store: {exc}"
    address = _decode(transport.broadcast(where, 0, f"{label}.address"))
    if rank != 0 and address:
        host, _, port = address.rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), size, False, connect)
        except (OSError, RuntimeError) as exc:
            reason = f"rank {rank} could not reach rank 0's store at {address}: {exc}"
    group = device = None
    if _all_ok(transport, store is not None, f"{label}.store", connect):
        assert store is not None  # this rank reached the store, as every rank did
        gloo: Any = dist.ProcessGroupGloo  # its _Options are not in torch's stubs
        options = gloo._Options()
        options._timeout = connect
        try:
            device = shared_device(_interface())
            options._devices = [device]
            group = dist.ProcessGroupGloo(dist.PrefixStore(label, store), rank, size, options)
        except RuntimeError as exc:
            reason = f"rank {rank} could not connect the gloo group: {exc}"
    if not _all_ok(transport, group is not None, f"{label}.group", connect):
        if reason or rank == 0:
            warnings.warn(
                f"spardl_grace: no gloo channel beside the launcher "
                f"({reason or 'another rank could not join'}); point-to-point messages go "
                "through the launcher's own collectives, which cost more per message; under "
                "Horovod, give your own ops between backward() and step() a name "
                "(hvd.allreduce(t, name=...)), since an unnamed one can meet the library's "
                "and wait without end",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    assert group is not None and store is not None  # this rank joined, as every rank did
    group.set_timeout(timedelta(seconds=transport.timeout))
    return GlooChannel(group, store, transport.timeout, device)
