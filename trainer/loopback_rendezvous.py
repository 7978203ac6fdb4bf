"""A single-machine rendezvous for torch's elastic agent whose store listens on 127.0.0.1 only.

torch's stores accept no authentication, so a run on one machine should not listen on any other
interface. The "c10d" rendezvous binds its store to every interface; this handler, registered with
torch elastic's rendezvous registry under `LOOPBACK_BACKEND`, hosts one `TCPStore` in the launching
process on a socket it bound to 127.0.0.1 itself (`master_listen_fd`), so no other interface is ever
opened and no port can be taken between choosing and binding it. `use_agent_store` is True: the
agent tells the workers (TORCHELASTIC_USE_AGENT_STORE) to join that same store as clients, so the
launching process's store is the only listening socket of the rendezvous. The store outlives
restarts of the worker group; each restart's process group keys live under their own prefix (see
`process_group.init_process_group_from_env`).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

__all__ = ["LOOPBACK_BACKEND", "LoopbackRendezvous", "register"]

#: The rendezvous backend name under which `LoopbackRendezvous` is registered.
LOOPBACK_BACKEND = "syncline-loopback"


class LoopbackRendezvous(RendezvousHandler):
    """One node (this machine), one store on 127.0.0.1, shared by the agent and its workers.

    Args:
        run_id: the launch's id; the agent's own keys live under it.
        timeout: seconds a store operation may wait.
    """

    def __init__(self, run_id: str, timeout: float = 1800.0) -> None:
        self._run_id = run_id
        self._timeout = timedelta(seconds=timeout)
        self._store: dist.TCPStore | None = None
        self._closed = False

    def get_backend(self) -> str:
        return LOOPBACK_BACKEND

    @property
    def use_agent_store(self) -> bool:
        # Workers join this store as clients instead of rank 0 opening a second one.
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """Return this node as rank 0 of 1, with the loopback store (created on the first call)."""
        if self._store is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))  # loopback only: nothing off this machine can reach the store
            listener.listen(128)
            port = listener.getsockname()[1]
            # The store takes over the pre-bound socket, so no other interface is opened and no port race exists.
            self._store = dist.TCPStore(
                "127.0.0.1",
                port,
                None,
                True,
                timeout=self._timeout,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
        store_info = RendezvousStoreInfo("127.0.0.1", self._store.port)
        return RendezvousInfo(dist.PrefixStore(self._run_id, self._store), 0, 1, store_info)

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node: nobody else ever joins

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        """Close the store (and so its socket)."""
        self._closed = True
        self._store = None
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(f"The {LOOPBACK_BACKEND} rendezvous runs one node; got max_nodes={params.max_nodes}.")
    return LoopbackRendezvous(params.run_id, float(params.config.get("timeout", 1800.0)))


def register() -> None:
    """Register `LoopbackRendezvous` with torch elastic's rendezvous registry (idempotent)."""
    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create)
