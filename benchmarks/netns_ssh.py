#!/usr/bin/env python3
"""A stand-in for ssh that "logs in" to an emulated node by entering its network namespace.

    SPARDL_NETNS_HOSTS="10.77.5.1=sd5n0,10.77.5.2=sd5n1" netns_ssh.py [ssh options] HOST CMD...

mpirun (its rsh launcher) and horovodrun reach other nodes by running `ssh HOST COMMAND`; put a
file named `ssh` that runs this first on PATH (benchmarks.twonode does) and they reach the
namespaces of testbed.netem instead. As ssh does, it joins the command words with spaces and
runs them with `sh -c` on the node (under the node's own hostname), in a fresh login-like
environment: only PATH, HOME, the locale and (for root runs) Open MPI's run-as-root switches
cross, so whatever else a remote rank needs must be forwarded by the launcher, as on a real
cluster (mpirun -x, horovodrun's own export). ssh's options are accepted and ignored.
"""
import os
import shutil
import sys

# ssh options that take a value (the others are flags).
OPTIONS_WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")
CROSSES = ("PATH", "HOME", "LANG", "LC_ALL", "OMPI_ALLOW_RUN_AS_ROOT",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def _skip_options(argv: list[str], i: int) -> int:
    """The index of the first word at or after i that is not an ssh option or its value."""
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        takes_value = len(argv[i]) == 2 and argv[i][1] in OPTIONS_WITH_VALUE
        i += 2 if takes_value else 1
    return i + 1 if i < len(argv) and argv[i] == "--" else i


def parse(argv: list[str]) -> tuple[str, list[str]]:
    """(host, command words) from ssh's arguments; user@ prefixes are dropped. Options may
    also follow the host, as OpenSSH allows (horovodrun puts -o ConnectTimeout there)."""
    i = _skip_options(argv, 0)
    if i >= len(argv):
        raise SystemExit("netns_ssh: no host given")
    host = argv[i].rsplit("@", 1)[-1]
    return host, argv[_skip_options(argv, i + 1):]


def on_node(namespace: str, argv: list[str], ip: str = "ip") -> list[str]:
    """`argv` run on the emulated node `namespace`: in its network namespace, and in a UTS
    namespace of its own whose hostname is the namespace's name. Launchers tell nodes apart by
    hostname: Open MPI takes ranks with the same hostname for one node and would connect them
    by shared memory."""
    return [ip, "netns", "exec", namespace, "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', namespace, *argv]


def main() -> None:
    host, words = parse(sys.argv[1:])
    hosts = dict(item.split("=", 1) for item in os.environ.get("SPARDL_NETNS_HOSTS", "").split(",") if item)
    if host not in hosts:
        raise SystemExit(f"netns_ssh: unknown host {host!r}; known: {', '.join(sorted(hosts)) or 'none'} "
                         "(SPARDL_NETNS_HOSTS)")
    env = {k: os.environ[k] for k in CROSSES if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    ip = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")
    if ip is None:
        raise SystemExit("netns_ssh: iproute2's ip is not installed")
    os.execve(ip, on_node(hosts[host], ["sh", "-c", " ".join(words) or "true"], ip), env)


if __name__ == "__main__":
    main()
