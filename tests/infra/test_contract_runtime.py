"""Every example environment rendered, and the rendered artifacts checked against pdserve itself: the settings a
container is started with, parsed by pdserve's own loaders, give the ports the security groups open, the role the
contract names and the files that are really mounted; the probes hit routes pdserve's apps serve; every alert's job
selector matches a scrape job of both the local and the cloud Prometheus, and promtool accepts both configs."""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import time
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.testclient import TestClient

from infra.network import plan_subnets
from infra.workloads.common import SECRET_NAME, TLS_VOLUME
from infra.workloads.ratelimit_store import RATELIMIT_STORE, RATELIMIT_STORE_CONFIG
from pdserve.cli import CONTROL_ROLES, SERVER_ROLES
from pdserve.common.settings import load_settings
from pdserve.gateway.app import create_app as gateway_app
from pdserve.gateway.settings import GatewaySettings
from pdserve.scheduler.app import create_app as scheduler_app
from pdserve.scheduler.settings import SchedulerSettings
from pdserve.server.settings import ServerSettings, settings_from_args
from pdserve.vllm.settings import kv_port_of
from pdstack.contract.alerting import alertmanager_config
from pdstack.contract.components import (
    JOBS,
    NODE_EXPORTER_PORT,
    PDSERVE_BIN,
    SECRETS_DIR,
    TLS_DIR,
    Component,
    Contract,
    contract,
    prometheus_url_parameter,
    scheduler_url_parameter,
)
from pdstack.contract.files import environment_alerting, environment_serving
from pdstack.model import PoolRole
from pdstack.synth.synthesis import Synthesis
from pdstack.vllm.command import connector_extra_config
from tests.support import REPO, STACKS
from tests.support.ansible import run_local_playbook
from tests.support.ports import free_port
from tests.support.tlsfiles import relocated, write_tls_dir

from .conftest import stack_config

ENVIRONMENTS = ("local", "dev", "staging", "prod")
CLOUD = ("dev", "staging", "prod")
ALERTS = REPO / "monitoring" / "alerts.yml"
PROMTOOL = shutil.which("promtool")


def contract_of(env: str) -> Contract:
    return contract(environment_serving(STACKS, env))


def ansible_contract(env: str) -> dict[str, Any]:
    """What the playbooks load for the environment (playbooks/vars/contract/<env>.yml)."""
    loaded: dict[str, Any] = yaml.safe_load((REPO / "playbooks" / "vars" / "contract" / f"{env}.yml").read_text())
    return loaded


def server_settings(env: str, component: str) -> ServerSettings:
    """A model server started as the pdserve role starts it: the contract's settings plus what only the node knows."""
    rendered = ansible_contract(env)["pdserve_components"][component]["env"]
    node = {
        "PDSERVE_MODEL": "/model",
        "PDSERVE_SCHEDULER_URL": "http://10.0.0.1:1",
        "PDSERVE_ADVERTISE_HOST": "10.1.0.10",
    }
    return settings_from_args(component, [], environ={**rendered, **node})


def graphs_of(graphs: dict[str, Synthesis], env: str) -> dict[str, Synthesis]:
    return {name: g for name, g in graphs.items() if name.startswith(f"{env}-")}


def ingress_ports(graph: Synthesis) -> dict[str, set[int]]:
    """purpose tag -> ports its security-group rules open."""
    found: dict[str, set[int]] = {}
    for rule in graph.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"):
        purpose = rule.inputs["tags"].get("pdstack:purpose", "")
        if rule.inputs.get("fromPort") is not None:
            ports = range(int(rule.inputs["fromPort"]), int(rule.inputs["toPort"]) + 1)
            found.setdefault(purpose, set()).update(ports)
    return found


def vllm_kv_ports(env: str) -> set[int]:
    """The ports a vLLM prefill's workers listen on, by the connector's own rule (pdserve.vllm.settings.kv_port_of)
    applied to the stack's parallelism and the connector's extra config."""
    serving = environment_serving(STACKS, env)
    assert serving.vllm is not None
    role = serving.vllm.role(PoolRole.PREFILL)
    base = connector_extra_config(serving, PoolRole.PREFILL, "10.1.0.10")["kv_port"]
    return {
        kv_port_of(base, dp_index=d, tp_size=role.tensor_parallel_size, tp_rank=r)
        for d in range(role.data_parallel_size)
        for r in range(role.tensor_parallel_size)
    }


# -- the Ansible side: rendered vars parsed by pdserve ---------------------------------------------------------------


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_servers_started_from_the_rendered_vars_listen_where_the_contract_says(env: str) -> None:
    served = contract_of(env)
    for component in SERVER_ROLES:
        settings = server_settings(env, component)
        assert settings.port == served[component].port, component
        expected_files = {s.variable: s.path for s in served[component].secrets}
        for variable, path in expected_files.items():
            field = variable.removeprefix("PDSERVE_").lower()
            assert str(getattr(settings, field)) == path, (component, variable)
    prefill = server_settings(env, "prefill")
    assert prefill.kv_port == served[Component.PREFILL].kv_port == environment_serving(STACKS, env).ports.kv
    policy = environment_serving(STACKS, env).kv_load_failure_policy
    assert server_settings(env, "decode").kv_load_failure_policy == policy


@pytest.mark.parametrize("env", CLOUD)
def test_each_security_group_port_is_the_port_its_container_listens_on(graphs: dict[str, Synthesis], env: str) -> None:
    prefill, decode = server_settings(env, "prefill"), server_settings(env, "decode")
    seen = set()
    for name, graph in graphs_of(graphs, env).items():
        if name.endswith("-control"):
            continue
        ports = ingress_ports(graph)
        assert ports["metrics"] == {NODE_EXPORTER_PORT}, name
        if "serving-prefill" in ports:
            assert ports["serving-prefill"] == {prefill.port}, name
            # what decode dials is what prefill listens on: every vLLM worker's port where vLLM serves
            listening = vllm_kv_ports(env) if environment_serving(STACKS, env).vllm else {prefill.kv_port}
            assert ports["kv"] == listening, name
            seen.add("prefill")
        if "serving-decode" in ports:
            assert ports["serving-decode"] == {decode.port}, name
            seen.add("decode")
    assert seen == {"prefill", "decode"}


# -- the Kubernetes side: container specs parsed by pdserve ---------------------------------------------------------


def _objects(graph: Synthesis, kind: str) -> dict[str, dict[str, Any]]:
    return {r.inputs["metadata"]["name"]: r.inputs for r in graph.of_type(kind)}


def _started(container: dict[str, Any]) -> tuple[str, list[str], dict[str, str]]:
    """The role pdserve's CLI would run, the rest of its argv, and the environment."""
    argv = [*container["command"], *container["args"]]
    assert argv[0] == PDSERVE_BIN
    env = {e["name"]: e["value"] for e in container["env"]}
    assert not any("valueFrom" in e for e in container["env"])  # secrets arrive as files, never as values
    return argv[1], argv[2:], env


def _mounted_files(pod: dict[str, Any], container: dict[str, Any], secret: dict[str, Any]) -> dict[str, str]:
    """Path in the container -> the Secret key it holds."""
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == SECRETS_DIR)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
    assert volume["secretName"] == secret["metadata"]["name"] and volume["optional"] is False
    assert mount["readOnly"] is True
    files = {f"{SECRETS_DIR}/{item['path']}": item["key"] for item in volume["items"]}
    assert set(files.values()) <= set(secret["stringData"]), "a mounted key the Secret does not hold"
    return files


def _with_tls_files(
    graph: Synthesis, pod: dict[str, Any], container: dict[str, Any], environ: dict[str, str], folder: Path
) -> dict[str, str]:
    """Every PDSERVE_TLS_* file is a key of the component's kubernetes.io/tls Secret mounted read-only at TLS_DIR;
    the settings then point at real PEM files with the same names (the Secret holds the mocks' stand-ins)."""
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == TLS_DIR)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
    secret = _objects(graph, "kubernetes:core/v1:Secret")[volume["secretName"]]
    assert secret["type"] == "kubernetes.io/tls" and volume["optional"] is False and mount["readOnly"] is True
    tls = {k: v for k, v in environ.items() if k.startswith("PDSERVE_TLS_") and v.startswith(f"{TLS_DIR}/")}
    assert {"PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA"} <= set(tls)
    assert {v.removeprefix(f"{TLS_DIR}/") for v in tls.values()} <= set(secret["stringData"])
    write_tls_dir(folder, [f"{container['name']}.test"])
    return {k: relocated(v, folder) if k in tls else v for k, v in environ.items()}


def _routes(app: Any) -> set[str]:
    return {route.path for route in app.routes}


def _materialise(
    settings_env: dict[str, str], files: dict[str, str], secret: dict[str, Any], tmp: Path
) -> dict[str, str]:
    """The same settings with the mounted files made real under `tmp`, holding what the Secret holds (mock values
    under Pulumi mocks, in the formats the program renders), so pdserve's app is built on them."""
    out = dict(settings_env)
    for path, key in files.items():
        local = tmp / Path(path).name
        local.write_text(secret["stringData"][key])
        for name, value in settings_env.items():
            if value == path:
                out[name] = str(local)
    if "PDSERVE_STATE_FILE" in out:
        out["PDSERVE_STATE_FILE"] = str(tmp / "weights.json")
    return out


@pytest.mark.parametrize("env", CLOUD)
@pytest.mark.parametrize(("app", "model"), [("gateway", GatewaySettings), ("scheduler", SchedulerSettings)])
def test_control_plane_containers_parsed_by_pdserve_give_the_contracts_role_ports_and_files(
    graphs: dict[str, Synthesis], env: str, app: str, model: type[GatewaySettings | SchedulerSettings], tmp_path: Path
) -> None:
    served = contract_of(env)[app]
    graph = graphs[f"{env}-control"]
    deployment = _objects(graph, "kubernetes:apps/v1:Deployment")[app]
    secret = _objects(graph, "kubernetes:core/v1:Secret")[SECRET_NAME]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    role, rest, environ = _started(container)
    assert role == app and role in CONTROL_ROLES
    environ = _with_tls_files(graph, pod, container, environ, tmp_path / "tls")
    settings = load_settings(model, rest, prog=f"pdserve {role}", env=environ)

    assert settings.port == served.port == container["ports"][0]["containerPort"]
    service = _objects(graph, "kubernetes:core/v1:Service")[app]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    files = _mounted_files(pod, container, secret)
    file_settings = {
        name: str(getattr(settings, name))
        for name in model.model_fields
        if name.endswith("_file") and name != "state_file" and getattr(settings, name) is not None
    }
    assert set(file_settings.values()) <= set(files), "a setting names a file nothing mounts"
    if isinstance(settings, SchedulerSettings):  # its weights file sits on a writable volume of its own
        assert str(settings.state_file.parent) in {m["mountPath"] for m in container["volumeMounts"]}
    assert {s.path for s in served.secrets} == set(files)
    for s in served.secrets:
        if s.path in files:
            assert files[s.path] == s.key, s

    built = (gateway_app if app == "gateway" else scheduler_app)(
        load_settings(model, rest, prog=f"pdserve {role}", env=_materialise(environ, files, secret, tmp_path))
    )  # type: ignore[arg-type]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "http"
        assert container[probe]["httpGet"]["path"] in _routes(built), probe
    assert (container["livenessProbe"]["httpGet"]["path"], container["readinessProbe"]["httpGet"]["path"]) == (
        served.health_live,
        served.health_ready,
    )


def test_the_gateways_share_their_rate_limits_in_the_in_cluster_store(graphs: dict[str, Synthesis]) -> None:
    """The cloud half of issue 13's shared limits: every gateway replica points at one Redis, on the port that
    Redis listens on, with the password that Redis requires, and only the gateways may reach it; over TLS only
    (#17), by a name the store's certificate carries, the gateway presenting its own client certificate."""
    graph = graphs["prod-control"]
    deployments = _objects(graph, "kubernetes:apps/v1:Deployment")
    secret_object = _objects(graph, "kubernetes:core/v1:Secret")[SECRET_NAME]
    secret = secret_object["stringData"]
    pod = deployments["gateway"]["spec"]["template"]["spec"]
    _, rest, environ = _started(pod["containers"][0])
    gateway = load_settings(GatewaySettings, rest, prog="pdserve gateway", env=environ)
    store = httpx.URL(gateway.rate_limit_storage)
    service = _objects(graph, "kubernetes:core/v1:Service")[RATELIMIT_STORE]
    redis = deployments[RATELIMIT_STORE]["spec"]["template"]["spec"]
    config = dict(line.split(" ", 1) for line in secret[RATELIMIT_STORE_CONFIG].splitlines())

    assert store.scheme == "rediss" and store.host.startswith(f"{RATELIMIT_STORE}.")
    assert store.port == service["spec"]["ports"][0]["port"] == redis["containers"][0]["ports"][0]["containerPort"]
    assert int(config["tls-port"]) == store.port and config["port"] == "0" and config["tls-auth-clients"] == "yes"
    (request,) = [r for r in graph.of_type("tls:index/certRequest:CertRequest") if r.name == f"tls-{RATELIMIT_STORE}"]
    assert store.host in request.inputs["dnsNames"]
    assert gateway.tls_client_cert is not None and gateway.tls_ca is not None
    (mount,) = [m for m in redis["containers"][0]["volumeMounts"] if m["name"] == TLS_VOLUME]
    assert config["tls-cert-file"] == f"{mount['mountPath']}/tls.crt"
    (volume,) = [v for v in redis["volumes"] if v["name"] == TLS_VOLUME]
    assert volume["secret"]["secretName"] == f"{RATELIMIT_STORE}-tls"
    files = _mounted_files(pod, pod["containers"][0], secret_object)
    assert config["requirepass"] == secret[files[str(gateway.rate_limit_password_file)]]
    policy = _objects(graph, "kubernetes:networking.k8s.io/v1:NetworkPolicy")[RATELIMIT_STORE]["spec"]
    assert policy["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"app": "gateway"}}}],
            "ports": [{"port": store.port, "protocol": "TCP"}],
        }
    ]


def test_the_gateway_reaches_the_scheduler_on_the_port_it_listens_on(graphs: dict[str, Synthesis]) -> None:
    graph = graphs["prod-control"]
    deployments = _objects(graph, "kubernetes:apps/v1:Deployment")
    _, rest, environ = _started(deployments["gateway"]["spec"]["template"]["spec"]["containers"][0])
    gateway = load_settings(GatewaySettings, rest, prog="pdserve gateway", env=environ)
    _, rest, environ = _started(deployments["scheduler"]["spec"]["template"]["spec"]["containers"][0])
    scheduler = load_settings(SchedulerSettings, rest, prog="pdserve scheduler", env=environ)
    assert gateway.scheduler_url.endswith(f":{scheduler.port}")


# -- monitoring: one job scheme, local and cloud ----------------------------------------------------------------------


def run_render_play(play_dir: Path, home: Path) -> None:
    """ansible-playbook runs `play_dir`/render.yml on the controller, with the local inventory's variables."""
    result = run_local_playbook(
        play_dir / "render.yml", home, inventory=str(REPO / "inventories" / "local" / "hosts.yml")
    )
    assert result.returncode == 0, result.output


def local_prometheus_config(tmp_path: Path) -> Path:
    """roles/prometheus's template rendered by Ansible for the local inventory with playbooks/vars/serving.yml."""
    play_dir = tmp_path / "play"
    play_dir.mkdir()
    (play_dir / "vars").symlink_to(REPO / "playbooks" / "vars")
    out = tmp_path / "local" / "prometheus.yml"
    out.parent.mkdir()
    (play_dir / "render.yml").write_text(
        yaml.safe_dump(
            [
                {
                    "name": "render",
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "vars_files": [str(REPO / "roles" / "prometheus" / "defaults" / "main.yml"), "vars/serving.yml"],
                    "tasks": [
                        {
                            "name": "render",
                            "ansible.builtin.template": {
                                "src": str(REPO / "roles" / "prometheus" / "templates" / "prometheus.yml.j2"),
                                "dest": str(out),
                                "mode": "0644",
                            },
                        }
                    ],
                }
            ]
        )
    )
    run_render_play(play_dir, tmp_path)
    (out.parent / "rules").mkdir()
    shutil.copy(ALERTS, out.parent / "rules" / "alerts.yml")
    out.write_text(with_scrape_credentials(out.read_text(), out.parent / "secrets"))
    return out


def cloud_prometheus_config(graph: Synthesis, tmp_path: Path) -> Path:
    config_map = _objects(graph, "kubernetes:core/v1:ConfigMap")["prometheus"]
    folder = tmp_path / "cloud"
    folder.mkdir()
    tls = write_tls_dir(folder / "tls", ["prometheus.test"])  # promtool loads the files the config names
    for name, text in config_map["data"].items():
        (folder / name).write_text(with_scrape_credentials(relocated(text, tls), folder / "secrets"))
    return folder / "prometheus.yml"


def with_scrape_credentials(text: str, folder: Path) -> str:
    """`text` with the container's SECRETS_DIR replaced by `folder`, which holds a stand-in for every file a job's
    authorization names (promtool checks that they exist: Prometheus reads them at every scrape)."""
    folder.mkdir(exist_ok=True)
    for path in re.findall(rf"{re.escape(SECRETS_DIR)}/([\w.-]+)", text):
        (folder / path).write_text("stand-in token\n")
    return text.replace(f"{SECRETS_DIR}/", f"{folder}/")


def authorizations(config: dict[str, Any]) -> dict[str, dict[str, str]]:
    """job -> its authorization block, for the jobs that have one."""
    return {j["job_name"]: j["authorization"] for j in config["scrape_configs"] if "authorization" in j}


def local_prometheus_vars(tmp_path: Path) -> dict[str, Any]:
    """What playbooks/vars/serving.yml gives roles/prometheus for its scrape credentials, the volumes the role mounts,
    and the controller file the pdserve role reads each stack secret from, for the local inventory."""
    play_dir = tmp_path / "vars-play"
    play_dir.mkdir()
    (play_dir / "vars").symlink_to(REPO / "playbooks" / "vars")
    out = tmp_path / "prometheus-vars.json"
    (play_dir / "vars.j2").write_text(
        "{% set files = {} %}{% for secret, variable in pdserve__controller_file_variable.items() %}"
        "{% set _ = files.update({secret: lookup('ansible.builtin.vars', variable)}) %}{% endfor %}"
        "{{ {'pdserve_files': files, 'secret_files': prometheus_secret_files, 'secrets_dir': prometheus_secrets_dir,"
        " 'groups': prometheus_scrape_groups, 'volumes': prometheus__volumes, 'config_dir': prometheus_config_dir}"
        " | to_json }}"
    )
    (play_dir / "render.yml").write_text(
        yaml.safe_dump(
            [
                {
                    "name": "render",
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "vars_files": [
                        str(REPO / "roles" / "prometheus" / "defaults" / "main.yml"),
                        str(REPO / "roles" / "prometheus" / "vars" / "main.yml"),
                        str(REPO / "roles" / "pdserve" / "defaults" / "main.yml"),
                        str(REPO / "roles" / "pdserve" / "vars" / "main.yml"),
                        "vars/serving.yml",
                    ],
                    "tasks": [
                        {
                            "name": "render",
                            "ansible.builtin.template": {
                                "src": str(play_dir / "vars.j2"),
                                "dest": str(out),
                                "mode": "0644",
                            },
                        }
                    ],
                }
            ]
        )
    )
    run_render_play(play_dir, tmp_path)
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


def test_the_local_prometheus_presents_the_file_the_gateway_reads_its_metrics_token_from(tmp_path: Path) -> None:
    """Only the gateway's job carries a credential; its credentials_file is where roles/prometheus mounts the copy
    of the stack secret that the pdserve role hands the gateway as PDSERVE_METRICS_TOKEN_FILE (the same controller
    file), so the value Prometheus presents is the one the gateway requires."""
    gateway = contract_of("local")[Component.GATEWAY]
    (token,) = [s for s in gateway.secrets if s.setting == "metrics_token_file"]
    (tmp_path / "config").mkdir()
    config = yaml.safe_load(local_prometheus_config(tmp_path / "config").read_text())
    stand_in = tmp_path / "config" / "local" / "secrets"
    rendered = local_prometheus_vars(tmp_path)
    assert rendered["secrets_dir"] == SECRETS_DIR
    assert authorizations(config) == {
        gateway.job: {"type": "Bearer", "credentials_file": f"{stand_in}/{token.file}"}  # SECRETS_DIR, relocated
    }
    (group,) = [g for g in rendered["groups"] if "secret" in g]
    assert (group["job"], group["secret"]) == (gateway.job, token.secret)
    assert group["authorization"]["credentials_file"] == f"{rendered['secrets_dir']}/{group['secret_file']}"
    assert f"{rendered['config_dir']}/secrets:{SECRETS_DIR}:ro" in rendered["volumes"]
    assert rendered["secret_files"][token.secret] == rendered["pdserve_files"][token.secret] != ""


def job_selectors() -> list[tuple[str, str, str]]:
    """(alert, operator, value) of every `job` matcher in the alert rules."""
    found = []
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            for op, value in re.findall(r'\bjob\s*(=~|!~|!=|=)\s*"([^"]*)"', rule["expr"]):
                found.append((rule.get("alert") or rule.get("record"), op, value))
    return found


def _matches(op: str, value: str, job: str) -> bool:
    return {"=": job == value, "=~": re.fullmatch(value, job) is not None}[op]


def test_every_alert_job_selector_matches_a_scrape_job_of_the_local_and_the_cloud_prometheus(
    graphs: dict[str, Synthesis], tmp_path: Path
) -> None:
    assert PROMTOOL is not None, "promtool is not installed: apt-get install prometheus"
    local = local_prometheus_config(tmp_path)
    cloud = cloud_prometheus_config(graphs["prod-control"], tmp_path)
    selectors = job_selectors()
    assert selectors, "the alert rules select no job at all"
    for path in (local, cloud):
        check = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, f"{path}: {check.stdout}{check.stderr}"
        assert "1 rule files found" in check.stdout + check.stderr, check.stdout + check.stderr
        jobs = {j["job_name"] for j in yaml.safe_load(path.read_text())["scrape_configs"]}
        assert jobs == set(JOBS), path
        for alert, op, value in selectors:
            assert op in ("=", "=~"), f"{alert}: a negative job matcher selects nothing the contract names"
            assert any(_matches(op, value, job) for job in jobs), f"{alert}: job{op}{value!r} matches no job in {path}"


@pytest.mark.parametrize("env", CLOUD)
def test_the_cloud_prometheus_presents_the_token_the_gateways_metrics_require(
    graphs: dict[str, Synthesis], env: str, tmp_path: Path
) -> None:
    """The gateway job's credentials_file is a file the Prometheus pod mounts from the environment's Secret, holding
    the key the gateway pod's metrics_token_file holds; the gateway built on those files answers /metrics to that
    token and 401 without it."""
    graph = graphs[f"{env}-control"]
    secret = _objects(graph, "kubernetes:core/v1:Secret")[SECRET_NAME]
    config = yaml.safe_load(_objects(graph, "kubernetes:core/v1:ConfigMap")["prometheus"]["data"]["prometheus.yml"])
    gateway_job = contract_of(env)[Component.GATEWAY].job
    (credential,) = authorizations(config).values()
    assert authorizations(config) == {
        gateway_job: {"type": "Bearer", "credentials_file": credential["credentials_file"]}
    }
    prometheus = _objects(graph, "kubernetes:apps/v1:StatefulSet")["prometheus"]["spec"]["template"]["spec"]
    presented = _mounted_files(prometheus, prometheus["containers"][0], secret)
    assert set(presented) == {credential["credentials_file"]}

    gateway = _objects(graph, "kubernetes:apps/v1:Deployment")["gateway"]["spec"]["template"]["spec"]
    _, rest, environ = _started(gateway["containers"][0])
    environ = _with_tls_files(graph, gateway, gateway["containers"][0], environ, tmp_path / "tls")
    required = _mounted_files(gateway, gateway["containers"][0], secret)
    settings = load_settings(GatewaySettings, rest, prog="pdserve gateway", env=environ)
    assert settings.metrics_token_file is not None
    assert required[str(settings.metrics_token_file)] == presented[credential["credentials_file"]]

    files = _materialise(environ, required, secret, tmp_path)
    client = TestClient(gateway_app(load_settings(GatewaySettings, rest, prog="pdserve gateway", env=files)))
    token = secret["stringData"][presented[credential["credentials_file"]]]
    assert client.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert client.get("/metrics").status_code == 401


def test_the_cloud_prometheus_sends_alerts_to_the_alertmanager_beside_it(graphs: dict[str, Synthesis]) -> None:
    graph = graphs["prod-control"]
    config = yaml.safe_load(_objects(graph, "kubernetes:core/v1:ConfigMap")["prometheus"]["data"]["prometheus.yml"])
    target = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"][0]
    service = _objects(graph, "kubernetes:core/v1:Service")["alertmanager"]
    host, port = target.rsplit(":", 1)
    assert host == f"alertmanager.{service['metadata']['namespace']}.svc"
    assert int(port) == service["spec"]["ports"][0]["port"]
    deployment = _objects(graph, "kubernetes:apps/v1:Deployment")["alertmanager"]
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    secret = _objects(graph, "kubernetes:core/v1:Secret")["alertmanager"]
    am_config = yaml.safe_load(secret["stringData"]["alertmanager.yml"])
    alerting = environment_alerting(STACKS, "prod")
    assert alerting is not None and isinstance(alerting.webhook_url, str)
    # the same routing as the local Alertmanager's, with the prod stack's receiver webhook
    assert am_config == alertmanager_config("prod", alerting.webhook_url)
    volume = deployment["spec"]["template"]["spec"]["volumes"][0]
    assert volume["secret"] == {"secretName": "alertmanager", "optional": False, "defaultMode": 0o444}


@pytest.mark.parametrize("env", CLOUD)
def test_the_schedulers_weights_file_is_on_a_claim_that_outlives_the_pod(
    graphs: dict[str, Synthesis], env: str
) -> None:
    """Not an emptyDir: a rescheduled scheduler keeps its weights (tests/infra/test_kube_play.py restarts it)."""
    graph = graphs[f"{env}-control"]
    deployment = _objects(graph, "kubernetes:apps/v1:Deployment")["scheduler"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    _, rest, environ = _started(container)
    settings = load_settings(SchedulerSettings, rest, prog="pdserve scheduler", env=environ)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(settings.state_file.parent))
    assert not mount.get("readOnly", False)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = _objects(graph, "kubernetes:core/v1:PersistentVolumeClaim")[volume["persistentVolumeClaim"]["claimName"]]
    assert claim["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    # one writer: one replica, and the old pod lets go of the volume before the new one mounts it
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    storage = _objects(graph, "kubernetes:storage.k8s.io/v1:StorageClass")[claim["spec"]["storageClassName"]]
    assert storage["parameters"]["encrypted"] == "true" and storage["reclaimPolicy"] == "Retain"
    assert pod["securityContext"]["fsGroup"] == settings_uid(container, pod)


def settings_uid(container: dict[str, Any], pod: dict[str, Any]) -> int:
    """The uid the container runs as: the volume's group must let it write."""
    uid: int = container.get("securityContext", {}).get("runAsUser", pod["securityContext"]["runAsUser"])
    return uid


@pytest.mark.parametrize("env", CLOUD)
def test_gpu_nodes_find_the_scheduler_at_its_load_balancer_by_the_name_the_inventory_reads(
    graphs: dict[str, Synthesis], env: str
) -> None:
    """The control-plane stack writes the scheduler's URL where inventories/aws reads it: https, by the private
    zone's name for its load balancer, on the port the scheduler listens on (tests/inventories reads it through the
    inventory from moto)."""
    graph = graphs[f"{env}-control"]
    (parameter,) = [p for p in graph.of_type("aws:ssm/parameter:Parameter") if p.name == "scheduler-url"]
    stacks = yaml.safe_load((REPO / "inventories" / "aws" / "group_vars" / "all" / "stacks.yml").read_text())
    assert (
        parameter.inputs["name"]
        == scheduler_url_parameter(env)
        == stacks["pdstack_cloud"][env]["scheduler_url_parameter"]
    )
    assert parameter.inputs["type"] == "String"  # an address, not a SecureString
    assert "scheduler_url" in graph.outputs
    service = _objects(graph, "kubernetes:core/v1:Service")["scheduler"]
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"
    deployment = _objects(graph, "kubernetes:apps/v1:Deployment")["scheduler"]
    _, rest, environ = _started(deployment["spec"]["template"]["spec"]["containers"][0])
    scheduler = load_settings(SchedulerSettings, rest, prog="pdserve scheduler", env=environ)
    url = parameter.inputs["value"]
    rendered = ansible_contract(env)["pdserve_components"]["prefill"]["env"]
    server = settings_from_args(
        "prefill", [], environ={**rendered, "PDSERVE_MODEL": "/model", "PDSERVE_SCHEDULER_URL": url}
    )
    parsed = httpx.URL(server.scheduler_url)
    assert parsed.scheme == "https" and parsed.host == load_balancer_record(graph, "scheduler")
    assert parsed.port == service["spec"]["ports"][0]["port"] == scheduler.port


def load_balancer_record(graph: Synthesis, app: str) -> str:
    """The private zone's name for `app`'s load balancer (a CNAME to the NLB's own name)."""
    (record,) = [r for r in graph.of_type("aws:route53/record:Record") if r.name == f"{app}-name"]
    assert record.inputs["type"] == "CNAME"
    name: str = record.inputs["name"]
    return name


@pytest.mark.parametrize("env", CLOUD)
def test_the_controller_finds_prometheus_at_its_internal_load_balancer_by_the_name_the_inventory_reads(
    graphs: dict[str, Synthesis], env: str
) -> None:
    """The control-plane stack writes Prometheus' load-balancer URL where inventories/aws reads it (the name in the
    environment's rendered contract vars), the load balancer is internal and admits only the controller's networks
    (the NetworkPolicy the same), and the URL reaches the port Prometheus listens on."""
    graph = graphs[f"{env}-control"]
    (parameter,) = [p for p in graph.of_type("aws:ssm/parameter:Parameter") if p.name == "prometheus-url"]
    assert parameter.inputs["name"] == prometheus_url_parameter(env) == f"/pdstack/{env}/prometheus-url"
    assert parameter.inputs["name"] == ansible_contract(env)["pdstack_prometheus_url_parameter"]
    assert parameter.inputs["type"] == "String"
    assert "prometheus_url" in graph.outputs
    services = _objects(graph, "kubernetes:core/v1:Service")
    service = services["prometheus"]
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"
    # Only the controller's networks: the control VPC's management subnets, from which it also reaches the
    # scheduler's admin API and the decode servers' ports (golden outputs)
    control_vpc = stack_config(f"{env}-control").datacenter.cidr
    sources = set(service["spec"]["loadBalancerSourceRanges"])
    assert sources == {str(c) for c in plan_subnets(control_vpc).management}
    assert sources <= set(services["scheduler"]["spec"]["loadBalancerSourceRanges"])
    decode_rules = [
        r.inputs["cidrIpv4"]
        for g in graphs_of(graphs, env).values()
        for r in g.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
        if r.inputs["tags"].get("pdstack:purpose") == "serving-decode"
    ]
    assert decode_rules
    assert all(any(ip_network(c).subnet_of(ip_network(rule)) for rule in decode_rules) for c in sources)
    policy = _objects(graph, "kubernetes:networking.k8s.io/v1:NetworkPolicy")["prometheus"]
    blocks = {f["ipBlock"]["cidr"] for rule in policy["spec"]["ingress"] for f in rule["from"] if "ipBlock" in f}
    assert sources <= blocks and not any(ip_network(c).prefixlen == 0 for c in blocks)
    statefulset = _objects(graph, "kubernetes:apps/v1:StatefulSet")["prometheus"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    listen = next(a for a in container["args"] if a.startswith("--web.listen-address="))
    parsed = httpx.URL(parameter.inputs["value"])
    assert parsed.scheme == "https" and parsed.host == load_balancer_record(graph, "prometheus")
    assert parsed.port == service["spec"]["ports"][0]["port"] == contract_of(env).prometheus.port
    assert listen == f"--web.listen-address=:{parsed.port}"


def test_under_mutual_tls_the_schedulers_own_probe_passes_where_a_kubelets_would_be_refused(
    mutual_tls_graph: Synthesis, tmp_path: Path
) -> None:
    """The scheduler started as its mutual-TLS pod would be (its container's settings, the Secret's files made real)
    answers the probe its pod runs (the pod's own pair, on loopback) and refuses an HTTPS probe without a
    certificate, the kubelet's."""
    graph = mutual_tls_graph
    pod = _objects(graph, "kubernetes:apps/v1:Deployment")["scheduler"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    _, rest, environ = _started(container)
    tls = tmp_path / "tls"
    environ = _with_tls_files(graph, pod, container, environ, tls)
    secret = _objects(graph, "kubernetes:core/v1:Secret")[SECRET_NAME]
    environ = _materialise(environ, _mounted_files(pod, container, secret), secret, tmp_path)
    port = free_port()
    environ |= {"PDSERVE_HOST": "127.0.0.1", "PDSERVE_PORT": str(port)}
    probe = container["readinessProbe"]["exec"]["command"]
    served = f":{environ_port(container)}/"
    assert served in probe[2]
    probe = [probe[0], probe[1], relocated(probe[2], tls).replace(served, f":{port}/")]
    with (tmp_path / "scheduler.log").open("w") as log:
        scheduler = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "pdserve"), "scheduler", *rest],
            env={"PATH": os.environ["PATH"], **environ},
            stdout=log,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 60
        while (ran := subprocess.run(probe, capture_output=True, check=False, timeout=10)).returncode != 0:
            assert scheduler.poll() is None, (tmp_path / "scheduler.log").read_text()[-2000:]
            assert time.monotonic() < deadline, ran.stderr.decode()[-2000:]
            time.sleep(0.5)
        context = ssl.create_default_context(cafile=tls / "ca.crt")
        context.check_hostname = False
        with pytest.raises(httpx.TransportError):  # no client certificate: the handshake is refused
            httpx.get(f"https://127.0.0.1:{port}/health/ready", verify=context, timeout=5).raise_for_status()
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=10)


def environ_port(container: dict[str, Any]) -> str:
    return next(e["value"] for e in container["env"] if e["name"] == "PDSERVE_PORT")
