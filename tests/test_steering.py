"""Which interfaces are steered (RPS) for which link rates; the CPU mask text the kernel reads."""

from neuronabox.cluster.steering import STEER_MAX_RATE, cpu_mask, steering


def test_cpu_mask_is_the_kernels_bitmap_text():
    assert cpu_mask({0, 1}) == "00000003"
    assert cpu_mask({0, 33}) == "00000002,00000001"
    assert cpu_mask({63}) == "80000000,00000000"


def test_slow_links_are_steered_fast_and_unshaped_ones_are_not():
    slow, fast = 100e6 / 8, 10e9 / 8
    links = [
        ([("h0", "nic0"), ("s0", "p0")], slow, slow),
        ([("h1", "nic0"), ("s0", "p1")], fast, fast),
        ([("h2", "nic0"), ("s0", "p2")], slow, 0.0),  # one direction unshaped: as fast as the CPU
        ([("h3", "nic0"), ("s0", "p3")], STEER_MAX_RATE, STEER_MAX_RATE),
    ]
    got = steering(links)
    assert got["h0"] == {"nic0": True, "lo": True}
    assert got["h1"] == {"nic0": False, "lo": False}
    assert got["h2"] == {"nic0": False, "lo": False}
    assert got["h3"] == {"nic0": True, "lo": True}
    # lo of a namespace with a fast link stays as it is: the relay's bytes reach the rank at CPU speed there.
    assert got["s0"] == {"p0": True, "p1": False, "p2": False, "p3": True, "lo": False}
