"""The environment a pool rank starts with: what torchrun gives its workers, and a loopback network.

Libraries read torchrun's variables at start-up (DeepSpeed asserts LOCAL_RANK; many build their
own groups from MASTER_ADDR:MASTER_PORT), so every warm rank gets them from the parent, in the
environment it is started with, before anything imports and before the per-test isolation takes
its baseline (each test then starts from these values):

* RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE: a pool is one host, so LOCAL_RANK == RANK and
  LOCAL_WORLD_SIZE == WORLD_SIZE.
* MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True: a TCPStore the parent hosts on
  127.0.0.1 (`AgentStore`), as torchrun's agent hosts one, so `env://` clients connect to it.
* TORCH_NCCL_ASYNC_ERROR_HANDLING: torchrun's default (1) unless set: NCCL's watchdog aborts a
  collective stuck past the collective timeout and ends the rank, whose death fails the test.
* CUDA_VISIBLE_DEVICES (CUDA pools): the GPUs the pool reserved, so `cuda:{LOCAL_RANK}` is this
  rank's own GPU whichever physical GPUs the pool got.
* TORCH_FR_BUFFER_SIZE (and its older name TORCH_NCCL_TRACE_BUFFER_SIZE) and
  TORCH_NCCL_DUMP_ON_TIMEOUT=1 (CUDA pools, unless set): Flight Recorder keeps each rank's last
  2000 collectives and NCCL's watchdog dumps them when it fires, so a watchdog timeout leaves
  what `python -m harness.tools.flight_recorder` reads (torch writes the dumps to
  TORCH_FR_DUMP_TEMP_FILE's prefix, /tmp/nccl_trace_rank_ by default).
* GLOO_SOCKET_IFNAME: the loopback interface. Without it gloo resolves the host name for every
  process group it creates; on a host whose name is in no hosts file and whose resolver does not
  answer, each lookup waits the resolver timeout (10 s by default), per group, per test.

Not set: TORCHELASTIC_RUN_ID (a pytest started by a test would think it runs under torchrun) and
LOCAL_SIZE (it switches DeepSpeed to a shared-memory all-reduce).

The ranks themselves rendezvous through a FileStore in the pool's private directory (see
`harness.rank.worker`): a TCPStore client connects through an IPv4-mapped IPv6 address and reverse-
resolves it, which costs the same resolver timeout on such a host.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from harness.config.torchrun import LAUNCHED_BY_TORCHRUN, TorchrunWorld

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LOOPBACK_ADDR = "127.0.0.1"
_IFF_LOOPBACK = 0x8
_NOT_INHERITED = (LAUNCHED_BY_TORCHRUN, "LOCAL_SIZE")
FLIGHT_RECORDER_DEFAULTS = {
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # its name before torch 2.7
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
"""What a CUDA pool's ranks get unless the user set it: Flight Recorder on, dumped by the watchdog."""


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS and BSDs)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/flags") as handle:
                if int(handle.read(), 16) & _IFF_LOOPBACK:
                    return name
        except (OSError, ValueError):
            continue
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return "lo"


def session_environment(base: Mapping[str, str]) -> dict[str, str]:
    """`base` without what no rank may inherit (see the module doc: TORCHELASTIC_RUN_ID, LOCAL_SIZE)."""
    return {key: value for key, value in base.items() if key not in _NOT_INHERITED}


def rank_environment(
    base: Mapping[str, str],
    *,
    rank: int,
    world_size: int,
    master_port: int,
    cuda_devices: Sequence[str] | None = None,
    flight_recorder_prefix: str | None = None,
) -> dict[str, str]:
    """`base` with the torchrun contract of rank `rank` of a one-host world (see the module doc).

    `flight_recorder_prefix`: where the rank's Flight Recorder dump goes (`TORCH_FR_DUMP_TEMP_FILE`,
    the prefix torch appends the rank to) unless the user chose: the pool reads it after a test."""
    env = session_environment(base)
    env.update(TorchrunWorld(rank, local_rank=rank, world_size=world_size, local_world_size=world_size).environment())
    env.update(
        MASTER_ADDR=LOOPBACK_ADDR,
        MASTER_PORT=str(master_port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        GLOO_SOCKET_IFNAME=loopback_interface(),
    )
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if flight_recorder_prefix is not None:
        env.setdefault("TORCH_FR_DUMP_TEMP_FILE", flight_recorder_prefix)
    if cuda_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(cuda_devices)
        for name, value in FLIGHT_RECORDER_DEFAULTS.items():
            env.setdefault(name, value)
    return env


class AgentStore:
    """The TCPStore behind a pool's MASTER_ADDR:MASTER_PORT, listening on 127.0.0.1 only.

    The port is bound at once (so the ranks can be told it before they start); the store itself
    is built on a background thread, because building a TCPStore connects a client to it, and
    that connection can wait a resolver timeout (see the module doc) that the pool need not
    wait for: the ranks do not use this store, and a library's client that comes early is
    refused and retries until the store listens.
    """

    def __init__(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK_ADDR, 0))
        self.port: int = listener.getsockname()[1]
        self._store: dist.TCPStore | None = None
        self._listener: socket.socket | None = listener
        self._lock = threading.Lock()
        self._closed = False
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._serve, name=f"agent-store-{self.port}")
        self._thread.start()

    def _serve(self) -> None:
        # Nothing may escape this thread (it would reach stderr only, as a warning nobody reads):
        # a failure is kept in `failure`, and the pool fails the test that finds it (see
        # `harness.session.pool_session`) as a harness error naming it.
        listener = self._listener
        assert listener is not None
        try:
            store = _listening_store(listener, self.port)
        except Exception as error:  # noqa: BLE001 - every failure is reported, on the test
            with self._lock:
                self._failure = f"{type(error).__name__}: {error}"
            return
        finally:
            if listener.fileno() != -1:
                listener.close()
            self._listener = None
        with self._lock:
            if not self._closed:
                self._store = store
        # A pool closed meanwhile: `store` is dropped here, which stops its server.

    @property
    def failure(self) -> str | None:
        """Why the store could not be built ("ExceptionType: message"), or None (built, or still building)."""
        with self._lock:
            return self._failure

    def close(self) -> None:
        """Stop serving; a store still being built stops as soon as it is built."""
        with self._lock:
            self._closed = True
            self._store = None


def _listening_store(listener: socket.socket, port: int) -> dist.TCPStore:
    """A master TCPStore serving on `listener` (bound to LOOPBACK_ADDR:`port`), which it takes over.

    Which way works depends on the torch: the libuv server (the default from torch 2.4) takes a
    listening fd only from torch 2.7 on; before, it raises NotImplementedError, and the older
    server (`use_libuv=False`) takes the fd instead. A torch without `master_listen_fd` gets
    the port itself, freed just before: another process could take it in between, but only then.
    """
    try:
        store = dist.TCPStore(
            LOOPBACK_ADDR, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.fileno()
        )
    except NotImplementedError:
        store = dist.TCPStore(
            LOOPBACK_ADDR,
            port,
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
            use_libuv=False,
        )
    except TypeError:  # no master_listen_fd: free the port and let the store bind it
        listener.close()
        return dist.TCPStore(LOOPBACK_ADDR, port, is_master=True, wait_for_workers=False)
    listener.detach()  # the store closes the socket when it is destroyed
    return store
