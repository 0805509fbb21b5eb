"""Addresses the launcher's stores listen on (standard library only).

A store listens on one address, never on every interface: anyone who reaches its port can read
and write any key. A single-node job (``--standalone``, or one node whose rendezvous/master
address is a loopback one) listens on loopback only, so no other machine can reach it. A job of
several nodes listens on ``--local-addr``, else on the address of the interface that routes to
the rendezvous host (the address the other nodes reach this one at).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

__all__ = [
    "interface_of",
    "is_local_address",
    "is_loopback",
    "is_wildcard",
    "listen_address",
    "route_address",
]

_WILDCARDS = ("", "0.0.0.0", "::", "*")


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface."""
    return host in _WILDCARDS


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ``::1``), or ``localhost`` when
    every address it resolves to is one."""
    if host == "localhost":
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return False
        return bool(infos) and all(is_loopback(info[4][0]) for info in infos)
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one can bind a socket to it)."""
    if is_loopback(host) or is_wildcard(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def route_address(host: str, port: int) -> str:
    """The address of this machine's interface that routes to ``host`` (a UDP ``connect``
    picks the route; no packet is sent).

    Raises:
        OSError: ``host`` cannot be resolved or has no route.
    """
    error: OSError | None = None
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)
                return sock.getsockname()[0]
        except OSError as exc:
            error = exc
    raise error or OSError(f"no route to {host}")


def listen_address(
    rdzv_host: str, rdzv_port: int, *, single_node: bool, local_addr: str | None
) -> str:
    """The address this agent's stores listen on, and advertise to its workers.

    Args:
        rdzv_host: the rendezvous (or, static backend, master) host.
        rdzv_port: its port (``0``: standalone).
        single_node: whether the job has at most one node.
        local_addr: ``--local-addr``, which wins when given.

    Raises:
        OSError: no route to ``rdzv_host`` (a job of several nodes without ``--local-addr``).
    """
    if local_addr:
        return local_addr
    if single_node and (rdzv_port == 0 or is_loopback(rdzv_host) or is_wildcard(rdzv_host)):
        # "localhost" stays a name (torchrun's MASTER_ADDR); it binds its loopback address
        return rdzv_host if is_loopback(rdzv_host) else "127.0.0.1"
    if single_node:
        return rdzv_host
    routed = route_address(rdzv_host, rdzv_port)
    if is_loopback(routed):
        # the rendezvous host is this machine under a loopback alias (Debian's /etc/hosts maps
        # the own hostname to 127.0.1.1): the other nodes reach it at one of its other
        # addresses, if the name has one
        for info in socket.getaddrinfo(rdzv_host, None, type=socket.SOCK_STREAM):
            addr = info[4][0]
            if not is_loopback(addr) and is_local_address(addr):
                return addr
    return routed


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(addr: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 address ``addr``
    (``None``: no such interface, not an IPv4 address, or not Linux).

    Gloo picks its interface by name (``GLOO_SOCKET_IFNAME``); without one it binds the
    address the hostname resolves to, which a Debian ``/etc/hosts`` maps to 127.0.1.1 --
    loopback, unreachable from the other nodes.
    """
    try:
        wanted = ipaddress.IPv4Address(addr)
    except ValueError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
            except OSError:
                continue  # no IPv4 address on it
            if ipaddress.IPv4Address(raw[20:24]) == wanted:
                return name
    return None
