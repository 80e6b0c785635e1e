"""NCCL and the network, for a run with a process group: the start-up block's report (the NCCL
library that is loaded, the network variables in effect, the multi-node settings missing:
``network_report``), and which network NCCL chose, read from its own log (NCCL_DEBUG=INFO,
subsystems INIT and NET): the aws-ofi-nccl (Libfabric) plugin over Slingshot's cxi provider,
or plain TCP sockets when the plugin was not found. check_network.py writes one log per rank
and reports from them.
"""

import ctypes
import os
import re
from typing import NamedTuple

import torch

from engine.log import rank_list

# The multi-node reference figures, all-reduce of 64 MB between two 4-GH200 nodes (CSCS Alps):
SLINGSHOT_BUSBW_GBPS = 100  # aws-ofi-nccl over Slingshot: ~108 GB/s (1.1 ms)
SOCKETS_BUSBW_GBPS = 5  # NCCL's plain TCP sockets: ~5.4 GB/s
TCP_PROVIDERS = ("tcp", "sockets", "udp")  # libfabric providers that are TCP/UDP, not Slingshot's cxi
NEEDED_SUBSYSTEMS = ("INIT", "NET")  # where NCCL logs its version and its choice of network


# HPE's recommended settings for NCCL over Slingshot between GH200 nodes, and the LL128
# workaround for NVIDIA/nccl issue 2001 (see README).
MULTINODE_SETTINGS = {
    "FI_PROVIDER": "cxi", "FI_CXI_RX_MATCH_MODE": "hybrid", "FI_MR_CACHE_MONITOR": "userfaultfd",
    "FI_CXI_DISABLE_HOST_REGISTER": "1", "FI_CXI_DEFAULT_CQ_SIZE": "131072", "FI_CXI_DEFAULT_TX_SIZE": "2048",
    "FI_CXI_RDZV_PROTO": "alt_read", "FI_CXI_RDZV_EAGER_SIZE": "0", "FI_CXI_RDZV_THRESHOLD": "0",
    "FI_CXI_RDZV_GET_MIN": "0", "NCCL_CROSS_NIC": "1", "NCCL_NET_GDR_LEVEL": "PHB",
    "NCCL_SOCKET_IFNAME": "hsn0,hsn1,hsn2,hsn3", "NCCL_PROTO": "^LL128", "GLOO_SOCKET_IFNAME": "hsn0",
}


def nccl_version_name(code: int) -> str:
    """ncclGetVersion's integer as "major.minor.patch" (NCCL_VERSION_CODE: X*10000 + Y*100 + Z
    since NCCL 2.9, X*1000 + Y*100 + Z before)."""
    major, rest = divmod(code, 10000) if code >= 20900 else divmod(code, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def loaded_library(name: str, maps: str) -> str | None:
    """Path of the shared library ``name``.so (or ``name``.so.2, .so.2.21.5, ...) in a
    /proc/PID/maps text. Exactly that name: libnccl-net.so (the aws-ofi-nccl plugin, mapped
    in the same process) and libnccl-tuner.so are not libnccl."""
    pattern = re.compile(re.escape(name) + r"\.so(\.\d+)*")
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
        if len(fields) == 6 and pattern.fullmatch(os.path.basename(fields[5])):
            return fields[5]
    return None


def nccl_report() -> str:
    """The NCCL that runs, not only the one PyTorch was built against: multinode_job.sh puts
    the host's NCCL first on the library path, and the LL128 corruption (NVIDIA/nccl issue
    2001) depends on the version that is loaded. Asks the loaded library (ncclGetVersion)."""
    built = torch.cuda.nccl.version()  # a tuple in recent PyTorch, an int in old ones
    built = ".".join(map(str, built)) if isinstance(built, tuple) else str(built)
    try:
        with open("/proc/self/maps") as f:
            path = loaded_library("libnccl", f.read())
    except OSError:
        path = None
    if path is None:
        return f"NCCL version: {built} (linked into PyTorch)"
    try:
        code = ctypes.c_int()
        ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code))
        loaded = nccl_version_name(code.value)
    except (OSError, AttributeError):
        loaded = "unknown"
    return f"NCCL version: {loaded}, loaded from {path} (PyTorch was built with {built})"


def network_report(ctx, environ=None) -> list:
    """Lines for rank 0 to print at start: NCCL version, network variables in effect, and a
    warning for each recommended multi-node setting that is missing."""
    environ = os.environ if environ is None else environ
    lines = []
    if ctx.device.type == "cuda":
        lines.append(nccl_report())
    in_effect = [f"{name}={environ[name]}" for name in sorted(environ)
                 if name.startswith(("NCCL_", "FI_", "GLOO_", "TORCH_NCCL_", "TORCH_FR_"))
                 or name in ("MASTER_ADDR", "MASTER_PORT")]
    lines.append("Network settings: " + (" ".join(in_effect) or "none"))
    if ctx.num_nodes > 1:
        missing = [name for name in MULTINODE_SETTINGS if name not in environ]
        if missing:
            lines.append(f"WARNING: multi-node run without the recommended settings {', '.join(missing)} "
                         "(see README: without NCCL_PROTO=^LL128 NCCL can silently corrupt gradients "
                         "between GH200 nodes)")
    return lines


class NcclLog(NamedTuple):
    """What one rank's NCCL log says about the network (None: not in the log)."""

    version: str | None = None  # "2.21.5"; NCCL logs it on the rank that creates the communicator's ID
    network: str | None = None  # "AWS Libfabric", "Socket", "IB", ...: the last "Using network" line
    plugin: str | None = None  # "aws-ofi-nccl 1.13.0"
    provider: str | None = None  # libfabric's provider: "cxi" on Slingshot, "tcp" ...
    plugin_failure: str | None = None  # why no network plugin was loaded
    socket_interfaces: str | None = None  # "hsn0:10.1.2.3": what NCCL's sockets use
    warnings: tuple = ()  # NCCL WARN messages
    missing: str | None = None  # why there is no log to read


def parse_nccl_log(text: str) -> NcclLog:
    """What NCCL's log (NCCL_DEBUG=INFO) says about the network: its version, the network
    ("Using network X"), the aws-ofi-nccl plugin and libfabric provider, why a plugin failed
    to load, the interfaces of its sockets, its warnings."""
    found = {}
    warnings = []
    for line in text.splitlines():
        match = re.search(r"NCCL (INFO|WARN) (.*)$", line)
        message = match.group(2).strip() if match else line.strip()
        if match and match.group(1) == "WARN":
            warnings.append(message)
        if (version := re.search(r"NCCL version (\d+\.\d+\.\d+)", message)) and "version" not in found:
            found["version"] = version.group(1)
        if network := re.search(r"Using network (.+)$", message):
            found["network"] = network.group(1).strip()
        if plugin := re.search(r"NET/OFI (?:Initializing|Using) (aws-ofi-nccl \S+)", message):
            found["plugin"] = plugin.group(1)
        if provider := re.search(r"NET/OFI Selected [Pp]rovider is ([^,\s]+)", message):
            found["provider"] = provider.group(1)
        if (message.startswith("NET/Plugin") and "CollNet" not in message
                and re.search(r"Could not find|No plugin found|Plugin load returned|cannot open", message)
                and "plugin_failure" not in found):
            found["plugin_failure"] = message.split(":", 1)[1].strip() if ":" in message else message
        if interfaces := re.match(r"NET/Socket ?: Using (\[\d+\].*)$", message):
            found["socket_interfaces"] = ", ".join(re.sub(r"^\[\d+\]|<\d+>$", "", part)
                                                   for part in interfaces.group(1).split())
    return NcclLog(warnings=tuple(warnings[:3]), **found)


def network_kind(log: NcclLog) -> str:
    """'libfabric' (aws-ofi-nccl), 'socket' (NCCL's TCP sockets), 'ib', 'other' or 'unknown'."""
    name = (log.network or "").lower()
    if not name:
        return "unknown"
    if "libfabric" in name or name == "ofi" or log.plugin:
        return "libfabric"
    return "socket" if name == "socket" else "ib" if name.startswith("ib") else "other"


def describe_nccl_network(log: NcclLog) -> str:
    kind = network_kind(log)
    if kind == "unknown":
        return f"unknown ({log.missing or 'no Using network line in NCCL log'})"
    if kind == "libfabric":
        return (f"{log.network} ({log.plugin or 'aws-ofi-nccl'} plugin, provider {log.provider or 'not logged'})")
    if kind == "socket":
        return "Socket (plain TCP" + (f" over {log.socket_interfaces})" if log.socket_interfaces else ")")
    return f"{log.network} (InfiniBand verbs)" if kind == "ib" else log.network


def network_label(backend: str, logs: list) -> str:
    """The network in a few words, for an error line: 'gloo over TCP', 'NCCL on Socket (plain TCP)'."""
    if backend != "nccl":
        return "gloo over TCP"
    described = {describe_nccl_network(log) for log in logs}
    return f"NCCL on {described.pop()}" if len(described) == 1 else "NCCL on different networks per rank"


def describe_network(backend: str, logs: list, num_nodes: int, environ) -> list:
    """Lines for rank 0: the network NCCL chose on each rank (``logs``: one NcclLog per rank),
    with a WARNING when a multi-node run does not use Slingshot; for gloo, its sockets."""
    if backend != "nccl":
        interface = environ.get("GLOO_SOCKET_IFNAME")
        return ["Network (gloo): TCP sockets between the processes, " +
                (f"over GLOO_SOCKET_IFNAME={interface}" if interface else
                 "over the interface of the host's name (GLOO_SOCKET_IFNAME chooses one)")]
    groups = {}
    for rank, log in enumerate(logs):
        groups.setdefault(describe_nccl_network(log), []).append(rank)
    if len(groups) == 1:
        chosen = f"{next(iter(groups))} on all {len(logs)} ranks"
    else:
        chosen = "; ".join(f"{what} on ranks {rank_list(ranks)}" for what, ranks in groups.items())
    sockets = [rank for rank, log in enumerate(logs) if network_kind(log) == "socket"]
    failure = next((log.plugin_failure for log in logs if log.plugin_failure), None)
    why = f"plugin not found: {failure}" if failure else "the aws-ofi-nccl plugin was not loaded"
    if num_nodes == 1:
        lines = [f"Network (NCCL): not used between the GPUs of one node (NVLink/P2P); between nodes NCCL "
                 f"would use {chosen}" + (f" ({why})" if sockets else "")]
    else:
        lines = [f"Network (NCCL): {chosen}"]
        if sockets:
            lines.append(f"WARNING: NCCL uses plain TCP sockets between nodes on ranks {rank_list(sockets)}, not "
                         f"Slingshot ({why}): expect ~{SOCKETS_BUSBW_GBPS} GB/s busbw instead of "
                         f"~{SLINGSHOT_BUSBW_GBPS}; check HOST_NCCL_PATH and LD_LIBRARY_PATH (see docs/network.md)")
        tcp = [rank for rank, log in enumerate(logs) if network_kind(log) == "libfabric"
               and (log.provider or "").split(";")[0].lower() in TCP_PROVIDERS]
        if tcp:
            lines.append(f"WARNING: libfabric's provider on ranks {rank_list(tcp)} is {logs[tcp[0]].provider}, TCP "
                         f"rather than Slingshot's cxi: expect sockets' speed; check FI_PROVIDER, "
                         "HOST_LIBFABRIC_LIB_PATH and HOST_CXI_LIB_PATH (see docs/network.md)")
    warned = sorted({warning for log in logs for warning in log.warnings})
    if warned:
        lines.append("NCCL warnings: " + " | ".join(warned[:3]))
    return lines


# NCCL's last error when NCCL_NET names a network it cannot open, which PyTorch's error carries
# after "Last error:": "Error: network X not found." (src/net.cc, NCCL up to 2.2x); "Failed to
# initialize any NET plugin" (plugin/net.cc, NCCL 2.28.9 under torch 2.11 on an H200, 2026-11-26),
# which does not name the network: NCCL_NET's value does.
NETWORK_REFUSED = re.compile(r"Error: network (.*?) not found|Failed to initialize any NET plugin")


def refused_network(text: str, host: str, nccl_net: str | None = None) -> str | None:
    """The line for an NCCL that did not start on ``host`` because NCCL_NET (multinode_job.sh
    sets "AWS Libfabric"; ``nccl_net``: the variable's value) names a network it cannot open:
    the plugin did not load. None for any other error ``text``."""
    match = NETWORK_REFUSED.search(text)
    network = (match[1] or nccl_net) if match else None
    if network is None:
        return None
    return (f"NCCL_NET={network}: NCCL cannot open this network on {host}: the aws-ofi-nccl plugin "
            "(lib/libnccl-net.so of HOST_NCCL_PATH, with the host's libfabric and libcxi) did not load, and NCCL_NET stops the job here "
            f"instead of letting NCCL fall back to TCP sockets (~{SOCKETS_BUSBW_GBPS} instead of "
            f"~{SLINGSHOT_BUSBW_GBPS} GB/s); check HOST_NCCL_PATH, HOST_LIBFABRIC_LIB_PATH and HOST_CXI_LIB_PATH, "
            "or export another NCCL_NET before sbatch (see docs/network.md)")


def nccl_debug_file(template: str, host: str, pid: int) -> str:
    """NCCL_DEBUG_FILE's name for this process: NCCL replaces %h (the host name up to its
    first dot) and %p (the process ID)."""
    return template.replace("%h", host.split(".")[0]).replace("%p", str(pid))


def nccl_log_settings(environ, directory: str) -> dict:
    """The variables that make NCCL log its choice of network: into ``directory``/nccl.log
    unless the user chose a NCCL_DEBUG_FILE (theirs is read then, and kept), at level INFO
    at least (TRACE is kept), with the INIT and NET subsystems added to the user's own."""
    settings = {} if "NCCL_DEBUG_FILE" in environ else {"NCCL_DEBUG_FILE": os.path.join(directory, "nccl.log")}
    if environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        settings["NCCL_DEBUG"] = "INFO"
    subsystems = environ.get("NCCL_DEBUG_SUBSYS")
    if subsystems is None:
        settings["NCCL_DEBUG_SUBSYS"] = ",".join(NEEDED_SUBSYSTEMS)
    elif subsystems.startswith("^"):  # all but these: the needed ones must not be among them
        kept = [s for s in subsystems[1:].split(",") if s and s.upper() not in NEEDED_SUBSYSTEMS]
        settings["NCCL_DEBUG_SUBSYS"] = "^" + ",".join(kept) if kept else "ALL"
    else:
        chosen = [s for s in subsystems.split(",") if s]
        if "ALL" not in (s.upper() for s in chosen):
            missing = [s for s in NEEDED_SUBSYSTEMS if s not in (c.upper() for c in chosen)]
            settings["NCCL_DEBUG_SUBSYS"] = ",".join(chosen + missing)
    return {name: value for name, value in settings.items() if environ.get(name) != value}


def read_nccl_log(path: str) -> NcclLog:
    try:
        with open(path, errors="replace") as f:
            log = parse_nccl_log(f.read())
    except OSError as err:
        return NcclLog(missing=f"cannot read NCCL's log {path}: {err.strerror}")
    return log if log.network else log._replace(missing=f"no 'Using network' line in {path}; NCCL_DEBUG=INFO "
                                                        "and NCCL_DEBUG_SUBSYS=INIT,NET write it")


