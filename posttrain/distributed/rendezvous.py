"""torch.distributed's rendezvous for a group that spans machines: a TCP store at rank 0's node address.

torch's TCPStore, left to itself, listens on every interface of rank 0's machine; here rank 0 binds the
listening socket to the address Ray gives its node and hands it to the store, so the store answers on
that address only. The collectives' own sockets (gloo, NCCL) use the interface holding each node's address
(`pin_socket_interface` in worker_group)."""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

STORE_TIMEOUT_S = 300.0  # how long a rank waits for the others to arrive
_listeners: list[socket.socket] = []  # rank 0's listening sockets: the stores serve on them for life


def bound_tcp_store(master_addr: str, master_port: int, rank: int, world_size: int) -> dist.TCPStore:
    """Rank 0: a store listening on `master_addr:master_port` only; the others: its clients."""
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in master_addr else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((master_addr, master_port))
    except OSError as error:
        listener.close()
        raise RuntimeError(
            f"rank 0 cannot listen on {master_addr}:{master_port} for the rendezvous ({error.strerror}): "
            "another process holds the port; pick a free range with cluster.master_port_range"
        ) from error
    listener.listen(128)
    store = dist.TCPStore(
        master_addr, master_port, world_size, True, timeout=timeout, master_listen_fd=listener.fileno()
    )
    _listeners.append(listener)
    return store
