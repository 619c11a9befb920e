"""Topology files: the examples load, and every bad input is one clear line naming file, path and value."""

import json

import jsonschema
import pytest
import yaml

from neuronabox.errors import TopologyError
from neuronabox.topology import load_topology, parse_topology
from neuronabox.topology.schema import json_schema

from .conftest import TOPOLOGIES, run_nbox, topo

EXAMPLES = sorted(TOPOLOGIES.glob("*.yaml"))
BASE_NET = "network: {type: switch, link: {bandwidth: 10Gbps, latency: 5us}}\n"


def test_examples_exist():
    names = {p.stem for p in EXAMPLES}
    assert {"paper-2x1-100g", "dgx-h100-32", "cpu-8x1g", "cpu-2x1g", "hetero-a100-h100"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_load_and_match_json_schema(path):
    t = load_topology(path)
    assert t.world_size >= 2
    jsonschema.validate(yaml.safe_load(path.read_text()), json_schema())


def test_dgx_cluster_shape():
    t = load_topology(TOPOLOGIES / "dgx-h100-32.yaml")
    assert t.world_size == 256 and len(t.nodes) == 32
    assert all(n.ranks == 8 and n.nics == 8 and n.device == "H100" for n in t.nodes)
    assert t.nodes[0].intra_bandwidth == pytest.approx(450e9)


def test_heterogeneous_nodes():
    t = load_topology(TOPOLOGIES / "hetero-a100-h100.yaml")
    a100 = [n for n in t.nodes if n.device == "A100"]
    assert len(a100) == 2 and all(n.compute_slowdown == 1.6 and n.nics == 2 for n in a100)
    assert a100[0].intra_bandwidth == pytest.approx(300e9) and a100[0].intra_latency == pytest.approx(1.5e-6)
    assert t.nodes[0].nics == 4 and t.nodes[0].intra_bandwidth == pytest.approx(450e9)


def test_count_and_defaults():
    t = topo("cluster: {nodes: 3, ranks_per_node: 2}\n" + BASE_NET)
    assert t.world_size == 6
    assert [n.first_rank for n in t.nodes] == [0, 2, 4]
    assert t.node_of(5).name == "node2" and t.local_rank(5) == 1
    assert t.emulation.real_ranks == [0] and t.emulation.model == "alpha-beta"
    assert t.nodes[0].fabric.value == "nvlink"


def test_overrides_by_index_range_and_name():
    t = topo(
        "cluster:\n  nodes: 6\n  overrides:\n    2: {ranks: 4}\n    3-4: {compute_slowdown: 2}\n    node5: {device: A100}\n"
        + BASE_NET
    )
    assert [n.ranks for n in t.nodes] == [1, 1, 4, 1, 1, 1]
    assert [n.compute_slowdown for n in t.nodes] == [1, 1, 1, 2, 2, 1]
    assert t.nodes[5].device == "A100"
    assert t.world_size == 9


def test_world_size_whatif_resizes():
    t = topo("cluster: {nodes: 2, ranks_per_node: 4}\n" + BASE_NET + "whatif: {world_size: 1024}\n")
    assert t.world_size == 1024 and len(t.nodes) == 256
    shrunk = topo("cluster: {nodes: 8, ranks_per_node: 4}\n" + BASE_NET + "whatif: {world_size: 8}\n")
    assert shrunk.world_size == 8 and len(shrunk.nodes) == 2


def test_inject_keys_accept_spellings():
    t = topo("cluster: {nodes: 2}\n" + BASE_NET + "whatif: {inject: {AllReduce: 2ms, all-gather: 1us}}\n")
    assert {k.value: v for k, v in t.whatif.inject.items()} == {"all_reduce": 0.002, "all_gather": 1e-6}


def test_with_changes_revalidates():
    t = topo("cluster: {nodes: 2}\n" + BASE_NET)
    t2 = t.with_changes(whatif={"latency_scale": 3})
    assert t2.whatif.latency_scale == 3 and t.whatif.latency_scale == 1
    with pytest.raises(TopologyError, match="whatif.latency_scale"):
        t.with_changes(whatif={"latency_scale": -1})


# (yaml text, path expected in the message, fragment of the message)
BAD = [
    ("cluster: {nodes: 2}\nnetwork: {type: switch, link: {bandwidth: 100Gbs}}\n", "network.link.bandwidth", "'100Gbs'"),
    ("cluster: {nodes: 2}\nnetwork: {type: switch, link: {bandwidth: 100}}\n", "network.link.bandwidth", "100"),
    ("cluster: {nodes: 2}\nnetwork: {type: switch, link: {bandwidth: 1Gbps, latency: 5}}\n", "network.link.latency", "5"),
    ("cluster: {nodes: 2}\nnetwork: {type: switch, link: {bandwidth: 1Gbps, loss: 200%}}\n", "network.link.loss", "200%"),
    ("cluster: {nodes: 2}\nnetwork: {type: torus, link: {bandwidth: 1Gbps}}\n", "network.type", "'torus'"),
    ("cluster: {nodes: 2}\nnetwork: {type: switch}\n", "network.link", "required"),
    ("cluster: {nodes: 0}\n" + BASE_NET, "cluster.nodes", "0"),
    ("cluster: {nodes: many}\n" + BASE_NET, "cluster.nodes", "'many'"),
    ("cluster: {nodes: 2, ranks_per_node: 0}\n" + BASE_NET, "cluster.ranks_per_node", "0"),
    ("cluster: {nodes: 2, ranks_per_node: '8'}\n" + BASE_NET, "cluster.ranks_per_node", "'8'"),
    ("cluster: {nodes: 2, gpus: 8}\n" + BASE_NET, "cluster.gpus", "unknown field"),
    ("cluster: {nodes: [{name: a}, {name: a}]}\n" + BASE_NET, "cluster.nodes[1].name", "'a'"),
    ("cluster: {nodes: [{name: a, ranks: -1}]}\n" + BASE_NET, "cluster.nodes[0].ranks", "-1"),
    ("cluster: {nodes: 2, overrides: {7: {ranks: 2}}}\n" + BASE_NET, "cluster.overrides.7", "7"),
    ("cluster: {nodes: 2, overrides: {gpu9: {ranks: 2}}}\n" + BASE_NET, "cluster.overrides.gpu9", "'gpu9'"),
    ("cluster: {nodes: 2, overrides: {1-5: {ranks: 2}}}\n" + BASE_NET, "cluster.overrides.1-5", "'1-5'"),
    ("cluster: {nodes: 2, overrides: {1: {compute_slowdown: 0}}}\n" + BASE_NET, "cluster.overrides.1.compute_slowdown", "0"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "emulation: {real_ranks: [5]}\n", "emulation.real_ranks[0]", "5"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "emulation: {real_ranks: [1, 1]}\n", "emulation.real_ranks[1]", "1"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "emulation: {real_ranks: []}\n", "emulation.real_ranks", "at least one"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "emulation: {library: mpi}\n", "emulation.library", "'mpi'"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "emulation: {protocol: LL256}\n", "emulation.protocol", "'LL256'"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "whatif: {inject: {allfoo: 2ms}}\n", "whatif.inject", "'allfoo'"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "whatif: {inject: {all_reduce: 2}}\n", "whatif.inject.all_reduce", "2"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "whatif: {latency_scale: 0}\n", "whatif.latency_scale", "0"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "whatif: {stragglers: {9: 2}}\n", "whatif.stragglers.9", "9"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "whatif: {stragglers: {1: -2}}\n", "whatif.stragglers.1", "-2"),
    ("cluster: {nodes: 2, ranks_per_node: 4}\n" + BASE_NET + "whatif: {world_size: 10}\n", "whatif.world_size", "10"),
    ("cluster: {nodes: 2}\nnetwork: {type: switch, link: {bandwidth: 1Gbps}, fat_tree: {k: 4}}\n", "network.fat_tree", "'switch'"),
    ("cluster: {nodes: 2}\nnetwork: {type: fat-tree, link: {bandwidth: 1Gbps}, fat_tree: {k: 3}}\n", "network.fat_tree.k", "3"),
    ("cluster: {nodes: 20}\nnetwork: {type: fat-tree, link: {bandwidth: 1Gbps}, fat_tree: {k: 4}}\n", "network.fat_tree.k", "k=4"),
    ("cluster: {nodes: 2}\nnetwork: {type: fat-tree, link: {bandwidth: 1Gbps}, fat_tree: {oversubscription: 0.5}}\n", "network.fat_tree.oversubscription", "0.5"),
    ("cluster: {nodes: 2}\nnetwork: {type: links, link: {bandwidth: 1Gbps}}\n", "network.links", "at least one"),
    ("cluster: {nodes: 2}\nnetwork: {type: switch, link: {bandwidth: 1Gbps}, links: [{endpoints: [node0, node1]}]}\n", "network.links", "'switch'"),
    ("cluster: {nodes: 2}\nnetwork: {type: links, link: {bandwidth: 1Gbps}, links: [{endpoints: [node0, nodeX]}]}\n", "network.links[0].endpoints[1]", "'nodeX'"),
    ("cluster: {nodes: 2}\nnetwork: {type: links, link: {bandwidth: 1Gbps}, links: [{endpoints: [node0, 'node1:3']}]}\n", "network.links[0].endpoints[1]", "'node1:3'"),
    ("cluster: {nodes: 2}\nnetwork: {type: links, link: {bandwidth: 1Gbps}, links: [{endpoints: [node0, node0]}]}\n", "network.links[0].endpoints", "'node0'"),
    ("cluster: {nodes: 2}\nnetwork: {type: links, link: {bandwidth: 1Gbps}, switches: [node1], links: [{endpoints: [node0, node1]}]}\n", "network.switches[0]", "'node1'"),
    ("cluster: {nodes: 2}\nnetwork: {type: links, link: {bandwidth: 1Gbps}, links: [{endpoints: [node0, node1], bandwidth: 1}]}\n", "network.links[0].bandwidth", "1"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "colour: blue\n", "colour", "unknown field"),
    ("network: {type: switch, link: {bandwidth: 1Gbps}}\n", "cluster", "required"),
    ("cluster: {nodes: 2}\n" + BASE_NET + "emulation: {library: gloo, gloo_threads: 0}\n", "emulation.gloo_threads", "0"),
]


@pytest.mark.parametrize("text, path, fragment", BAD, ids=[b[1] for b in BAD])
def test_bad_input_names_path_and_value(text, path, fragment):
    with pytest.raises(TopologyError) as info:
        parse_topology(text, "bad.yaml")
    msg = str(info.value)
    assert msg.startswith(f"bad.yaml: {path}: "), msg
    assert fragment in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("cluster: {nodes: 2\n", "bad.yaml:2:1: YAML syntax error"),
        ("", "the file is empty"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("cluster: {nodes: 2}\ncluster: {nodes: 3}\n" + BASE_NET, "duplicate key 'cluster' (line 2)"),
    ],
)
def test_bad_yaml(text, fragment):
    with pytest.raises(TopologyError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_topology(text, "bad.yaml")


def test_disconnected_explicit_network_is_rejected():
    from neuronabox.topology.graph import ClusterGraph

    t = topo(
        "cluster: {nodes: 3}\nnetwork: {type: links, link: {bandwidth: 1Gbps}, links: [{endpoints: [node0, node1]}]}\n"
    )
    with pytest.raises(TopologyError, match="network.links: node 'node2' cannot reach"):
        ClusterGraph(t)


def test_missing_file():
    with pytest.raises(TopologyError, match="nope.yaml: no such file"):
        load_topology("nope.yaml")


@pytest.mark.parametrize("text, path, fragment", BAD[:6] + BAD[17:19], ids=[b[1] for b in BAD[:6] + BAD[17:19]])
def test_cli_bad_file_exits_2_with_one_line(tmp_yaml, text, path, fragment):
    f = tmp_yaml(text)
    for verb in ("show", "bench"):
        r = run_nbox(verb, str(f))
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert f"{f}: {path}: " in lines[0] and fragment in lines[0]
        assert "Traceback" not in r.stderr and r.stdout == ""


def test_cli_debug_shows_traceback(tmp_yaml):
    f = tmp_yaml(BAD[0][0])
    r = run_nbox("--debug", "show", str(f))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_cli_schema(tmp_path):
    r = run_nbox("schema")
    assert r.returncode == 0
    schema = json.loads(r.stdout)
    assert schema["title"] == "NeuronaBox topology"
    assert "cluster" in schema["required"] and "network" in schema["required"]
    out = tmp_path / "schema.json"
    assert run_nbox("schema", "-o", str(out)).returncode == 0
    assert json.loads(out.read_text()) == schema


def test_json_schema_rejects_what_pydantic_rejects():
    bad = yaml.safe_load("cluster: {nodes: 2}\nnetwork: {type: torus, link: {bandwidth: 1Gbps}}\n")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json_schema())
