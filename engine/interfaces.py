"""The network interfaces GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name, checked against this
node's before a process group starts: on a cluster that is not Olivia (no Slingshot hsn0),
the job scripts' defaults name interfaces the node does not have, and gloo and NCCL would
fail in a traceback per rank. One line instead, with the interfaces the node has.
"""

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

from engine.errors import UserError

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
DOCS = "docs/network.md, \"On another cluster\""


class NetworkSetupError(UserError):
    """An interface, rendezvous or port that the process group cannot use: exit 1, not requeued
    (the same job would fail the same way)."""

    exit_code = 1
    rank0_first = True


def node_interfaces(inet6=Path("/proc/net/if_inet6")):
    """{interface name: [IPv4 address, then IPv6 addresses]} of this node, in the kernel's
    order: gloo and NCCL use an interface only where it has an address of either family."""
    ipv6 = {}
    try:  # Linux: one line per address, "ADDRESS(32 hex digits) INDEX PREFIX SCOPE FLAGS NAME"
        for line in inet6.read_text().splitlines():
            fields = line.split()
            ipv6.setdefault(fields[-1], []).append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except (OSError, ValueError, IndexError):  # no IPv6, or not Linux: IPv4 alone
        pass
    found = {}
    for _, name in socket.if_nameindex():
        found[name] = ([address] if (address := ipv4_address(name)) else []) + ipv6.get(name, [])
    return found


def ipv4_address(name):
    """The IPv4 address of interface ``name``, or None (none assigned, or not readable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def nccl_selects(value, names):
    """The interfaces of ``names`` that NCCL_SOCKET_IFNAME=``value`` allows: a comma list of
    prefixes, ``=`` in front for exact names, ``^`` in front to exclude the listed ones."""
    exclude, value = value.startswith("^"), value.lstrip("^")
    exact, value = value.startswith("="), value.lstrip("=")
    listed = [part for part in value.split(",") if part]

    def matches(name):
        return any(name == part if exact else name.startswith(part) for part in listed)
    return [name for name in names if matches(name) != exclude]


def interface_problems(env, interfaces, uses_nccl):
    """(variable, value) pairs of ``env`` that name no usable interface of ``interfaces``: none
    of that name, or one without an address (gloo: "Unable to find address for: ifb0")."""
    problems = []
    usable = [name for name, addresses in interfaces.items() if addresses]
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo and any(part not in usable for part in gloo.split(",")):
        problems.append(("GLOO_SOCKET_IFNAME", gloo))
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if uses_nccl and nccl and not nccl_selects(nccl, usable):
        problems.append(("NCCL_SOCKET_IFNAME", nccl))
    return problems


def check_interfaces(env, uses_nccl, host=None):
    """Raise NetworkSetupError when GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME (in ``env``) name
    no interface of this node; the line lists the node's interfaces and what to set."""
    interfaces = node_interfaces()
    problems = interface_problems(env, interfaces, uses_nccl)
    if not problems:
        return
    host = host or socket.gethostname()
    have = listed(interfaces)
    routable = [name for name, addresses in interfaces.items() if addresses and name != "lo"]
    suggestion = routable[0] if routable else "lo"
    named = " and ".join(f"{variable}={value}" for variable, value in problems)
    raise NetworkSetupError(
        f"{named}: node {host} has no such interface with an address (it has: {have}); export "
        + " ".join(f"{variable}={suggestion}" for variable, _ in problems)
        + f" (an interface every node has) before sbatch, see {DOCS}", same_on_every_rank=False)


def listed(interfaces):
    """'lo 127.0.0.1, eth0 10.0.0.5 fe80::1, ib0 (no address)' of node_interfaces()."""
    return ", ".join(f"{name} {' '.join(addresses) or '(no address)'}" for name, addresses in interfaces.items())


def interfaces_line(env, interfaces, uses_nccl, host):
    """check_network.py --interfaces' line for a node whose variables passed check_interfaces:
    what they name, or, where none is set, who picks the interface instead."""
    variables = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")[:1 + uses_nccl]
    named = [f"{variable}={env[variable]}" for variable in variables if env.get(variable)]
    if named:
        return f"Interfaces of {host}: {', '.join(named)} found (it has: {listed(interfaces)})"
    nccl = ", NCCL its own choice" if uses_nccl else ""
    both = " and ".join(variables)
    return (f"Interfaces of {host}: {both} not set, so gloo uses the address this host name resolves to{nccl} "
            f"(it has: {listed(interfaces)}); set {both} to choose, see {DOCS}")
