"""The Kubernetes control plane for real: the gateway and scheduler objects the program renders for dev (Deployments,
Services, the Secret, the ConfigMap, the scheduler's PersistentVolumeClaim, as Pulumi's mocks record them) are run
with `podman kube play` on the pdserve runtime image. Both become ready on their own probes, a prefill/decode pair
registers with the scheduler, a completion goes through the gateway, and the scheduler's weights outlive its pod.

What this test rewrites in the rendered objects, and why (nothing else is touched):
- every object name gets this run's prefix (and so do the references to them: secretName, configMap name,
  claimName), so nothing clashes with another run or with tests/local;
- the container images: ECR references become the runtime image built here (`serving/build-image.sh`);
- the Secret is not played: podman 4.3's kube play has no Secret kind. Each secret volume gets a podman secret
  holding the Secret's object with the volume's `items` applied (its keys renamed to the items' paths, the others
  left out: podman 4.3 ignores `items` and would mount every key under its own name), the values under `data`
  undecoded (podman 4.3 writes `data` out as it is, where Kubernetes would base64-decode it); kube play's `secret`
  volumes read such podman secrets;
- cluster DNS names in the gateway's settings (`scheduler.<ns>.svc.cluster.local`, `ratelimit.<ns>...`) become
  the addresses the pods have here: podman has no cluster DNS and its pods have no Service in front of them. The
  rate-limit store is Redis on the host, run with the Secret's own redis.conf;
- the containers' `ports` are left out: podman 4.3 publishes each containerPort on the host (Kubernetes publishes
  none), which clashes between replicas and with the host's own listeners;
- TLS is left out (the tls volume, its mount, the PDSERVE_TLS_* settings, the store's tls-* lines and its rediss://
  URL; the gateway is told it may then serve plain HTTP): the pods are reached here by addresses podman picks at play
  time, which no certificate made before can name. The rendered TLS wiring is checked against pdserve's settings in
  test_contract_runtime.py, and pdserve's TLS itself by tests/pdserve/test_pdserve_tls.py;
- the claim's storageClassName (EBS) is left out: a claim here is a podman named volume;
- the probes are left out of what podman runs and the test is the kubelet: podman would turn an httpGet probe into a
  `curl` health check, and the image has no curl. The test polls each container's readiness and liveness probes
  (path, named port and timeout as rendered) on each pod's address until they pass, as the kubelet does;
- the Services are not played (podman has no Service kind) and the test is kube-proxy: a Service's address is the
  pods its selector matches, on the container port its targetPort names.
Every pod's infra container is the runtime image waiting for SIGTERM (podman builds its default one from catatonit,
which this host need not have). The prefill/decode pair runs as host processes with the contract's settings
(playbooks/vars/contract/dev.yml). Everything named with the run's prefix is removed at the end, failed or not.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infra.workloads.common import SECRET_NAME, TLS_VOLUME
from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.scheduler.identity import derive_token
from pdstack.contract.components import METRICS_TOKEN
from pdstack.local import nodes
from pdstack.local.images import remove_older_builds, source_hash
from pdstack.synth.synthesis import Synthesis
from tests.support import REPO
from tests.support.ports import free_port

ENV = "dev"
PODMAN = shutil.which("podman")
REDIS = shutil.which("redis-server")
IMAGE_REPOSITORY = "localhost/pdstack-kubeplay-pdserve"
LOCAL_RUNTIME_REPOSITORY = "localhost/pdserve"  # pdstack.local.images.build_runtime_image: same sources, same tag
PLAYED = ("scheduler", "gateway")
READY_TIMEOUT_S = 180.0  # a loaded CI host; the wait ends as soon as the probe passes
EVERY_ADDRESS = "0.0.0.0"  # where free ports are looked for: the pods reach them through the podman bridge


PODMAN_ENV: dict[str, str] = {}  # CONTAINERS_CONF once the run's pause image is known (infra_image)


def podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    assert PODMAN is not None, "podman is not installed"
    done = subprocess.run(
        [PODMAN, *args], capture_output=True, text=True, check=False, timeout=timeout, env={**os.environ, **PODMAN_ENV}
    )
    assert not check or done.returncode == 0, f"podman {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


def runtime_image() -> str:
    """The runtime image of serving/'s current sources under this test's own name: re-tagged from `pdstack local`'s
    build of the same sources when there is one (CI builds it for tests/local), else built."""
    tag = f"src-{source_hash(REPO, ['serving'])}"
    image = f"{IMAGE_REPOSITORY}:{tag}"
    if nodes.image_exists(image):
        return image
    local = f"{LOCAL_RUNTIME_REPOSITORY}:{tag}"
    if nodes.image_exists(local):
        podman("tag", local, image)
    else:
        built = subprocess.run(
            ["bash", str(REPO / "serving" / "build-image.sh"), image],
            capture_output=True,
            text=True,
            check=False,
            timeout=1800,
        )
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    remove_older_builds(image)
    return image


PAUSE = "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); signal.pause()"
PAUSE_CONTAINERFILE = f'FROM {{runtime}}\nENTRYPOINT ["python3", "-c", "{PAUSE}"]\n'


def use_pause_image(runtime: str, folder: Path) -> None:
    """Every pod has an infra container holding its namespaces; podman builds its default one from catatonit, which
    this host need not have. The pods' infra image here is the runtime image waiting for SIGTERM, set as
    containers.conf's infra_image for this test's podman calls only (the host's containers.conf otherwise)."""
    image = f"{IMAGE_REPOSITORY}-pause:{runtime.rsplit(':', 1)[1]}"
    if not nodes.image_exists(image):
        (folder / "Containerfile").write_text(PAUSE_CONTAINERFILE.format(runtime=runtime))
        podman("build", "-t", image, str(folder))
        remove_older_builds(image)
    host = Path("/etc/containers/containers.conf")
    text = host.read_text() if host.is_file() else ""
    line = f'infra_image = "{image}"\n'
    text = text.replace("[engine]\n", "[engine]\n" + line, 1) if "[engine]\n" in text else f"{text}\n[engine]\n{line}"
    (folder / "containers.conf").write_text(text)
    PODMAN_ENV["CONTAINERS_CONF"] = str(folder / "containers.conf")


# -- the rendered objects ------------------------------------------------------------------------------------------


def rendered(graph: Synthesis) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> the object as the program hands it to Kubernetes."""
    return {
        (r.inputs["kind"], r.inputs["metadata"]["name"]): copy.deepcopy(r.inputs)
        for r in graph.resources
        if r.type.startswith("kubernetes:") and "kind" in r.inputs
    }


@dataclass
class Run:
    prefix: str
    image: str
    objects: dict[tuple[str, str], dict[str, Any]]
    tmp: Path
    namespace: str = ""

    def name(self, original: str) -> str:
        return f"{self.prefix}-{original}"

    def pods(self, app: str) -> list[str]:
        """kube play names a Deployment's pods <deployment>-pod-<i>."""
        return [f"{self.name(app)}-pod-{i}" for i in range(self.deployment(app)["spec"]["replicas"])]

    @property
    def secret(self) -> dict[str, Any]:
        return self.objects[("Secret", SECRET_NAME)]

    def deployment(self, app: str) -> dict[str, Any]:
        return self.objects[("Deployment", app)]

    def container(self, app: str) -> dict[str, Any]:
        container: dict[str, Any] = self.deployment(app)["spec"]["template"]["spec"]["containers"][0]
        return container


def playable(run: Run, app: str, env_rewrites: dict[str, str]) -> list[dict[str, Any]]:
    """The documents kube play gets for one app: its Deployment (rewritten as the module docstring says) and the
    ConfigMaps and PersistentVolumeClaims its pod uses."""
    deployment = copy.deepcopy(run.deployment(app))
    deployment["metadata"]["name"] = run.name(app)
    pod = deployment["spec"]["template"]["spec"]
    docs: list[dict[str, Any]] = []
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != TLS_VOLUME]  # TLS left out: module docstring
    for volume in pod["volumes"]:
        if "secret" in volume:  # kube play copies it into a named volume of the secret's name
            source = volume["secret"]
            source["secretName"] = create_secret(run, f"{app}-{volume['name']}", source.pop("items"))
        if "configMap" in volume:  # likewise
            config_map = copy.deepcopy(run.objects[("ConfigMap", volume["configMap"]["name"])])
            config_map["metadata"]["name"] = volume["configMap"]["name"] = run.name(volume["configMap"]["name"])
            docs.append(config_map)
        if "persistentVolumeClaim" in volume:
            claim = copy.deepcopy(run.objects[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])])
            claim["metadata"]["name"] = volume["persistentVolumeClaim"]["claimName"] = run.name(
                volume["persistentVolumeClaim"]["claimName"]
            )
            claim["spec"].pop("storageClassName")  # EBS here is podman's local volume driver
            if podman("volume", "exists", claim["metadata"]["name"], check=False).returncode != 0:
                docs.append(claim)  # made once; a later pod binds the claim that is there
    for container in pod["containers"]:
        container["image"] = run.image
        container.pop("livenessProbe")
        container.pop("readinessProbe")
        container.pop("ports")
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != TLS_VOLUME]
        container["env"] = [e for e in container["env"] if not e["name"].startswith("PDSERVE_TLS_")]
        if app == "gateway":
            container["env"].append({"name": "PDSERVE_ALLOW_PLAINTEXT", "value": "true"})
        for entry in container["env"]:
            entry["value"] = env_rewrites.get(entry["name"], entry["value"])
    return [*docs, deployment]


def create_secret(run: Run, volume: str, items: list[dict[str, str]]) -> str:
    """The podman secret one secret volume reads: the Secret's object with the volume's items applied (podman 4.3
    ignores `items` and mounts every key under its own name), the values under `data` as they are (podman 4.3 writes
    `data` out without base64-decoding it). Its name."""
    secret = copy.deepcopy(run.secret)
    strings = secret.pop("stringData")
    secret["data"] = {i["path"]: strings[i["key"]] for i in items}
    secret["metadata"]["name"] = run.name(volume)
    if podman("secret", "inspect", run.name(volume), check=False).returncode != 0:
        path = run.tmp / "secret.yaml"
        path.write_text(yaml.safe_dump(secret))
        podman("secret", "create", run.name(volume), str(path))
        path.unlink()
    return run.name(volume)


def play(run: Run, app: str, env_rewrites: dict[str, str]) -> list[str]:
    """kube play the app; its pods' addresses on the podman network, one per replica."""
    path = run.tmp / f"{app}.yaml"
    path.write_text(yaml.safe_dump_all(playable(run, app, env_rewrites), sort_keys=False))
    podman("kube", "play", str(path))
    return [pod_address(pod) for pod in run.pods(app)]


def pod_networks(pod: str) -> dict[str, Any]:
    """The podman networks of a pod, by name, with its address on each."""
    infra = podman("pod", "inspect", pod, "--format", "{{.InfraContainerID}}").stdout.strip()
    networks: dict[str, Any] = json.loads(
        podman("inspect", infra, "--format", "{{json .NetworkSettings.Networks}}").stdout
    )
    return {name: n for name, n in networks.items() if n.get("IPAddress")}


def pod_address(pod: str) -> str:
    (network,) = pod_networks(pod).values()
    return str(network["IPAddress"])


def clean_up(run: Run) -> list[str]:
    """Remove every pod, volume and secret named with the run's prefix; what is left."""
    listing = {
        "pod": ("pod", "ls", "--format", "{{.Name}}"),
        "volume": ("volume", "ls", "--format", "{{.Name}}"),
        "secret": ("secret", "ls", "--format", "{{.Name}}"),
    }
    removal = {
        "pod": ("pod", "rm", "--force", "--time", "5"),
        "volume": ("volume", "rm", "--force"),
        "secret": ("secret", "rm"),
    }
    left = []
    for kind in ("pod", "volume", "secret"):  # pods first: they hold the volumes
        mine = [n for n in podman(*listing[kind]).stdout.split() if n.startswith(f"{run.prefix}-")]
        if mine:
            podman(*removal[kind], *mine, check=False)
        left += [f"{kind} {n}" for n in podman(*listing[kind]).stdout.split() if n.startswith(f"{run.prefix}-")]
    return left


# -- the kubelet's part ----------------------------------------------------------------------------------------------


def probe_url(container: dict[str, Any], probe: str, address: str) -> str:
    http = container[probe]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    port = ports[http["port"]] if isinstance(http["port"], str) else http["port"]
    return f"http://{address}:{port}{http['path']}"


def wait_probe(container: dict[str, Any], probe: str, address: str, logs: str) -> None:
    """Until the probe succeeds (2xx/3xx within its timeout, as the kubelet counts it)."""
    spec = container[probe]
    url = probe_url(container, probe, address)
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(url, timeout=spec.get("timeoutSeconds", 1))
            if 200 <= answer.status_code < 400:
                return
            last = f"{answer.status_code} {answer.text[:200]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(min(1.0, spec.get("periodSeconds", 10)))
    raise AssertionError(
        f"{probe} {url} never passed: {last}\n{podman('logs', logs, check=False).stdout[-3000:]}"
        f"{podman('logs', logs, check=False).stderr[-3000:]}"
    )


def service_url(run: Run, service: str, addresses: list[str]) -> str:
    """What a Service sends to: one of the pods its selector matches (the Deployment's template labels), on the
    container port its targetPort names."""
    spec = run.objects[("Service", service)]["spec"]
    template = run.deployment(service)["spec"]["template"]
    assert spec["selector"].items() <= template["metadata"]["labels"].items(), service
    target = spec["ports"][0]["targetPort"]
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    return f"http://{addresses[0]}:{ports[target] if isinstance(target, str) else target}"


# -- the servers behind it ----------------------------------------------------------------------------------------


def contract_env(component: str) -> dict[str, str]:
    loaded = yaml.safe_load((REPO / "playbooks" / "vars" / "contract" / f"{ENV}.yml").read_text())
    env: dict[str, str] = loaded["pdserve_components"][component]["env"]
    return env


def start_server(
    run: Run, role: str, scheduler_url: str, advertise: str, model: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """A model server started as the pdserve role starts it: the contract's settings, its secret files (from the same
    Secret, the instance token derived for its own id), and what only its node knows."""
    folder = run.tmp / role
    folder.mkdir()
    strings = run.secret["stringData"]
    engine_id = hashlib.sha256(f"{run.prefix}/{role}".encode()).hexdigest()[:24]
    env = dict(contract_env(role))
    files = {
        "PDSERVE_KV_KEY_FILE": strings["kv-channel-key"],
        "PDSERVE_API_TOKEN_FILE": strings["server-api-token"],
        "PDSERVE_SCHEDULER_TOKEN_FILE": derive_token(strings["scheduler-identity-key"], f"instance:{role}-{engine_id}"),
    }
    for variable, value in files.items():
        assert variable in env, variable
        path = folder / Path(env[variable]).name
        path.write_text(value)
        env[variable] = str(path)
    port = free_port(EVERY_ADDRESS)
    env |= {
        "PDSERVE_PORT": str(port),
        "PDSERVE_MODEL": str(model),
        "PDSERVE_SERVED_MODEL_NAME": "dense",
        "PDSERVE_ADVERTISE_HOST": advertise,
        "PDSERVE_ENGINE_ID": engine_id,
        "PDSERVE_VERSION": "r1",
        "PDSERVE_SCHEDULER_URL": scheduler_url,
        "PDSERVE_HEARTBEAT_SECONDS": "0.5",
    }
    if role == "prefill":
        env["PDSERVE_KV_PORT"] = str(free_port(EVERY_ADDRESS))
    with (folder / "log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", role], stdout=log, stderr=log, env={**os.environ, **env}
        )
    return process, f"http://127.0.0.1:{port}"


def bridge_gateway(run: Run, app: str) -> str:
    """The host's address on the network `app`'s pods are on (kube play's own, not podman's default, whose bridge
    does not exist on a fresh host until a container uses it): where pods reach the servers and the store."""
    (network,) = pod_networks(run.pods(app)[0])
    out = podman("network", "inspect", network, "--format", "{{range .Subnets}}{{.Gateway}}{{end}}").stdout
    return out.strip()


def without_tls(redis_conf: str) -> str:
    """The store's redis.conf with its TLS lines left out (module docstring), its password and limits kept."""
    return "".join(line for line in redis_conf.splitlines(keepends=True) if not line.startswith(("tls-", "port ")))


@pytest.fixture(scope="module")
def control_plane(graphs: dict[str, Synthesis], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    assert PODMAN is not None and REDIS is not None, "podman and redis-server are needed (scripts/host-setup.sh)"
    tmp = tmp_path_factory.mktemp("kubeplay")
    run = Run(f"pdk{os.getpid()}", runtime_image(), rendered(graphs[f"{ENV}-control"]), tmp)
    (tmp / "pause").mkdir()
    use_pause_image(run.image, tmp / "pause")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        (scheduler_ip,) = play(run, "scheduler", {})
        scheduler_url = service_url(run, "scheduler", [scheduler_ip])
        host = bridge_gateway(run, "scheduler")
        store_port = free_port(EVERY_ADDRESS)
        (tmp / "redis.conf").write_text(without_tls(run.secret["stringData"]["ratelimit-store-redis.conf"]))
        processes.append(
            subprocess.Popen(
                [REDIS, str(tmp / "redis.conf"), "--port", str(store_port), "--bind", host, "--dir", str(tmp)],
                stdout=subprocess.DEVNULL,
            )
        )
        gateway_env = {e["name"]: e["value"] for e in run.container("gateway")["env"]}
        storage = httpx.URL(gateway_env["PDSERVE_RATE_LIMIT_STORAGE"])
        gateway_ips = play(
            run,
            "gateway",
            {
                "PDSERVE_SCHEDULER_URL": scheduler_url,
                "PDSERVE_RATE_LIMIT_STORAGE": str(storage.copy_with(scheme="redis", host=host, port=store_port)),
            },
        )
        model = make_test_checkpoint("dense", tmp / "model")
        servers = {}
        for role in ("prefill", "decode"):
            process, url = start_server(run, role, scheduler_url, host, model)
            processes.append(process)
            servers[role] = url
        yield {
            "run": run,
            "scheduler": [scheduler_ip],
            "gateway": gateway_ips,
            "servers": servers,
            "scheduler_url": scheduler_url,
        }
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        left = clean_up(run)
        assert not left, f"left behind: {left}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def client_key(graph: Synthesis) -> str:
    """The API key a client holds: the value stored in Secrets Manager (the gateway's Secret holds its digest)."""
    version = next(
        r
        for r in graph.of_type("aws:secretsmanager/secretVersion:SecretVersion")
        if r.name.endswith("gateway-api-keys")
    )
    key: str = version.inputs["secretString"]
    return key


def test_gateway_and_scheduler_become_ready_on_their_probes_and_serve_a_completion(
    control_plane: dict[str, Any], graphs: dict[str, Synthesis]
) -> None:
    run: Run = control_plane["run"]
    for app in PLAYED:  # every replica, as the Service would only send to ready ones
        container = run.container(app)
        assert len(control_plane[app]) == run.deployment(app)["spec"]["replicas"]
        for pod, address in zip(run.pods(app), control_plane[app], strict=True):
            wait_probe(container, "livenessProbe", address, f"{pod}-{app}")
            wait_probe(container, "readinessProbe", address, f"{pod}-{app}")
    gateway = run.container("gateway")
    for address in control_plane["gateway"]:
        ready = probe_url(gateway, "readinessProbe", address)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while httpx.get(ready, timeout=5).json().get("instances", 0) < 2:
            assert time.monotonic() < deadline, "the gateway never routed to the prefill/decode pair"
            time.sleep(0.5)
    base = service_url(run, "gateway", control_plane["gateway"])
    answer = httpx.post(
        f"{base}/v1/completions",
        headers=bearer(client_key(graphs[f"{ENV}-control"])),
        json={"model": "dense", "prompt": "one two three four", "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"]
    # /metrics requires the token the Secret holds for it (Prometheus' scrape credential), and nothing less
    assert httpx.get(f"{base}/metrics", timeout=5).status_code == 401
    metrics = httpx.get(f"{base}/metrics", headers=bearer(run.secret["stringData"][METRICS_TOKEN.key]), timeout=5).text
    assert "pdserve_gateway_rate_limit_shared 1.0" in metrics, "the gateway is not on the shared store"
    assert httpx.post(f"{base}/v1/completions", json={"model": "dense", "prompt": "x"}, timeout=10).status_code == 401


def test_the_schedulers_weights_outlive_its_pod(control_plane: dict[str, Any]) -> None:
    """A rescheduled scheduler pod (kube down, kube play: a new pod, its emptyDirs gone) finds its weights again on
    the claim."""
    run: Run = control_plane["run"]
    strings = run.secret["stringData"]
    admin, reader = bearer(strings["scheduler-admin-token"]), bearer(strings["scheduler-gateway-token"])
    weights = {"r1": 70, "r2": 30}
    url = control_plane["scheduler_url"]
    assert httpx.put(f"{url}/v1/admin/weights", headers=admin, json={"weights": weights}, timeout=10).status_code == 200
    (old,) = run.pods("scheduler")
    podman("pod", "rm", "--force", "--time", "5", old)  # the pod goes, its claim stays (as in Kubernetes)
    (address,) = play(run, "scheduler", {})
    wait_probe(run.container("scheduler"), "livenessProbe", address, f"{old}-scheduler")
    got = httpx.get(f"{service_url(run, 'scheduler', [address])}/v1/admin/weights", headers=reader, timeout=10)
    assert got.status_code == 200, got.text
    assert got.json()["weights"] == weights
