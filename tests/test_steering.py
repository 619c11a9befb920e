"""Which interfaces are steered (RPS) for which link rates, to which CPU; the CPU mask text the kernel reads."""

from neuronabox.cluster.netplan import ns_name, ns_role
from neuronabox.cluster.steering import STEER_MAX_RATE, cpu_mask, node_cpu, steering


def test_cpu_mask_is_the_kernels_bitmap_text():
    assert cpu_mask({0, 1}) == "00000003"
    assert cpu_mask({0, 33}) == "00000002,00000001"
    assert cpu_mask({63}) == "80000000,00000000"


def test_namespace_names_tell_node_and_switch_apart():
    assert ns_role(ns_name("fid0-12", "h", 3)) == ("h", 3)
    assert ns_role(ns_name("a-h1", "s", 0)) == ("s", 0)
    assert ns_role("nbx-c") is None and ns_role("/proc/4242/ns/net") is None and ns_role("nbx-c-hx") is None


def test_slow_links_are_steered_to_their_nodes_cpu_fast_and_unshaped_ones_are_not():
    slow, fast = 100e6 / 8, 10e9 / 8
    h = [ns_name("c", "h", k) for k in range(4)]
    s0, s1 = ns_name("c", "s", 0), ns_name("c", "s", 1)
    links = [
        ([(h[0], "nic0"), (s0, "p0")], slow, slow),
        ([(h[1], "nic0"), (s0, "p1")], fast, fast),
        ([(h[2], "nic0"), (s0, "p2")], slow, 0.0),  # one direction unshaped: as fast as the CPU
        ([(h[3], "nic0"), (s0, "p3")], STEER_MAX_RATE, STEER_MAX_RATE),
        ([(s0, "p4"), (s1, "p0")], slow, slow),
    ]
    got = steering(links)
    own = [cpu_mask({node_cpu(k)}) for k in range(4)]
    # A node's interfaces and its lo go to the node's CPU (the one its rank is pinned to).
    assert got[h[0]] == {"nic0": own[0], "lo": own[0]}
    assert got[h[1]] == {"nic0": "0", "lo": "0"}
    assert got[h[2]] == {"nic0": "0", "lo": "0"}
    assert got[h[3]] == {"nic0": own[3], "lo": own[3]}
    # A switch port takes its node's CPU; a port between switches hashes over all of them.
    every = cpu_mask()
    assert got[s0] == {"p0": own[0], "p1": "0", "p2": "0", "p3": own[3], "p4": every, "lo": "0"}
    assert got[s1] == {"p0": every, "lo": every}


def test_nodes_take_the_cpus_round_robin_and_a_homeless_namespace_hashes():
    import os

    cpus = sorted(os.sched_getaffinity(0))
    assert [node_cpu(k) for k in range(2 * len(cpus))] == cpus * 2
    got = steering([([("/proc/1/ns/net", "eth0")], 1e6, 1e6)])
    assert got == {"/proc/1/ns/net": {"eth0": cpu_mask(), "lo": cpu_mask()}}
