"""check_network.py: its pure pieces (sizes, bandwidths, the exact check of a result, NCCL's
log), and real runs under torchrun with 2 CPU processes (gloo): the table, a corrupted result
(the CHECK_NETWORK_FAULT test hook) and a network below --min-busbw, each one line."""

import os
import re
import signal
import socket
from pathlib import Path

import pytest
import torch

import check_network as cn
from engine import bandwidth, exact_sums, nccl_log
from engine import log as run_log
import device_utils
from engine import errors
from engine.interfaces import NetworkSetupError
from engine.lost_ranks import process_group_scope
from engine.processes import DistContext
from conftest import clean_env, descendants, error_lines, run, run_main, start, torchrun_cmd, wait_for

SMALL = ("--max-size", "64K", "--iters", "3", "--warmup-iters", "1")  # 7 sizes x 4 all-reduces: seconds
TABLE_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+ [KMG]?i?B)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+|n/a)\s+(\d+)$")

# NCCL 2.21 in a container without the host's NCCL and plugin: TCP sockets, on hsn0.
SOCKET_LOG = """\
x1000c0s0b0n0:51234:51234 [0] NCCL INFO Bootstrap : Using hsn0:10.1.2.3<0>
x1000c0s0b0n0:51234:51234 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.
x1000c0s0b0n0:51234:51234 [0] NCCL INFO cudaDriverVersion 12080
x1000c0s0b0n0:51234:51234 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
x1000c0s0b0n0:51234:51290 [0] NCCL INFO Failed to open libibverbs.so[.1]
x1000c0s0b0n0:51234:51290 [0] NCCL INFO NET/Socket : Using [0]hsn0:10.1.2.3<0> [1]hsn1:10.1.2.4<0>
x1000c0s0b0n0:51234:51290 [0] NCCL INFO Using non-device net plugin version 0
x1000c0s0b0n0:51234:51290 [0] NCCL INFO Using network Socket
x1000c0s0b0n0:51234:51290 [0] NCCL INFO ncclCommInitRank comm 0x55d0c8a0 rank 0 nranks 8 cudaDev 0 nvmlDev 0 \
busId 901000 commId 0x5e2b7c1d9a3f4e21 - Init START
"""

# The host's NCCL with aws-ofi-nccl bound in (multinode_job.sh): Libfabric on Slingshot's cxi.
OFI_LOG = """\
x1000c0s0b0n1:61234:61234 [2] NCCL INFO NCCL version 2.23.4+cuda12.6
x1000c0s0b0n1:61234:61290 [2] NCCL INFO NET/Plugin: Failed to find ncclCollNetPlugin_v9 symbol.
x1000c0s0b0n1:61234:61290 [2] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v9)
x1000c0s0b0n1:61234:61290 [2] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.13.0
x1000c0s0b0n1:61234:61290 [2] NCCL INFO NET/OFI Using Libfabric version 1.22
x1000c0s0b0n1:61234:61290 [2] NCCL INFO NET/OFI Using CUDA driver version 12080 with runtime 12060
x1000c0s0b0n1:61234:61290 [2] NCCL INFO NET/OFI Selected Provider is cxi (found 4 nics)
x1000c0s0b0n1:61234:61290 [2] NCCL INFO NET/OFI Using transport protocol SENDRECV
x1000c0s0b0n1:61234:61290 [2] NCCL INFO Using network AWS Libfabric
x1000c0s0b0n1:61234:61290 [2] NCCL INFO NCCL_PROTO set by environment to ^LL128
"""


def test_sizes_are_bytes_doubling_from_min_to_max():
    assert [bandwidth.parse_size(text) for text in ("1K", "64M", "1G", "256MiB", "4096", "2kb")] == [
        1024, 64 * 2**20, 2**30, 256 * 2**20, 4096, 2048]
    for bad in ("0", "1T", "-4", "abc", "6", "1.5K"):
        with pytest.raises(Exception, match="is not a"):
            bandwidth.parse_size(bad)
    default = bandwidth.message_sizes(bandwidth.parse_size("1K"), bandwidth.parse_size("256M"))
    assert len(default) == 19 and default[0] == 1024 and default[-1] == 2**28
    assert all(b == 2 * a for a, b in zip(default, default[1:]))
    assert bandwidth.message_sizes(1024, 3072) == [1024, 2048, 3072]  # the size asked for is the last one
    assert bandwidth.message_sizes(4096, 4096) == [4096]
    assert [bandwidth.human_size(n) for n in (12, 1024, 1536, 2**26, 2**30)] == ["12 B", "1 KiB", "1.5 KiB", "64 MiB",
                                                                           "1 GiB"]


def test_bandwidths_are_nccl_tests_definitions():
    # CSCS's figure: 64 MiB between two 4-GH200 nodes in 1.1 ms.
    algbw, busbw = bandwidth.bandwidths(2**26, 1.1e-3, 8)
    assert algbw == pytest.approx(2**26 / 1.1e-3 / 1e9) and algbw == pytest.approx(61.0, abs=0.1)
    assert busbw == pytest.approx(algbw * 2 * 7 / 8) and busbw == pytest.approx(106.8, abs=0.1)
    assert bandwidth.bandwidths(1000, 1e-6, 2) == (pytest.approx(1.0), pytest.approx(1.0))  # 2(n-1)/n = 1
    assert bandwidth.bandwidths(1000, 1e-6, 1) == (pytest.approx(1.0), None)  # one process sends nothing
    row = cn.table_row(cn.SizeResult(2**26, 1.1e-3, algbw, None, 0))
    assert TABLE_ROW.match(row).groups() == ("67108864", "64 MiB", "16777216", "1100.0", "61.01", "n/a", "0")


def test_sums_stay_exact_in_float32_up_to_the_largest_world_size():
    world = exact_sums.max_world_size()
    period, sum_of_ranks = exact_sums.PERIOD, exact_sums.sum_of_ranks
    assert world > 1000 and period * sum_of_ranks(world) < 2**24 <= period * sum_of_ranks(world + 1)
    values = exact_sums.pattern(4 * exact_sums.PERIOD, "cpu")
    total = torch.zeros_like(values)
    for rank in range(world):  # the additions in one order (float32 like the all-reduce)
        total += values * float(rank + 1)
    assert torch.equal(total, values * float(exact_sums.sum_of_ranks(world)))


def test_check_result_counts_and_locates_wrong_elements():
    expected = exact_sums.pattern(1000, "cpu") * 3.0
    assert exact_sums.check_result(expected.clone(), expected).tolist() == [0.0, 0.0, 3.0, 3.0]
    got = expected.clone()
    got[17], got[500] = 13.0, 0.0  # element 17 should be 3 * ((17 % 7) + 1) = 12
    assert exact_sums.check_result(got, expected).tolist() == [2.0, 17.0, 13.0, 12.0]
    checks = [exact_sums.check_result(expected, expected).tolist(), exact_sums.check_result(got, expected).tolist()]
    assert exact_sums.mismatches(3, checks) == [exact_sums.Mismatch(rank=3, iteration=2, wrong=2, index=17, got=13.0,
                                                                   expected=12.0)]


def test_a_wrong_result_is_one_line_naming_size_iterations_and_ranks():
    found = [exact_sums.Mismatch(2, 3, 1024, 17, 12.0, 36.0), exact_sums.Mismatch(3, 3, 512, 40, 0.0, 36.0),
             exact_sums.Mismatch(3, 9, 1, 5, 1.0, 2.0)]
    hosts = ["nid001"] * 2 + ["nid002"] * 2
    message = exact_sums.mismatch_message(2**26, 2**24, 25, found, hosts)
    assert message.startswith("all-reduce of 64 MiB gave wrong values in iterations [3, 9] of 25 on ranks [2, 3] "
                              "(host nid002) (1024 of 16777216 elements on rank 2 in iteration 3, e.g. element 17: "
                              "got 12.0, expected 36.0)")
    assert " on ranks [1, 2] (hosts nid001, nid002) " in exact_sums.mismatch_message(
        4, 1, 1, [exact_sums.Mismatch(1, 1, 1, 0, 0.0, 3.0), exact_sums.Mismatch(2, 1, 1, 0, 0.0, 3.0)], hosts)
    assert "\n" not in message
    assert run_log.rank_list([0, 1, 2, 3, 8]) == "[0-3, 8]" and run_log.rank_list([5]) == "[5]"


def test_buffers_that_cannot_be_allocated_are_one_line_with_the_bytes_asked_for():
    """The allocator's message was cut at 120 characters, inside the byte count on the CPU. A
    size beyond any address space (2**46 float32 values) fails at once, whatever the overcommit."""
    with pytest.raises(errors.UserError) as raised:
        cn.allocate(2**46, device_utils.single_process_context("cpu"))
    assert re.fullmatch(r"cannot allocate 3 buffers of \S+ GiB on cpu \(.*you tried to allocate 281474976710656 "
                        r"bytes\.\): choose a smaller --max-size", str(raised.value)), str(raised.value)
    cuda = ("CUDA out of memory. Tried to allocate 16.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
            "1.25 GiB is free. Including non-PyTorch memory, this process has 77.84 GiB memory in use.")
    assert errors.first_sentences(RuntimeError(cuda)) == ("CUDA out of memory. Tried to allocate 16.00 GiB. GPU 0 "
                                                         "has a total capacity of 79.10 GiB of which 1.25 GiB is free.")
    assert errors.first_sentences(RuntimeError("x" * 300)) == "x" * 300  # one sentence: whole


def test_the_fault_hook_is_parsed_strictly():
    assert cn.parse_fault(None) is None and cn.parse_fault("") is None
    assert cn.parse_fault("1:4K:2") == cn.Fault(rank=1, nbytes=4096, iteration=2)
    with pytest.raises(errors.UserError, match="is not RANK:SIZE:ITERATION"):
        cn.parse_fault("1:4K")


def test_nccl_log_on_sockets():
    log = nccl_log.parse_nccl_log(SOCKET_LOG)
    assert log.version == "2.21.5" and log.network == "Socket" and nccl_log.network_kind(log) == "socket"
    assert log.plugin_failure == "Could not find: libnccl-net.so. Using internal network plugin."
    assert log.socket_interfaces == "hsn0:10.1.2.3, hsn1:10.1.2.4" and log.provider is None
    assert nccl_log.describe_nccl_network(log) == "Socket (plain TCP over hsn0:10.1.2.3, hsn1:10.1.2.4)"


def test_nccl_log_on_the_ofi_plugin():
    log = nccl_log.parse_nccl_log(OFI_LOG)
    assert (log.version, log.network, log.plugin, log.provider) == ("2.23.4", "AWS Libfabric", "aws-ofi-nccl 1.13.0",
                                                                    "cxi")
    assert log.plugin_failure is None  # the CollNet symbol is optional, not a failure
    assert nccl_log.describe_nccl_network(log) == "AWS Libfabric (aws-ofi-nccl 1.13.0 plugin, provider cxi)"


@pytest.mark.parametrize("text, network, provider, plugin", [
    # aws-ofi-nccl 1.6 (NCCL 2.18 era) and the newest (1.17: "Libfabric", provider and fabric)
    ("h:1:2 [0] NCCL INFO NET/OFI Using aws-ofi-nccl 1.6.0\n"
     "h:1:2 [0] NCCL INFO NET/OFI Selected Provider is cxi (found 2 nics)\n"
     "h:1:2 [0] NCCL INFO Using network AWS Libfabric\n", "AWS Libfabric", "cxi", "aws-ofi-nccl 1.6.0"),
    ("h:1:2 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v11)\n"
     "h:1:2 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.17.2\n"
     "h:1:2 [0] NCCL INFO NET/OFI Selected provider is cxi, fabric is cxi (found 4 nics)\n"
     "h:1:2 [0] NCCL INFO Using network Libfabric\n", "Libfabric", "cxi", "aws-ofi-nccl 1.17.2"),
    ("[0] NCCL INFO Using network OFI\n", "OFI", None, None),  # older plugins' name
])
def test_nccl_log_of_other_plugin_versions(text, network, provider, plugin):
    log = nccl_log.parse_nccl_log(text)
    kind = nccl_log.network_kind(log)
    assert (log.network, log.provider, log.plugin, kind) == (network, provider, plugin, "libfabric")


def test_sockets_between_nodes_are_a_plain_warning():
    socket_log, ofi_log = nccl_log.parse_nccl_log(SOCKET_LOG), nccl_log.parse_nccl_log(OFI_LOG)
    lines = nccl_log.describe_network("nccl", [socket_log] * 8, 2, {})
    assert lines[0] == "Network (NCCL): Socket (plain TCP over hsn0:10.1.2.3, hsn1:10.1.2.4) on all 8 ranks"
    assert lines[1] == ("WARNING: NCCL uses plain TCP sockets between nodes on ranks [0-7], not Slingshot (plugin "
                        "not found: Could not find: libnccl-net.so. Using internal network plugin.): expect ~5 GB/s "
                        "busbw instead of ~100; check HOST_NCCL_PATH and LD_LIBRARY_PATH (see docs/network.md)")
    assert nccl_log.describe_network("nccl", [ofi_log] * 8, 2, {}) == [
        "Network (NCCL): AWS Libfabric (aws-ofi-nccl 1.13.0 plugin, provider cxi) on all 8 ranks"]
    mixed = nccl_log.describe_network("nccl", [ofi_log] * 4 + [socket_log] * 4, 2, {})
    assert mixed[0].startswith("Network (NCCL): AWS Libfabric (aws-ofi-nccl 1.13.0 plugin, provider cxi) on ranks "
                               "[0-3]; Socket (plain TCP over ") and mixed[0].endswith("on ranks [4-7]")
    assert mixed[1].startswith("WARNING: NCCL uses plain TCP sockets between nodes on ranks [4-7]")
    one_node = nccl_log.describe_network("nccl", [socket_log] * 4, 1, {})
    assert len(one_node) == 1 and "WARNING" not in one_node[0]
    assert one_node[0].startswith("Network (NCCL): not used between the GPUs of one node (NVLink/P2P); between nodes "
                                  "NCCL would use Socket (plain TCP")
    tcp = nccl_log.parse_nccl_log(OFI_LOG.replace("Provider is cxi", "Provider is tcp;ofi_rxm"))
    assert nccl_log.describe_network("nccl", [tcp] * 8, 2, {})[1].startswith(
        "WARNING: libfabric's provider on ranks [0-7] is tcp;ofi_rxm, TCP rather than Slingshot's cxi")
    unknown = nccl_log.NcclLog(missing="no 'Using network' line in /tmp/x/nccl.log")
    assert nccl_log.describe_network("nccl", [unknown] * 2, 2, {}) == [
        "Network (NCCL): unknown (no 'Using network' line in /tmp/x/nccl.log) on all 2 ranks"]
    assert nccl_log.describe_network("gloo", [None] * 2, 2, {"GLOO_SOCKET_IFNAME": "hsn0"}) == [
        "Network (gloo): TCP sockets between the processes, over GLOO_SOCKET_IFNAME=hsn0"]


def test_a_forced_network_nccl_cannot_open_is_one_line_naming_nccl_net():
    """NCCL_NET="AWS Libfabric" (multinode_job.sh) without the plugin loaded: NCCL refuses to
    start, in PyTorch's words around NCCL's own; the line names the setting and what to check."""
    pytorch_error = ("NCCL error in: /opt/pytorch/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "
                     "invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.27.3\nncclInvalidUsage: "
                     "This usually reflects invalid usage of NCCL library.\nLast error:\nError: network AWS "
                     "Libfabric not found.")
    line = nccl_log.refused_network(pytorch_error, "x1000c0s0b0n1")
    assert line.startswith("NCCL_NET=AWS Libfabric: NCCL cannot open this network on x1000c0s0b0n1: the aws-ofi-nccl "
                           "plugin (lib/libnccl-net.so of HOST_NCCL_PATH")
    assert "fall back to TCP sockets (~5 instead of ~100 GB/s)" in line and "\n" not in line
    assert nccl_log.refused_network("NCCL error in: ..., unhandled system error, NCCL version 2.27.3", "n1") is None
    # NCCL 2.28.9 under torch 2.11 (an H200, 2026-11-26, NCCL_NET="No Such Network"): NCCL_NET's value names it.
    newer = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with NCCL_DEBUG"
             "=WARN for details), NCCL version 2.28.9\nncclInvalidUsage: This usually reflects invalid usage of NCCL "
             "library.\nLast error:\nFailed to initialize any NET plugin")
    assert nccl_log.refused_network(newer, "n1", "AWS Libfabric").startswith("NCCL_NET=AWS Libfabric: NCCL cannot open")
    bare = newer.replace("Failed to initialize any NET plugin", "Duplicate GPU detected")  # invalid usage, not NCCL_NET
    assert nccl_log.refused_network(bare, "n1", "AWS Libfabric") is None
    assert nccl_log.refused_network(newer, "n1", None) is None
    # Where NCCL's communicator is made at the first collective instead of at start-up:
    with pytest.raises(NetworkSetupError, match="^NCCL_NET=AWS Libfabric: NCCL cannot open this network on "):
        with process_group_scope(DistContext(device=torch.device("cpu")), 1.0):
            raise RuntimeError(pytorch_error)


def test_nccl_logs_into_a_private_file_unless_the_user_chose_one():
    assert nccl_log.nccl_log_settings({}, "/tmp/d") == {"NCCL_DEBUG_FILE": "/tmp/d/nccl.log", "NCCL_DEBUG": "INFO",
                                                  "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    assert nccl_log.nccl_log_settings({"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "ALL"}, "/tmp/d") == {
        "NCCL_DEBUG_FILE": "/tmp/d/nccl.log"}
    # The user's file is read (and kept), at a level and with subsystems that log the network.
    assert nccl_log.nccl_log_settings({"NCCL_DEBUG_FILE": "/x/nccl.%h.%p"}, "/tmp/d") == {
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    settings = nccl_log.nccl_log_settings
    assert settings({"NCCL_DEBUG_FILE": "/x/f", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "COLL"},
                    "/tmp/d") == {"NCCL_DEBUG_SUBSYS": "COLL,INIT,NET"}
    assert settings({"NCCL_DEBUG_FILE": "/x/f", "NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "^NET,P2P"},
                    "/tmp/d") == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "^P2P"}
    assert nccl_log.nccl_debug_file("/x/nccl.%h.%p.log", "nid001234.olivia.sigma2.no",
                                    4242) == "/x/nccl.nid001234.4242.log"


def test_read_nccl_log_names_what_is_missing(tmp_path):
    assert nccl_log.read_nccl_log(str(tmp_path / "none.log")).missing.startswith("cannot read NCCL's log ")
    (tmp_path / "quiet.log").write_text("")
    assert nccl_log.read_nccl_log(str(tmp_path / "quiet.log")).missing.startswith("no 'Using network' line in ")
    (tmp_path / "nccl.log").write_text(OFI_LOG)
    assert nccl_log.read_nccl_log(str(tmp_path / "nccl.log")).provider == "cxi"


def test_the_nccl_version_is_libnccl_not_the_ofi_plugin():
    """/proc/self/maps of a process with the host's NCCL and aws-ofi-nccl (libnccl-net.so) loaded:
    the plugin, mapped first here, is not libnccl."""
    maps = ("7f00-7f10 r-xp 00000000 08:01 11 /opt/nccl/lib/libnccl-net.so\n"
            "7f10-7f18 r-xp 00000000 08:01 12 /opt/nccl/lib/libnccl-tuner.so.1\n"
            "7f20-7f30 r-xp 00000000 08:01 34 /opt/nccl/lib/libnccl.so.2.21.5\n")
    assert nccl_log.loaded_library("libnccl", maps) == "/opt/nccl/lib/libnccl.so.2.21.5"
    assert nccl_log.loaded_library("libnccl", maps.splitlines()[0]) is None
    for name in ("libnccl.so", "libnccl.so.2"):
        assert nccl_log.loaded_library("libnccl", f"7f-8f r-xp 0 08:01 1 /usr/lib/{name}\n") == f"/usr/lib/{name}"


@pytest.mark.parametrize("args, message", [
    (("--max-size", "1T"), "argument --max-size: '1T' is not a size in bytes such as 4096, 1K, 64M or 1G"),
    (("--min-size", "6"), "argument --min-size: '6' is not a whole number of float32 elements (a multiple of 4 "
                          "bytes)"),
    (("--min-size", "1M", "--max-size", "1K"), "--min-size 1 MiB is larger than --max-size 1 KiB"),
    (("--iters", "0"), "argument --iters: '0' is not a positive integer"),
    (("--warmup-iters", "-1"), "argument --warmup-iters: '-1' is not an integer >= 0"),
    (("--min-busbw", "fast"), "argument --min-busbw: 'fast' is not a positive number"),
])
def test_a_bad_flag_is_one_line(capsys, args, message):
    assert run_main("check_network.py", *args) == 2
    assert error_lines(capsys.readouterr().err) == [f"check_network.py: error: {message} (see --help)"]


def test_without_torchrun_it_says_how_to_start_it(capsys):
    assert run_main("check_network.py") == 2
    assert capsys.readouterr().err == ("error: check_network.py must be started by torchrun, e.g. python "
                                       "tools/torchrun.py --standalone --nproc_per_node=4 check_network.py\n")


def table(stdout):
    return [TABLE_ROW.match(line).groups() for line in stdout.splitlines() if TABLE_ROW.match(line)]


@pytest.mark.oldest_torch
def test_two_processes_print_the_table_and_pass(tmp_path):
    result = run(torchrun_cmd(2, "check_network.py", *SMALL), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Backend: gloo, world size 2 (1 node x 2 processes per node)" in out
    assert "Network (gloo): TCP sockets between the processes" in out
    rows = table(out)
    assert [int(r[0]) for r in rows] == [1024 * 2**k for k in range(7)]
    assert [r[1] for r in rows] == ["1 KiB", "2 KiB", "4 KiB", "8 KiB", "16 KiB", "32 KiB", "64 KiB"]
    for size, _, count, time_us, algbw, busbw, wrong in rows:
        assert int(count) == int(size) // 4 and wrong == "0"
        assert 0 < float(time_us) < 5e6  # under 5 s per all-reduce of 64 KiB on loopback
        assert float(algbw) == pytest.approx(int(size) / float(time_us) / 1e3, abs=0.006)
        assert busbw == algbw  # 2(n-1)/n = 1 for 2 processes
    assert out.splitlines()[-2] == "Repeated: 100 more all-reduces of 64 KiB, every element checked: exact"
    verdict = re.fullmatch(r"Network check passed: 7 sizes x \(1\+3\) all-reduces exact; busbw at 64 KiB: "
                           r"([\d.]+) GB/s \(slowest rank; ([\d.]+) GB/s from the mean over ranks, as nccl-tests "
                           r"reports it\)", out.splitlines()[-1])
    assert verdict[1] == rows[-1][5] and float(verdict[2]) >= float(verdict[1])  # the mean is never slower
    assert "Traceback" not in out + result.stderr and "deprecat" not in (out + result.stderr).lower()
    assert not error_lines(result.stderr)


def test_one_process_has_no_busbw(tmp_path):
    result = run(torchrun_cmd(1, "check_network.py", "--max-size", "2K", "--iters", "2"), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [r[5] for r in table(result.stdout)] == ["n/a", "n/a"]
    assert result.stdout.splitlines()[-1] == ("Network check passed: 2 sizes x (5+2) all-reduces exact; busbw at "
                                              "2 KiB: n/a (one process)")


def test_a_corrupted_result_stops_every_rank_with_one_line(tmp_path):
    # Rank 1 adds 1 to element 512 of its result in the 2nd all-reduce (the first timed one) of 4 KiB.
    env = clean_env(CHECK_NETWORK_FAULT="1:4K:2")
    result = run(torchrun_cmd(2, "check_network.py", *SMALL), cwd=tmp_path, env=env, timeout=120)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [
        f"error: all-reduce of 4 KiB gave wrong values in iteration 2 of 4 on ranks [1] (host {socket.gethostname()}) "
        "(1 of 1024 elements on rank 1 in iteration 2, e.g. element 512: got 7.0, expected 6.0): data is corrupted "
        "between ranks (see docs/network.md)"]  # 512 % 7 = 1: (1 + 1) * (1 + 2) = 6 expected
    assert re.search(r"exitcode\s*:\s*3\b", result.stderr)  # the ranks' status
    rows = table(result.stdout)
    assert [(r[1], r[6]) for r in rows] == [("1 KiB", "0"), ("2 KiB", "0"), ("4 KiB", "1")]  # stops at the size
    assert "Network check passed" not in result.stdout


def test_a_corruption_in_the_repeats_names_the_size_and_iteration(tmp_path):
    """A fault that strikes one call in tens (NCCL issue 2001) passes the table's few
    iterations and is caught by --repeat: rank 1's 30th repeat of 64 KiB."""
    env = clean_env(CHECK_NETWORK_FAULT="1:64K:30")
    result = run(torchrun_cmd(2, "check_network.py", *SMALL, "--repeat", "40"), cwd=tmp_path, env=env, timeout=120)
    assert result.returncode != 0 and [r[6] for r in table(result.stdout)] == ["0"] * 7
    assert error_lines(result.stderr) == [
        f"error: repeated all-reduce of 64 KiB gave wrong values in iteration 30 of 40 on ranks [1] (host "
        f"{socket.gethostname()}) (1 of 16384 elements on rank 1 in iteration 30, e.g. element 8192: got 10.0, "
        "expected 9.0): data is corrupted between ranks (see docs/network.md)"]  # 8192 % 7 = 2: 3 * 3 = 9
    assert re.search(r"exitcode\s*:\s*3\b", result.stderr) and "Network check passed" not in result.stdout


def test_the_repeats_take_issue_2001s_size_and_ddps_bucket_within_max_size():
    assert cn.repeated_sizes(256 * 2**20) == [2**20, 25 * 2**20]
    assert cn.repeated_sizes(4 * 2**20) == [2**20]
    assert cn.repeated_sizes(64 * 2**10) == [64 * 2**10]  # neither fits: the largest size there is


def test_a_slow_network_fails_min_busbw_with_one_line(tmp_path):
    args = ("--max-size", "2K", "--iters", "2", "--warmup-iters", "0", "--min-busbw", "1e9")
    result = run(torchrun_cmd(2, "check_network.py", *args), cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    [line] = error_lines(result.stderr)
    busbw = table(result.stdout)[-1][5]
    assert line == f"error: busbw at 2 KiB is {busbw} GB/s, below --min-busbw 1e+09 GB/s (gloo over TCP; see " \
                   "docs/network.md)"
    assert re.search(r"exitcode\s*:\s*4\b", result.stderr) and "Network check passed" not in result.stdout


@pytest.mark.oldest_torch
@pytest.mark.parametrize("how", ["frozen", "killed"])
def test_a_frozen_or_killed_rank_ends_the_check_with_one_line_naming_it(tmp_path, how):
    """SIGSTOP of rank 1 (a node that hangs) or SIGKILL (the out-of-memory killer) while the
    all-reduces run: rank 0 gives up after --collective-timeout (3 s), or at once, in the wait
    for its all-reduce (host_wait, as on NCCL with blocking wait), and names rank 1, exit
    status 5, instead of waiting 5 minutes."""
    stop_rank_during_check(tmp_path, how)


def stop_rank_during_check(tmp_path, how, env=None):
    """Start a 2-process check, stop or kill rank 1 once the table has begun, and assert the
    one line naming it and status 5 (also tests/test_gpu.py's, on NCCL). Returns the log.

    A killed rank 1 is seen by torchrun too, which then sends rank 0 SIGTERM: rank 0 names
    rank 1 when it sees the lost connection first (nearly always), else torchrun's report
    names rank 1's SIGKILL. Either way, no rank's traceback."""
    args = ("--min-size", "4K", "--max-size", "4K", "--iters", "1000000", "--collective-timeout", "0.05")
    process = start(torchrun_cmd(2, "check_network.py", *args), tmp_path, tmp_path / "log", env=env)
    wait_for(tmp_path / "log", "size (B)", process)  # the table's header: the all-reduces have begun
    [rank1] = [pid for pid in descendants(process.pid)
               if b"RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")]
    os.kill(rank1, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
    if how == "frozen":
        try:
            wait_for(tmp_path / "log", "error: ", process, timeout=60)
        finally:
            os.kill(rank1, signal.SIGKILL)  # instead of torchrun's grace period for a stopped process
    process.wait(timeout=60)
    log = (tmp_path / "log").read_text()
    assert "Network check passed" not in log and "[rank0]:" not in log and "[rank1]:" not in log
    lines = error_lines(log)
    if how == "killed" and not lines:  # torchrun's SIGTERM came first
        assert f"Signal 9 (SIGKILL) received by PID {rank1}" in log
        return log
    [line] = lines
    who = f"error: the network check could not finish: rank 1 (pid {rank1} on {socket.gethostname()}) "
    if how == "frozen":
        assert line.startswith(who + "is stopped (SIGSTOP or a debugger) ("), line
        assert re.search(r"exitcode\s*:\s*5\b", log)  # torchrun sees rank 0's status first
    else:  # its exit status is in /proc until torchrun collects it
        assert line.startswith((who + "was killed by SIGKILL (", who + "died without a word: killed (SIGKILL")), line
    assert line.endswith("; --collective-timeout 0.05 min)")
    return log
