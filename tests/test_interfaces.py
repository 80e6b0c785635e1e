"""GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME checked against the node's interfaces before the
process group starts: the job scripts' Olivia defaults (hsn0) on a node without Slingshot
are one line naming what the node has, not a traceback per rank."""

from conftest import TINY_MODEL, clean_env, error_lines, run, torchrun_cmd, write_cifar10
from engine.interfaces import interface_problems, interfaces_line, nccl_selects, node_interfaces


def test_nccl_socket_ifname_is_read_as_nccl_reads_it():
    names = ["lo", "eth0", "eth1", "ib0", "hsn0", "hsn1"]
    assert nccl_selects("hsn0,hsn1,hsn2,hsn3", names) == ["hsn0", "hsn1"]
    assert nccl_selects("eth", names) == ["eth0", "eth1"]  # prefixes
    assert nccl_selects("=eth", names) == []  # = : exact names only
    assert nccl_selects("^lo,eth", names) == ["ib0", "hsn0", "hsn1"]  # ^ : all but these prefixes
    assert nccl_selects("^=lo", names) == ["eth0", "eth1", "ib0", "hsn0", "hsn1"]


def test_interfaces_the_node_lacks_are_named():
    node = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"]}
    olivia = {"GLOO_SOCKET_IFNAME": "hsn0", "NCCL_SOCKET_IFNAME": "hsn0,hsn1,hsn2,hsn3"}
    assert interface_problems(olivia, node, uses_nccl=True) == [("GLOO_SOCKET_IFNAME", "hsn0"),
                                                                ("NCCL_SOCKET_IFNAME", "hsn0,hsn1,hsn2,hsn3")]
    assert interface_problems(olivia, node, uses_nccl=False) == [("GLOO_SOCKET_IFNAME", "hsn0")]  # no NCCL on CPU
    assert interface_problems({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^lo"}, node, True) == []
    assert "lo" in node_interfaces()  # this machine's, read from the kernel


def test_an_interface_without_an_address_is_not_usable(tmp_path):
    """ifb0 exists but has no address: --interfaces said "found", and gloo then failed on every
    rank ("Unable to find address for: ifb0"). An address of either family makes it usable."""
    node = {"lo": ["127.0.0.1"], "ifb0": [], "ib0": ["fe80::1"]}
    assert interface_problems({"GLOO_SOCKET_IFNAME": "ifb0"}, node, uses_nccl=False) == [("GLOO_SOCKET_IFNAME", "ifb0")]
    assert interface_problems({"NCCL_SOCKET_IFNAME": "ifb"}, node, uses_nccl=True) == [("NCCL_SOCKET_IFNAME", "ifb")]
    assert interface_problems({"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "i"}, node, uses_nccl=True) == []
    inet6 = tmp_path / "if_inet6"  # Linux's /proc/net/if_inet6
    inet6.write_text("00000000000000000000000000000001 01 80 10 80       lo\n"
                     "fe8000000000000000fc00fffe000001 04 40 20 80 nosuch9\n")
    found = node_interfaces(inet6)
    assert found["lo"][-1] == "::1" and "nosuch9" not in found  # only the kernel's interfaces are listed


def test_the_interfaces_line_says_what_is_named_or_who_chooses():
    """check_network.py --interfaces, run by multinode_job.sh on every node: with nothing set it
    said only "none named"; it now says who picks the interface then, and what the node has."""
    node = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "ib0": []}
    has = "(it has: lo 127.0.0.1, eth0 10.0.0.5, ib0 (no address))"
    assert interfaces_line({}, node, uses_nccl=True, host="n1") == (
        "Interfaces of n1: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME not set, so gloo uses the address this host name "
        f"resolves to, NCCL its own choice {has}; set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to choose, see "
        'docs/network.md, "On another cluster"')
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "^lo"}
    assert interfaces_line(env, node, uses_nccl=True, host="n1") == (
        f"Interfaces of n1: GLOO_SOCKET_IFNAME=eth0, NCCL_SOCKET_IFNAME=^lo found {has}")
    assert interfaces_line(env, node, uses_nccl=False, host="n1") == (  # a CPU node: NCCL's is not read
        f"Interfaces of n1: GLOO_SOCKET_IFNAME=eth0 found {has}")

def test_a_missing_gloo_interface_is_one_line_for_the_job(tmp_path):
    data = write_cifar10(tmp_path / "data")
    result = run(torchrun_cmd(2, "train_ddp.py", "--dataset", "cifar10", "--data-dir", data, "--no-download",
                              "--epochs", "1", "--batch-size", "8", *TINY_MODEL), cwd=tmp_path,
                 env=clean_env(GLOO_SOCKET_IFNAME="hsn0"))
    assert result.returncode == 1
    (line,) = error_lines(result.stdout + result.stderr)
    assert line.startswith("error: GLOO_SOCKET_IFNAME=hsn0: node ")
    assert "has no such interface with an address (it has: lo 127.0.0.1" in line
    assert line.endswith('before sbatch, see docs/network.md, "On another cluster"')
