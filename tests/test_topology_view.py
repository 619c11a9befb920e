"""``nbox show --png``: the drawing's labels stay readable (none overlaps another) on the shipped clusters."""

from __future__ import annotations

import itertools

import pytest

from neuronabox.topology import load_topology
from neuronabox.topology.graph import ClusterGraph

from .conftest import TOPOLOGIES

pytest.importorskip("matplotlib")


@pytest.mark.parametrize("name", ["dgx-h100-32", "cpu-64-demo", "hetero-a100-h100", "cpu-16x1g"])
def test_no_two_labels_overlap(name):
    import matplotlib.pyplot as plt

    from neuronabox.report.topology_view import draw

    fig = draw(ClusterGraph(load_topology(TOPOLOGIES / f"{name}.yaml")))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in fig.axes[0].texts]
        assert len(boxes) >= 8  # the tiers are labelled
        overlapping = [(a, b) for a, b in itertools.combinations(range(len(boxes)), 2) if boxes[a].overlaps(boxes[b])]
        texts = [t.get_text() for t in fig.axes[0].texts]
        assert not overlapping, [(texts[a], texts[b]) for a, b in overlapping[:5]]
        page = fig.bbox
        assert all(page.x0 <= b.x0 and b.x1 <= page.x1 and page.y0 <= b.y0 for b in boxes)  # and inside the picture
    finally:
        plt.close(fig)
