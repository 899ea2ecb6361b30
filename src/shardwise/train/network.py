"""This machine's network as a rank sees it: which address and interface lead to the rendezvous.

Used by the launcher (launch/rendezvous.py: the address node 0 publishes as MASTER_ADDR) and by every worker
(train/distributed.py: the interface gloo binds). Both questions have one answer: the route the kernel
takes towards the rendezvous host. The host name's own resolution, which torch uses when nobody says
otherwise, is often a loopback address (/etc/hosts maps it to 127.0.1.1 on Debian and Ubuntu, to
127.0.0.1 in many containers); across machines that makes each node dial itself.
"""
from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import MutableMapping
from pathlib import Path

# gloo's own variable (torch reads it whenever it creates a gloo group): the interface its pairs bind.
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address


def source_address(host: str, port: int | None = None) -> str | None:
    """This machine's source address for reaching `host` (a UDP connect sends nothing: the kernel only
    picks the route), loopback included; None when `host` does not resolve or has no route."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        infos = socket.getaddrinfo(host, port or 29400, family, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return s.getsockname()[0].split("%")[0]
    except OSError:
        return None


def is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr.split("%")[0]).is_loopback


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds `addr` (IPv4: each interface's address; IPv6: /proc/net/if_inet6)."""
    ip = ipaddress.ip_address(addr.split("%")[0])
    if ip.version == 6:
        try:
            lines = Path("/proc/net/if_inet6").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == ip:
                return fields[5]
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(answer[20:24]) == str(ip):
                return name
    return None


def pin_gloo_interface(environ: MutableMapping[str, str], rendezvous: str | None = None) -> str | None:
    """Bind gloo to the interface this rank reaches the rendezvous (`rendezvous`, else MASTER_ADDR)
    through, unless the user chose one (GLOO_SOCKET_IFNAME); returns the interface set, or None when
    nothing was changed.

    gloo's default is the interface of the host name's address: where that is a loopback address, every
    rank publishes 127.x.y.z and the ranks of other nodes time out dialling themselves (the group never
    forms). On one node MASTER_ADDR is a loopback address and gloo stays on loopback; on several it is
    node 0's address and gloo uses the network that reaches it, as the rendezvous did. NCCL picks its
    own interfaces; this concerns gloo groups only (all of a CPU job's, and the control group on GPUs)."""
    host = rendezvous or environ.get("MASTER_ADDR")
    if environ.get(GLOO_IFNAME) or not host:
        return None
    addr = source_address(host)
    name = interface_of(addr) if addr else None
    if name:
        environ[GLOO_IFNAME] = name
    return name
