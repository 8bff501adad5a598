"""The deployment files agree with the code and with each other: Dockerfile, k8s, sbatch.

Nothing here needs docker, a cluster or Slurm: the Kubernetes manifests are validated offline
against the JSON schemas bundled with ``kubernetes-validate``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from kvstore.config import ServerConfig, parse_server_list
from kvstore.deploy.__main__ import build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.30.0"


# Dockerfile ------------------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # continuation lines
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_dockerfile_copies_files_that_exist():
    copies = [rest.split() for keyword, rest in _dockerfile_instructions() if keyword == "COPY"]
    assert copies
    for words in copies:
        assert not any(w.startswith("--") for w in words), "no COPY flags expected"
        for source in words[:-1]:  # the build context is the repository root
            assert (REPO / source).exists(), f"COPY {source}: no such file"
    copied = {Path(s).parts[0] for words in copies for s in words[:-1]}
    # every folder the package is built from (kvstore/ and the folders its symlinks lead to),
    # and its metadata files
    links = [p for p in (REPO / "kvstore").iterdir() if p.is_symlink()]
    assert links, "kvstore/ reaches the card's folders through symlinks"
    folders = {"kvstore"} | {p.resolve().relative_to(REPO).as_posix() for p in links}
    assert folders | {"pyproject.toml", "README.md"} <= copied


def test_dockerfile_installs_existing_extras_with_the_pinned_cpu_torch():
    instructions = _dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    assert "ENTRYPOINT" not in {keyword for keyword, _ in instructions}
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    extras = re.findall(r'"\.\[([^\]]*)\]"', runs)
    assert extras, "the Dockerfile installs the package with extras"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    known = set(pyproject["project"]["optional-dependencies"])
    for group in extras:
        named = {e.strip() for e in group.split(",")}
        assert named <= known, f"unknown extras {named - known}"
        assert {"torch", "examples", "metrics"} <= named
    torch = re.search(r"pip install (--index-url \S+) (torch==\S+)", runs)
    assert torch and torch.group(2) == "torch==2.13.0"
    assert torch.group(1) == "--index-url https://download.pytorch.org/whl/cpu"


# Slurm -----------------------------------------------------------------------------------------


def test_the_sbatch_example_runs_the_slurm_launcher():
    script = DEPLOY / "slurm" / "job.sbatch"
    lines = [line.strip() for line in script.read_text().splitlines()]
    launches = [line for line in lines if line.startswith("kvstore-launch ")]
    assert len(launches) == 1
    args = build_parser().parse_args(shlex.split(launches[0])[1:])
    assert args.launcher == "slurm" and args.num_workers == 4 and args.num_servers == 2
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    assert command[0] == "python3" and (REPO / command[1]).is_file()
    directives = [line.split(None, 1)[1] for line in lines if line.startswith("#SBATCH ")]
    assert "--nodes=2" in directives
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


# Kubernetes ------------------------------------------------------------------------------------


def _manifests() -> dict[str, dict]:
    yaml = pytest.importorskip("yaml")
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs[doc["kind"]] = doc
    return docs


def test_manifests_are_valid_kubernetes_objects():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = _manifests()
    assert set(docs) == {"Kustomization", "Secret", "Service", "StatefulSet", "Job"}
    for kind, doc in docs.items():
        if kind != "Kustomization":  # a kustomize file, not an API object
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = _manifests()["Kustomization"]
    others = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(others)
    if shutil.which("kubectl"):  # kustomize's own build, offline, where kubectl is installed
        result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _server_words(statefulset: dict) -> list[str]:
    command = _container(statefulset)["command"]
    assert command[:2] == ["sh", "-c"]
    words = shlex.split(command[2])
    assert words[:2] == ["exec", "kvstore-server"]
    return words[2:]


def test_servers_and_workers_agree():
    from kvstore.server.__main__ import parse_args  # noqa: PLC0415

    docs = _manifests()
    service, statefulset, job = docs["Service"], docs["StatefulSet"], docs["Job"]
    replicas = statefulset["spec"]["replicas"]

    # the headless service names the StatefulSet's pods
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    (container_port,) = _container(statefulset)["ports"]
    assert port["targetPort"] == container_port["name"]

    # the servers' command line, read by the server's own parser (rank: see the next test)
    words = _server_words(statefulset)
    words[words.index("--server-rank") + 1] = "0"
    config = parse_args(words)
    assert config.host == "0.0.0.0"
    assert config.port == port["port"] == container_port["containerPort"]
    assert config.num_servers == replicas

    # the workers: an indexed job of N pods, rank from the completion index
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    num_workers = int(_env(_container(job))["KVSTORE_NUM_WORKERS"]["value"])
    assert spec["completions"] == spec["parallelism"] == num_workers == config.num_workers
    rank = _env(_container(job))["KVSTORE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    servers = parse_server_list(
        "KVSTORE_SERVERS", _env(_container(job))["KVSTORE_SERVERS"]["value"]
    )
    name, service_name = statefulset["metadata"]["name"], service["metadata"]["name"]
    assert servers == tuple(
        f"tcp://{name}-{i}.{service_name}:{port['port']}" for i in range(replicas)
    )


def test_servers_are_replicated_and_know_each_other():
    """Both sides have the same KVSTORE_REPLICAS (2 <= R <= S: a restarted pod catches up), and
    the servers the workers' KVSTORE_SERVERS, which each server reads as its peers' addresses:
    a pod that Kubernetes restarts comes back at its name and port and catches up from them."""
    docs = _manifests()
    statefulset, job = docs["StatefulSet"], docs["Job"]
    server_env, worker_env = _env(_container(statefulset)), _env(_container(job))
    replicas = server_env["KVSTORE_REPLICAS"]["value"]
    assert worker_env["KVSTORE_REPLICAS"]["value"] == replicas
    assert server_env["KVSTORE_SERVERS"]["value"] == worker_env["KVSTORE_SERVERS"]["value"]
    env = {name: server_env[name]["value"] for name in ("KVSTORE_REPLICAS", "KVSTORE_SERVERS")}
    words = _server_words(statefulset)
    config = ServerConfig.from_env(
        env,
        server_rank=0,
        num_servers=int(words[words.index("--num-servers") + 1]),
        num_workers=int(words[words.index("--num-workers") + 1]),
    )
    assert 2 <= config.replicas == int(replicas) <= config.num_servers
    assert config.peers == parse_server_list("KVSTORE_SERVERS", env["KVSTORE_SERVERS"])


def test_the_server_rank_is_the_pods_ordinal(tmp_path):
    """Run the server's shell command with a stand-in kvstore-server that prints its rank."""
    if not shutil.which("sh"):
        pytest.skip("no sh")
    stand_in = tmp_path / "kvstore-server"
    stand_in.write_text('#!/bin/sh\nwhile [ "$1" != --server-rank ]; do shift; done\necho "$2"\n')
    stand_in.chmod(0o755)
    command = _container(_manifests()["StatefulSet"])["command"]
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    for pod, rank in (("pskv-server-0", "0"), ("pskv-server-12", "12")):
        result = subprocess.run(command, env={**env, "HOSTNAME": pod}, capture_output=True)
        assert result.stdout.decode().strip() == rank, result.stderr


def test_the_job_secret_is_mounted_by_both():
    docs = _manifests()
    secret = docs["Secret"]
    keys = set(secret["stringData"])
    assert keys == {
        "server-secret-key",
        "server-public-key",
        "client-secret-key",
        "client-public-key",
    }
    mounted = {}
    for kind in ("StatefulSet", "Job"):
        pod = docs[kind]["spec"]["template"]["spec"]
        (volume,) = pod["volumes"]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        items = {item["key"] for item in volume["secret"]["items"]}
        assert items <= keys
        (mount,) = _container(docs[kind])["volumeMounts"]
        assert mount["name"] == volume["name"] and mount["readOnly"] is True
        mounted[kind] = items
    # each side gets its own secret key only
    assert "client-secret-key" not in mounted["StatefulSet"]
    assert "server-secret-key" not in mounted["Job"]


def test_both_read_the_mounted_keys(tmp_path):
    """KVSTORE_AUTH_DIR points at the mount, and what each side mounts is what it reads."""
    from kvstore.auth import JobKeys  # noqa: PLC0415
    from kvstore.config import curve_keys_from_env  # noqa: PLC0415

    docs = _manifests()
    keys = JobKeys.generate()
    secret = keys.k8s_secret(docs["Secret"]["metadata"]["name"])
    data = pytest.importorskip("yaml").safe_load(secret)["stringData"]
    assert set(data) == set(docs["Secret"]["stringData"])
    for kind, role in (("StatefulSet", "server"), ("Job", "worker")):
        (mount,) = _container(docs[kind])["volumeMounts"]
        assert _env(_container(docs[kind]))["KVSTORE_AUTH_DIR"]["value"] == mount["mountPath"]
        (volume,) = docs[kind]["spec"]["template"]["spec"]["volumes"]
        folder = tmp_path / role
        folder.mkdir()
        for item in volume["secret"]["items"]:
            (folder / item["path"]).write_text(data[item["key"]])
        assert curve_keys_from_env(role, {"KVSTORE_AUTH_DIR": str(folder)}) == keys.for_role(role)
