"""Running on clusters: the Kubernetes manifests, Kubeflow's PET_* variables, the container
image and Slurm (``--nnodes auto``).

- Every manifest under deploy/kubernetes/ is validated offline against the Kubernetes
  OpenAPI schemas (``kubernetes-validate``, strict: an unknown field is an error), as
  written and as Kustomize renders it when ``kubectl`` or ``kustomize`` is installed.
  ``kubernetes-validate`` has schemas for the built-in kinds only and raises
  ``SchemaNotFoundError`` for a custom resource. For the custom kinds the manifests use,
  this file checks what can be checked: the fields of their own, against the schemas below
  (written from the CRDs, only the fields the manifests may use), and every pod template
  inside them against the core ``PodTemplate`` schema. A custom kind that is not listed
  here fails the test, so a new one cannot slip through unvalidated.
- The PET_* variables Kubeflow's training operator sets for an elastic PyTorchJob are
  derived from deploy/kubernetes/pytorchjob/ as the operator derives them, and
  ``rallypoint run`` is run with only those.
- The Dockerfile is checked statically (no Docker daemon is needed): its COPY sources
  exist and are in the build context that .dockerignore leaves, the wheels it builds
  build from that context, and the runtime is a non-root user with ``rallypoint`` as
  entrypoint. With ``RALLYPOINT_TEST_DOCKER_BUILD=1`` and a reachable daemon, the image is
  also built and run.
- Slurm: a real single-host cluster (slurmctld and slurmd of Debian's slurm-wlm, started
  here as root) runs the sbatch example and an ``srun`` step with ``--nnodes auto``;
  skipped where Slurm is not installed or the test does not run as root.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # kubernetes-validate's own dependency
import kubernetes_validate
import pytest
import yaml

from launch import RALLYPOINT, clean_environment, rallypoint, worker
from rallypoint.config import LaunchConfig
from rallypoint.errors import UsageError
from rallypoint.plugins import build_plugin_manager
from rallypoint.slurm import SLURM_RDZV_PORT, apply_slurm, expand_hostlist
from servers import EtcdServer, find_binary, free_port, free_ports

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
SLURM_EXAMPLE = ROOT / "deploy" / "slurm" / "train.sbatch"
#: The oldest Kubernetes the manifests are for (the Job label
#: batch.kubernetes.io/controller-uid is 1.27's), and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
TIMEOUT = 60


# --- Kubernetes manifests -------------------------------------------------------------------


def _kustomizations() -> list[Path]:
    return sorted(KUBERNETES.rglob("kustomization.yaml"))


def _manifests() -> list[Path]:
    return sorted(p for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml")


def _documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {"type": "string", "pattern": r"^\d+[smh]$"},
    },
}


def _custom_resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
                },
            },
            "spec": spec,
        },
    }


#: The fields of the custom kinds' own, from their CRDs: kubeflow/training-operator
#: manifests/base/crds/kubeflow.org_pytorchjobs.yaml (v1), and the Prometheus operator's
#: monitoring.coreos.com_servicemonitors/podmonitors (v1). Pod templates are validated
#: separately against the core schema.
CUSTOM_RESOURCES: dict[tuple[str, str], dict[str, Any]] = {
    ("kubeflow.org/v1", "PyTorchJob"): _custom_resource(
        "PyTorchJob",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "elasticPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "minReplicas": {"type": "integer", "minimum": 1},
                        "maxReplicas": {"type": "integer", "minimum": 1},
                        "rdzvBackend": {"enum": ["c10d", "etcd", "etcd-v2"]},
                        "rdzvHost": {"type": "string"},
                        "rdzvPort": {"type": "integer"},
                        "rdzvId": {"type": "string"},
                        "rdzvConf": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "key": {"type": "string"},
                                    "value": {"type": "string"},
                                },
                            },
                        },
                        "standalone": {"type": "boolean"},
                        "nProcPerNode": {"type": "integer"},
                        "maxRestarts": {"type": "integer"},
                    },
                },
                "nprocPerNode": {"type": "string"},
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "backoffLimit": {"type": "integer"},
                        "activeDeadlineSeconds": {"type": "integer"},
                        "ttlSecondsAfterFinished": {"type": "integer"},
                        "suspend": {"type": "boolean"},
                    },
                },
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        role: {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["template"],
                            "properties": {
                                "replicas": {"type": "integer", "minimum": 1},
                                "restartPolicy": {
                                    "enum": ["Always", "OnFailure", "Never", "ExitCode"]
                                },
                                "template": {"type": "object"},
                            },
                        }
                        for role in ("Master", "Worker")
                    },
                },
            },
        },
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _custom_resource(
        "ServiceMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
        },
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _custom_resource(
        "PodMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
        },
    ),
}


def _pod_templates(resource: dict[str, Any]) -> list[dict[str, Any]]:
    if resource["kind"] == "PyTorchJob":
        return [spec["template"] for spec in resource["spec"]["pytorchReplicaSpecs"].values()]
    return []


def validate_resource(resource: dict[str, Any], version: str) -> None:
    """Validate one resource: built-in kinds against Kubernetes' schemas, custom kinds as
    the module docstring says."""
    try:
        kubernetes_validate.validate(resource, version, strict=True)
        return
    except kubernetes_validate.SchemaNotFoundError:
        key = (resource["apiVersion"], resource["kind"])
        assert key in CUSTOM_RESOURCES, f"no schema for {key}: add the kind to CUSTOM_RESOURCES"
    jsonschema.validate(resource, CUSTOM_RESOURCES[key])
    for template in _pod_templates(resource):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": resource["metadata"]["name"]},
            "template": template,
        }
        kubernetes_validate.validate(pod_template, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", _manifests(), ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_manifest_validates(path: Path, version: str) -> None:
    resources = _documents(path.read_text())
    assert resources, f"{path} holds no resource"
    for resource in resources:
        validate_resource(resource, version)


def test_validation_catches_mistakes() -> None:
    """The schemas are strict: a misspelt field fails, in a built-in and in a custom kind."""
    job = _documents((KUBERNETES / "agents" / "job.yaml").read_text())[0]
    job["spec"]["template"]["spec"]["containers"][0]["comand"] = ["rallypoint"]
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        validate_resource(job, KUBERNETES_VERSIONS[-1])
    pytorchjob = _pytorchjob()
    pytorchjob["spec"]["elasticPolicy"]["minReplica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        validate_resource(pytorchjob, KUBERNETES_VERSIONS[-1])
    pytorchjob = _pytorchjob()
    worker_spec = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]
    worker_spec["template"]["spec"]["containers"][0]["args"] = "run"  # not a list
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_resource(pytorchjob, KUBERNETES_VERSIONS[-1])


@pytest.mark.parametrize("path", _kustomizations(), ids=lambda p: str(p.parent.name))
def test_kustomization_lists_existing_resources(path: Path) -> None:
    kustomization = yaml.safe_load(path.read_text())
    assert kustomization["kind"] == "Kustomization"
    for entry in kustomization["resources"]:
        target = path.parent / entry
        assert target.exists(), f"{path}: {entry} does not exist"
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), f"{path}: {entry} is no base"


def test_every_manifest_belongs_to_a_kustomization() -> None:
    listed = {
        (path.parent / entry).resolve()
        for path in _kustomizations()
        for entry in yaml.safe_load(path.read_text())["resources"]
    }
    assert {path.resolve() for path in _manifests()} <= listed


def _kustomize() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("path", _kustomizations(), ids=lambda p: str(p.parent.name))
def test_kustomization_renders(path: Path) -> None:
    command = _kustomize()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    rendered = subprocess.run(
        [*command, str(path.parent)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert rendered.returncode == 0, rendered.stderr
    resources = _documents(rendered.stdout)
    assert resources
    for resource in resources:
        validate_resource(resource, KUBERNETES_VERSIONS[-1])


def _rendered_kinds(overlay: str) -> dict[str, dict[str, Any]]:
    documents: list[dict[str, Any]] = []
    for entry in yaml.safe_load((KUBERNETES / overlay / "kustomization.yaml").read_text())[
        "resources"
    ]:
        target = (KUBERNETES / overlay / entry).resolve()
        if target.is_dir():
            documents.extend(_rendered_kinds(str(target.relative_to(KUBERNETES))).values())
        else:
            documents.extend(_documents(target.read_text()))
    return {f"{doc['kind']}/{doc['metadata']['name']}": doc for doc in documents}


@pytest.mark.parametrize(
    ("overlay", "backend", "service"),
    [
        ("elastic-etcd", "etcd", "rallypoint-etcd:2379"),
        ("elastic-redis", "redis", "rallypoint-redis:6379"),
    ],
)
def test_elastic_job_meets_at_its_store(overlay: str, backend: str, service: str) -> None:
    """The store base decides the backend: its ConfigMap, which the agents load, names it
    and its service; the agents serve /metrics where the annotations and the headless
    service say."""
    resources = _rendered_kinds(overlay)
    config = resources["ConfigMap/rallypoint-rendezvous"]["data"]
    assert config == {"RALLYPOINT_RDZV_BACKEND": backend, "RALLYPOINT_RDZV_ENDPOINT": service}
    host, port = service.split(":")
    store = resources[f"Service/{host}"]
    assert int(port) in [p["port"] for p in store["spec"]["ports"]]

    job = resources["Job/rallypoint-train"]
    pod = job["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["envFrom"] == [{"configMapRef": {"name": "rallypoint-rendezvous"}}]
    args = container["args"]
    assert args[0] == "run"
    assert "--metrics=prometheus" in args and "--metrics-port=9400" in args
    nnodes = next(a for a in args if a.startswith("--nnodes="))
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["parallelism"] == int(nnodes.split(":")[-1])  # MAX agents
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    assert {"name": "metrics", "containerPort": 9400} in container["ports"]
    headless = resources["Service/rallypoint-train"]
    assert headless["spec"]["clusterIP"] == "None"
    assert pod["spec"]["subdomain"] == "rallypoint-train"
    assert headless["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True

    monitor = _documents((KUBERNETES / "monitoring" / "servicemonitor.yaml").read_text())[0]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= headless["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == headless["spec"]["ports"][0]["name"]


# --- Kubeflow's PET_* variables -------------------------------------------------------------


def _pytorchjob() -> dict[str, Any]:
    path = KUBERNETES / "pytorchjob" / "pytorchjob.yaml"
    return copy.deepcopy(_documents(path.read_text())[0])


def pytorchjob_elastic_env(job: dict[str, Any]) -> dict[str, str]:
    """The variables Kubeflow's training operator (v1.7 and later) adds to the containers of
    an elastic PyTorchJob of Worker replicas, as it computes them: setPodEnv in
    pkg/controller.v1/pytorch/envvar.go and ElasticEnvVarGenerator.Generate in elastic.go
    of kubeflow/training-operator. (With a Master replica it adds MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE, RANK, PET_NPROC_PER_NODE and PET_NODE_RANK too; elastic jobs have none.)"""
    spec = job["spec"]
    policy = spec["elasticPolicy"]
    workers = spec["pytorchReplicaSpecs"]["Worker"]
    env = {"PYTHONUNBUFFERED": "0"}
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    port = policy.get("rdzvPort")
    if port is None:  # the port named pytorchjob-port of the container named pytorch
        container = next(
            c for c in workers["template"]["spec"]["containers"] if c["name"] == "pytorch"
        )
        port = next(
            p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port"
        )
    env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
    env["PET_RDZV_BACKEND"] = policy.get("rdzvBackend", "c10d")
    if policy.get("minReplicas") is None and policy.get("maxReplicas") is None:
        env["PET_NNODES"] = str(workers["replicas"])
    else:
        env["PET_NNODES"] = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    if policy.get("maxRestarts") is not None:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if policy.get("nProcPerNode") is not None:
        env["PET_NPROC_PER_NODE"] = str(policy["nProcPerNode"])
    if policy.get("rdzvId") is not None:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if policy.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


def _container_args(job: dict[str, Any], pod_ip: str) -> list[str]:
    """The container's args as the kubelet passes them: $(POD_IP) expanded."""
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    return [arg.replace("$(POD_IP)", pod_ip) for arg in container["args"]]


def test_pytorchjob_sets_the_variables_rallypoint_reads() -> None:
    env = pytorchjob_elastic_env(_pytorchjob())
    assert env == {
        "PYTHONUNBUFFERED": "0",
        "PET_RDZV_ENDPOINT": "rallypoint-etcd:2379",
        "PET_RDZV_BACKEND": "etcd",
        "PET_NNODES": "2:4",
        "PET_MAX_RESTARTS": "3",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_ID": "rallypoint-digits-1",
        "PET_RDZV_CONF": "last_call_timeout=15,heartbeat_timeout=15",
    }


def test_pytorchjob_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, handed_configs: list[LaunchConfig]
) -> None:
    """``rallypoint run`` with exactly the manifest's PET_* variables and container args:
    the configuration it hands the agent (the agent itself is not started: the etcd host
    of the manifest exists only in the cluster)."""
    from typer.testing import CliRunner

    from rallypoint_cli.main import build_app

    for name in list(os.environ):
        if name.startswith(("PET_", "RALLYPOINT_")):
            monkeypatch.delenv(name)
    script = tmp_path / "opt" / "rallypoint" / "examples" / "train_digits.py"
    script.parent.mkdir(parents=True)
    script.write_text("")
    args = [
        str(script) if arg == "/opt/rallypoint/examples/train_digits.py" else arg
        for arg in _container_args(_pytorchjob(), "10.1.2.3")
    ]
    env = pytorchjob_elastic_env(_pytorchjob())
    result = CliRunner().invoke(build_app(build_plugin_manager()), args, env=env)
    assert result.exit_code == 0, result.output
    (config,) = handed_configs
    assert (config.min_nodes, config.max_nodes) == (2, 4)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("etcd", "rallypoint-etcd:2379")
    assert config.rdzv_id == "rallypoint-digits-1"
    assert config.rdzv_conf["last_call_timeout"] == 15
    assert config.rdzv_conf["heartbeat_timeout"] == 15
    assert (config.max_restarts, config.nproc_per_node) == (3, 1)
    assert config.local_addr == "10.1.2.3"
    assert config.metrics == ("prometheus",) and config.metrics_conf["port"] == 9400
    assert config.training_script_args == ("--epochs=20",)


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _worker_envs(output: str) -> list[dict[str, str]]:
    envs = []
    for line in output.splitlines():
        _, sep, payload = line.partition("]:")
        if sep and payload.startswith("{"):
            envs.append(json.loads(payload))
    return envs


def test_pytorchjob_trains_with_only_pet_variables(etcd_server: EtcdServer, tmp_path: Path) -> None:
    """Two agents started with nothing but the PET_* variables of the manifest (its etcd
    host replaced by a local etcd, its last call shortened) form one job of 2 nodes."""
    job = _pytorchjob()
    host, port = etcd_server.endpoint.split(":")
    policy = job["spec"]["elasticPolicy"]
    policy["rdzvHost"], policy["rdzvPort"] = host, int(port)
    policy["rdzvConf"] = [
        {"key": "last_call_timeout", "value": "1"} if c["key"] == "last_call_timeout" else c
        for c in policy["rdzvConf"]
    ]
    pet = pytorchjob_elastic_env(job)
    events = tmp_path / "events.jsonl"
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    agents = []
    try:
        for log in logs:
            with log.open("w") as handle:
                agents.append(
                    subprocess.Popen(
                        [RALLYPOINT, "run", worker("dump_env.py")],
                        env=clean_environment({**pet, "RALLYPOINT_EVENT_LOG": str(events)}),
                        stdout=handle,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
        codes = [agent.wait(timeout=TIMEOUT) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=10)
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs
    workers = [env for output in outputs for env in _worker_envs(output)]
    assert len(workers) == 2  # PET_NPROC_PER_NODE=1 on each of 2 nodes
    assert sorted(env["RANK"] for env in workers) == ["0", "1"]
    for env in workers:
        assert env["WORLD_SIZE"] == "2"
        assert env["GROUP_WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == "rallypoint-digits-1"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    started = [e for e in _events(events) if e["event"] == "agent_started"]
    assert [(e["min_nodes"], e["max_nodes"], e["nproc_per_node"]) for e in started] == [
        (2, 4, 1),
        (2, 4, 1),
    ]


def test_default_elastic_policy_on_c10d(tmp_path: Path) -> None:
    """The operator's defaults: c10d at <job>-worker-0:<pytorchjob-port>, hosted by that
    worker's agent (here, this host), and PET_STANDALONE, which the operator sets to an
    empty value and which, empty, changes nothing (torchrun would fail to parse it)."""
    job = _pytorchjob()
    job["metadata"]["name"] = "digits"
    job["spec"]["elasticPolicy"] = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "rdzvId": "digits-1",
        "rdzvConf": [{"key": "last_call_timeout", "value": "0.5"}],
        "maxRestarts": 1,
        "nProcPerNode": 2,
        "standalone": False,
    }
    pet = pytorchjob_elastic_env(job)
    assert pet["PET_RDZV_ENDPOINT"] == "digits-worker-0:23456"
    assert pet["PET_RDZV_BACKEND"] == "c10d"
    pet["PET_RDZV_ENDPOINT"] = f"localhost:{free_port()}"  # this host is worker 0
    pet["PET_STANDALONE"] = ""
    events = tmp_path / "events.jsonl"
    result = rallypoint(
        "run",
        worker("dump_env.py"),
        env={**pet, "RALLYPOINT_EVENT_LOG": str(events)},
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    workers = _worker_envs(result.stdout)
    assert sorted(env["LOCAL_RANK"] for env in workers) == ["0", "1"]
    for env in workers:
        assert env["WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == "digits-1"  # not a --standalone UUID
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "1"
    (started,) = [e for e in _events(events) if e["event"] == "agent_started"]
    assert (started["min_nodes"], started["max_nodes"]) == (1, 2)


# --- Slurm: --nnodes auto -------------------------------------------------------------------

#: All that ``scontrol show hostnames`` needs: a configuration, no running slurmctld.
_SCONTROL_CONF = "ClusterName=rallypoint-test\nSlurmctldHost=localhost\n"


def _configure_scontrol(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not found: apt-get install slurm-client")
    conf = directory / "slurm.conf"
    conf.write_text(_SCONTROL_CONF)
    monkeypatch.setenv("SLURM_CONF", str(conf))


@pytest.fixture(params=["scontrol", "python-hostlist"])
def hostlist_tool(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> str:
    """Host lists expanded by Slurm's scontrol, or by python-hostlist where it is missing."""
    if request.param == "scontrol":
        _configure_scontrol(monkeypatch, tmp_path)
    else:
        monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol on it
    return str(request.param)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("a[1-2],login,b[09-10]", ["a1", "a2", "login", "b09", "b10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("n[1-2].cluster.org", ["n1.cluster.org", "n2.cluster.org"]),
        ("node[3]", ["node3"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str], hostlist_tool: str) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node[a-b]", "node[4-2]", "node]1[", "", "node[]"])
def test_expand_hostlist_rejects(text: str, hostlist_tool: str) -> None:
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST") as caught:
        expand_hostlist(text)
    (line,) = str(caught.value).splitlines()
    assert line.endswith(".")


def test_expand_hostlist_asks_scontrol_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _configure_scontrol(monkeypatch, tmp_path)

    def unused(*args: object, **kwargs: object) -> list[str]:
        raise AssertionError("python-hostlist was asked although scontrol can answer")

    monkeypatch.setattr("hostlist.expand_hostlist", unused)
    hosts = ["node01", "node02", "node03", "node04", "node07", "login"]
    assert expand_hostlist("node[01-04,07],login") == hosts


def test_expand_hostlist_bounds_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """scontrol retries for a minute when SLURM_CONF names a missing file: the agent gives
    up on it after SCONTROL_TIMEOUT and asks python-hostlist."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not found: apt-get install slurm-client")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    monkeypatch.setattr("rallypoint.slurm.SCONTROL_TIMEOUT", 0.5)
    assert expand_hostlist("gpu[07-09,12]") == ["gpu07", "gpu08", "gpu09", "gpu12"]


SLURM_ENV = {
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[07-09,12]",
}


def test_nnodes_auto_reads_slurm(hostlist_tool: str) -> None:
    values: dict[str, Any] = {"rdzv_backend": "static", "rdzv_id": "none", "node_rank": 0}
    assert apply_slurm(values, SLURM_ENV) == "4"
    assert values == {
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"gpu07:{SLURM_RDZV_PORT + 456}",
        "rdzv_id": "123456",
        "node_rank": 2,
    }


def test_nnodes_auto_keeps_explicit_flags() -> None:
    values: dict[str, Any] = {
        "rdzv_backend": "etcd",
        "rdzv_endpoint": "etcd0:2379",
        "rdzv_id": "mine",
        "node_rank": 0,
    }
    apply_slurm(values, SLURM_ENV)
    assert values["rdzv_backend"] == "etcd"
    assert values["rdzv_endpoint"] == "etcd0:2379"
    assert values["rdzv_id"] == "mine"
    values = {"rdzv_backend": "c10d", "rdzv_endpoint": "head:29999"}
    apply_slurm(values, SLURM_ENV)
    assert values["rdzv_endpoint"] == "head:29999"


def test_nnodes_auto_outside_slurm(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    env = {k: v for k, v in SLURM_ENV.items() if k != "SLURM_NODEID"}
    with pytest.raises(UsageError, match=r"^--nnodes auto .* SLURM_NODEID is not set"):
        apply_slurm({}, env)
    unset = dict.fromkeys(SLURM_ENV, "")  # even when the tests run inside a Slurm job
    result = rallypoint("run", "--nnodes", "auto", str(script), env=unset, timeout=TIMEOUT)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("rallypoint: error: --nnodes auto reads the Slurm job's shape")
    assert "SLURM_JOB_NUM_NODES, SLURM_NODEID, SLURM_JOB_ID, SLURM_JOB_NODELIST are not set" in line


def test_nnodes_auto_runs_a_one_node_job(tmp_path: Path) -> None:
    """The variables srun sets, on one node: the run id is the Slurm job's."""
    env = {
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": socket.gethostname(),
    }
    result = rallypoint(
        "run", "--nnodes", "auto", "--nproc-per-node", "2", worker("dump_env.py"),
        env=env, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    workers = _worker_envs(result.stdout)
    assert len(workers) == 2
    assert {env["TORCHELASTIC_RUN_ID"] for env in workers} == {"77"}


_SLURM_CONF = """\
ClusterName=rallypoint-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
# One host, no munge needed: the test cluster trusts its own loopback.
AuthType=auth/none
CredType=cred/none
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-host Slurm cluster (slurmctld and slurmd in the foreground); yields the
    environment for its client commands."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("starting slurmctld and slurmd takes root")
    binaries = {
        name: find_binary(name) for name in ("slurmctld", "slurmd", "srun", "sbatch", "sinfo")
    }
    missing = sorted(name for name, path in binaries.items() if path is None)
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: apt-get install slurm-wlm")
    directory = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (directory / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = directory / "slurm.conf"
    ctld_port, slurmd_port = free_ports(2)
    conf.write_text(
        _SLURM_CONF.format(host=host, ctld_port=ctld_port, slurmd_port=slurmd_port, dir=directory)
    )
    env = {k: v for k, v in clean_environment().items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        for command in (
            [binaries["slurmctld"], "-D", "-i", "-f", str(conf)],
            [binaries["slurmd"], "-D", "-f", str(conf), "-N", host],
        ):
            with (directory / f"{Path(str(command[0])).name}.out").open("wb") as log:
                daemons.append(
                    subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + 30
        state = ""
        while state != "idle":  # slurmd registers with slurmctld: nothing to wait on
            assert all(d.poll() is None for d in daemons), _slurm_logs(directory)
            assert time.monotonic() < deadline, f"node is {state!r}\n{_slurm_logs(directory)}"
            time.sleep(0.2)
            state = subprocess.run(
                [str(binaries["sinfo"]), "-h", "-N", "-o", "%t"],
                env=env, capture_output=True, text=True, timeout=10,
            ).stdout.strip()  # fmt: skip
        yield env
    finally:
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=5)


def _slurm_logs(directory: Path) -> str:
    return "\n".join(
        f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
        for path in sorted(directory.glob("*.out")) + sorted(directory.glob("*.log"))
    )


def test_srun_trains_with_nnodes_auto(slurm: dict[str, str], tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    result = subprocess.run(
        [
            "srun", "--nodes=1", "--ntasks=1", "--cpus-per-task=2", f"--chdir={ROOT}",
            "--time=2", "bash", "-c", 'echo "job $SLURM_JOB_ID"; exec "$@"', "srun",
            RALLYPOINT, "run", "--nnodes", "auto", "--nproc-per-node", "2",
            "--event-log", str(events), worker("allreduce.py"), "5",
        ],
        env=slurm, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"^job (\d+)$", result.stdout, re.MULTILINE)
    assert job_id, result.stdout
    assert "done rank=0 world=2 attempt=0" in result.stdout
    assert "done rank=1 world=2 attempt=0" in result.stdout
    started = next(e for e in _events(events) if e["event"] == "agent_started")
    assert (started["min_nodes"], started["max_nodes"]) == (1, 1)
    assert started["run_id"] == job_id.group(1)


def test_sbatch_example_runs(slurm: dict[str, str], tmp_path: Path) -> None:
    """deploy/slurm/train.sbatch as written, its size and script given from outside."""
    output = tmp_path / "slurm.out"
    events = tmp_path / "events.jsonl"
    env = {
        **slurm,
        "RALLYPOINT": RALLYPOINT,
        "NPROC_PER_NODE": "2",
        "TRAIN_SCRIPT": worker("allreduce.py"),
        "TRAIN_ARGS": "5",
        "CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "RALLYPOINT_EVENT_LOG": str(events),
    }
    result = subprocess.run(
        [
            "sbatch", "--wait", "--nodes=1", "--cpus-per-task=2", "--time=2",
            f"--chdir={ROOT}", f"--output={output}", str(SLURM_EXAMPLE),
        ],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    log = output.read_text() if output.exists() else ""
    assert result.returncode == 0, result.stdout + result.stderr + log
    assert "done rank=0 world=2 attempt=0" in log
    assert "done rank=1 world=2 attempt=0" in log
    job_id = re.search(r"Submitted batch job (\d+)", result.stdout)
    assert job_id, result.stdout
    assert {e["run_id"] for e in _events(events)} == {job_id.group(1)}


# --- the container image --------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    instructions = []
    for line in lines:
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def _dockerignore() -> list[re.Pattern[str]]:
    """.dockerignore's patterns (this file uses no ``!`` exceptions) as regular expressions
    over paths relative to the context; ``**`` spans directories, ``*`` does not."""
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("!"), "the check below does not handle exceptions"
        regex = ""
        for part in re.split(r"(\*\*/|\*|\?)", line.strip("/")):
            regex += {"**/": "(?:.*/)?", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        patterns.append(re.compile(regex))
    return patterns


def _in_context(relative: str, patterns: list[re.Pattern[str]]) -> bool:
    parts = relative.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return not any(p.fullmatch(prefix) for p in patterns for prefix in prefixes)


def test_dockerfile_shape() -> None:
    instructions = _dockerfile()
    froms = [args for keyword, args in instructions if keyword == "FROM"]
    assert all(re.match(r"python:\$\{PYTHON_VERSION\}-slim\b", f) for f in froms), froms
    final = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    runtime = instructions[final:]
    args = {a.split("=")[0] for keyword, a in instructions if keyword == "ARG"}
    assert {"PYTHON_VERSION", "TORCH_VERSION", "TORCH_INDEX_URL", "PLUGINS", "EXTRAS"} <= args
    users = [a for keyword, a in runtime if keyword == "USER"]
    assert users and not users[-1].startswith(("0", "root")), users
    assert ("ENTRYPOINT", '["rallypoint"]') in runtime
    # torch comes pinned from the chosen index, before anything could pull it from PyPI.
    pip = [a for keyword, a in runtime if keyword == "RUN" and "pip install" in a]
    assert "torch==${TORCH_VERSION}" in pip[0] and "${TORCH_INDEX_URL}" in pip[0]
    # Every plugin the PLUGINS argument may name is a plugin of this repository.
    build = " ".join(a for keyword, a in instructions[:final] if keyword == "RUN")
    for folder in re.findall(r'dirs="\$dirs (plugins/\w+)"', build):
        assert (ROOT / folder / "pyproject.toml").is_file(), folder


def test_dockerfile_copies_what_the_context_holds() -> None:
    patterns = _dockerignore()
    sources = []
    for keyword, args in _dockerfile():
        if keyword == "COPY" and not args.startswith("--from"):
            sources.extend(args.split()[:-1])
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
        assert _in_context(source, patterns), f"COPY {source}: .dockerignore leaves it out"
    assert not _in_context(".venv/bin/python", patterns)
    assert not _in_context("core/rallypoint/__pycache__/config.cpython-311.pyc", patterns)
    assert not _in_context("plugins/rendezvous_etcd/build/lib/x.py", patterns)


def _run_steps() -> list[str]:
    """The shell of the Dockerfile's RUN instructions that pick wheels and plugins."""
    return [args for keyword, args in _dockerfile() if keyword == "RUN" and "for " in args]


def test_dockerfile_install_steps(tmp_path: Path) -> None:
    """The two RUN steps' shell, with ``pip`` and ``rallypoint`` as stubs that print."""
    build, install = _run_steps()
    stubs = 'pip() { echo "pip $*"; }; rallypoint() { echo "rallypoint $*"; }; '
    picked = subprocess.run(
        ["sh", "-c", stubs + build],
        env={"PATH": os.environ["PATH"], "PLUGINS": "etcd prometheus"},
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert picked.returncode == 0, picked.stderr
    assert picked.stdout.split()[-2:] == ["plugins/rendezvous_etcd", "plugins/metrics_prometheus"]
    wrong = subprocess.run(
        ["sh", "-c", stubs + build],
        env={"PATH": os.environ["PATH"], "PLUGINS": "consul"},
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert wrong.returncode == 2 and "unknown plugin 'consul'" in wrong.stderr
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("rallypoint-0.1.0", "rallypoint_etcd-0.1.0", "rallypoint_prometheus-0.1.0"):
        (wheels / f"{name}-py3-none-any.whl").touch()
    installed = subprocess.run(
        ["sh", "-c", stubs + install.replace("/tmp/wheels", str(wheels))],
        env={"PATH": os.environ["PATH"], "EXTRAS": "examples"},
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    pip_line = installed.stdout.splitlines()[0].split()
    assert pip_line[:3] == [
        "pip",
        "install",
        f"{wheels}/rallypoint-0.1.0-py3-none-any.whl[examples]",
    ]
    assert sorted(Path(w).name.split("-")[0] for w in pip_line[3:]) == [
        "rallypoint_etcd",
        "rallypoint_prometheus",
    ]
    assert not wheels.exists()  # removed after installing


def test_image_wheels_build_from_the_context(tmp_path: Path) -> None:
    """The build stage's `pip wheel`, on a copy of the files the context holds."""
    patterns = _dockerignore()
    context = tmp_path / "context"
    sources = ["pyproject.toml", "README.md", "core", "cli", "plugins"]
    for source in sources:
        for path in [ROOT / source, *(ROOT / source).rglob("*")]:
            relative = path.relative_to(ROOT).as_posix()
            if path.is_file() and _in_context(relative, patterns):
                target = context / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    plugins = ["plugins/rendezvous_etcd", "plugins/rendezvous_redis", "plugins/metrics_prometheus"]
    result = subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--wheel-dir", str(tmp_path / "wheels"), ".", *plugins,
        ],
        cwd=context, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = sorted(p.name.split("-")[0] for p in (tmp_path / "wheels").glob("*.whl"))
    assert wheels == ["rallypoint", "rallypoint_etcd", "rallypoint_prometheus", "rallypoint_redis"]


def _docker_daemon() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    info = subprocess.run([docker, "info"], capture_output=True, timeout=TIMEOUT)
    return info.returncode == 0


@pytest.mark.skipif(
    os.environ.get("RALLYPOINT_TEST_DOCKER_BUILD") != "1",
    reason="builds the image (minutes, downloads torch): set RALLYPOINT_TEST_DOCKER_BUILD=1",
)
def test_image_builds_and_runs() -> None:
    if not _docker_daemon():
        pytest.skip("no Docker daemon reachable (docker info failed)")
    tag = "rallypoint:test"
    build = subprocess.run(
        ["docker", "build", "-t", tag, str(ROOT)], capture_output=True, text=True, timeout=1800
    )
    assert build.returncode == 0, build.stderr[-4000:]
    plugins = subprocess.run(
        ["docker", "run", "--rm", tag, "plugins", "--json"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert plugins.returncode == 0, plugins.stderr
    for name in ("etcd", "redis", "prometheus"):
        assert name in plugins.stdout
    whoami = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "id", tag, "-u"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert whoami.stdout.strip() == "1000"
    train = subprocess.run(
        [
            "docker", "run", "--rm", tag, "run", "--standalone", "--nproc-per-node", "2",
            "/opt/rallypoint/examples/train_digits.py", "--epochs", "1",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
