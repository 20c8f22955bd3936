"""How long this host's name resolution makes a single-host gloo world wait.

gloo resolves the host name each time it creates a process group (unless GLOO_SOCKET_IFNAME names
an interface), and a TCPStore client reverse-resolves the address it connects through. On a host
whose name is in no hosts file and whose resolver does not answer, each lookup waits the resolver
timeout. This prints the lookups' times and then times a world of two gloo ranks creating process
groups, as gloo chooses its interface by default and bound to loopback (as harness pools are):

    PYTHONPATH=. python scripts/diagnose_network.py [--groups 3]

Slow lookups plus a slow default world and a fast loopback one: this host's network configuration
is what slows multi-process tests down; the harness's pools do not depend on it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta


def _timed(what: str, lookup) -> None:
    start = time.perf_counter()
    try:
        result = lookup()
    except OSError as error:
        result = f"failed: {error}"
    print(f"  {what}: {result} ({time.perf_counter() - start:.2f} s)", flush=True)


def _rank(rank: int, store_path: str, groups: int, spawned: float) -> None:
    # Imported here, not at the top: the parent's lookups and the ranks' start-up are timed apart.
    start = time.perf_counter()
    python_start = time.time() - spawned
    import torch
    import torch.distributed as dist

    imported = time.perf_counter()
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    for _ in range(groups):
        group = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(1), group=group)
    worked = time.perf_counter()
    dist.destroy_process_group()
    if rank == 0:
        print(
            f"    rank 0: python start {python_start:.2f} s, import torch {imported - start:.2f} s, "
            f"init + {groups} new_group/all_reduce {worked - imported:.2f} s, "
            f"destroy {time.perf_counter() - worked:.2f} s",
            flush=True,
        )


def _world(groups: int, interface: str | None) -> None:
    env = dict(os.environ)
    env.pop("GLOO_SOCKET_IFNAME", None)
    if interface is not None:
        env["GLOO_SOCKET_IFNAME"] = interface
    label = f"GLOO_SOCKET_IFNAME={interface}" if interface else "gloo's default interface (host name)"
    print(f"  world of 2 ranks, {label}:", flush=True)
    with tempfile.TemporaryDirectory(prefix="diagnose-network-") as directory:
        store_path = os.path.join(directory, "store")
        start = time.perf_counter()
        ranks = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank", str(rank), store_path, str(groups), repr(time.time())], env=env
            )
            for rank in range(2)
        ]
        codes = [rank.wait(timeout=900) for rank in ranks]
    print(f"    exit codes {codes}, wall {time.perf_counter() - start:.2f} s", flush=True)


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--rank":
        _rank(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
        return
    from harness.process.rank_env import loopback_interface

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3, help="process groups each world creates (default 3)")
    args = parser.parse_args()
    hostname = socket.gethostname()
    print(f"host name {hostname!r}, loopback interface {loopback_interface()!r}", flush=True)
    _timed("getaddrinfo(host name)", lambda: socket.getaddrinfo(hostname, None)[0][4][0])
    _timed("getnameinfo(127.0.0.1)", lambda: socket.getnameinfo(("127.0.0.1", 0), 0)[0])
    _timed("getnameinfo(::ffff:127.0.0.1)", lambda: socket.getnameinfo(("::ffff:127.0.0.1", 0, 0, 0), 0)[0])
    _world(args.groups, None)
    _world(args.groups, loopback_interface())


if __name__ == "__main__":
    main()
