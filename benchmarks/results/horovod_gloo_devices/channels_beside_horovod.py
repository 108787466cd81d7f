"""Time 300 small hvd.allreduce calls beside N gloo groups (the record of README.md here).

    horovodrun -np 3 -H localhost:3 --gloo python channels_beside_horovod.py N MODE

MODE: none, pg (ProcessGroupGloo groups, a device each), pgshared (the groups on one device),
group (the library's HorovodTransport channels), store (rendezvous stores only), threads
(idle threads only).
"""
import sys
import threading
import time
from datetime import timedelta

import horovod.torch as hvd
import torch
import torch.distributed as dist

MODES = ("none", "pg", "pgshared", "group", "store", "threads")


def store_of_rank0(label: str) -> dist.TCPStore:
    """A TCPStore served by rank 0, its port sent to the others through Horovod."""
    if hvd.rank() == 0:
        store = dist.TCPStore("0.0.0.0", 0, hvd.size(), True, timedelta(seconds=30),
                              wait_for_workers=False)
        port = torch.tensor([store.port])
    else:
        port = torch.tensor([0])
    port = hvd.broadcast(port, 0, name=label)
    if hvd.rank() != 0:
        store = dist.TCPStore("127.0.0.1", int(port), hvd.size(), False, timedelta(seconds=30))
    return store


def open_beside(n: int, mode: str) -> list:
    """What MODE opens, n times; kept alive by the caller."""
    keep: list = []
    if mode == "group":
        from spardl_grace.transport.horovod import HorovodTransport
        keep = [HorovodTransport(timeout=60) for _ in range(n)]
    elif mode == "store":
        keep = [store_of_rank0(f"port{i}") for i in range(n)]
    elif mode in ("pg", "pgshared"):
        store = store_of_rank0("pgport")
        shared = dist.ProcessGroupGloo.create_default_device()
        for i in range(n):
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timedelta(seconds=30)
            options._devices = [shared if mode == "pgshared"
                                else dist.ProcessGroupGloo.create_default_device()]
            keep.append(dist.ProcessGroupGloo(dist.PrefixStore(f"g{i}", store), hvd.rank(),
                                              hvd.size(), options))
        keep.append(store)
    elif mode == "threads":
        never = threading.Event()
        for _ in range(n):
            thread = threading.Thread(target=never.wait, daemon=True)
            thread.start()
            keep.append(thread)
    return keep


def main() -> None:
    n, mode = int(sys.argv[1]), sys.argv[2]
    if mode not in MODES:
        raise SystemExit(f"MODE {mode!r}: valid choices are {', '.join(MODES)}")
    hvd.init()
    torch.set_num_threads(1)
    keep = open_beside(n, mode)
    start = time.time()
    for i in range(300):
        hvd.allreduce(torch.ones(4), name=f"u{i}")
    print(f"rank {hvd.rank()} {mode} x{n}: 300 ops in {time.time() - start:.1f}s "
          f"({len(keep)} objects open)", flush=True)


if __name__ == "__main__":
    main()
