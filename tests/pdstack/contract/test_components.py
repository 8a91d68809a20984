"""The deployment contract names only what pdserve reads, covers every stack secret, and the copies that cannot
import it (the committed Ansible vars, role defaults used outside the serving plays, the policy pack's default)
equal it."""

from __future__ import annotations

import re

import pytest
import yaml
from pydantic import BaseModel

from pdserve.common.settings import load_settings
from pdserve.gateway.settings import GatewaySettings
from pdserve.scheduler.settings import SchedulerSettings
from pdserve.server.settings import ServerSettings
from pdstack.contract.components import (
    JOBS,
    NODE_EXPORTER_PORT,
    PDSERVE_BIN,
    SECRETS_DIR,
    Component,
    contract,
)
from pdstack.contract.files import (
    environment_alerting,
    environment_serving,
    environments,
    main,
    render_ansible_vars,
)
from pdstack.model import REQUIRED_SECRETS, Model, Ports, Serving
from tests.support import REPO, STACKS

SETTINGS: dict[Component, type[BaseModel]] = {
    Component.GATEWAY: GatewaySettings,
    Component.SCHEDULER: SchedulerSettings,
    Component.PREFILL: ServerSettings,
    Component.DECODE: ServerSettings,
    Component.COLOCATED: ServerSettings,
}
DEFAULT = contract(Serving(model=Model(name="m", path="/m")))


def test_every_environment_has_an_example() -> None:
    assert environments(STACKS) == ["dev", "local", "prod", "staging"]


@pytest.mark.parametrize("env", ["local", "dev", "staging", "prod"])
def test_the_committed_ansible_vars_are_what_the_stacks_render_to(env: str) -> None:
    committed = (REPO / "playbooks" / "vars" / "contract" / f"{env}.yml").read_text()
    assert committed == render_ansible_vars(env, environment_serving(STACKS, env), environment_alerting(STACKS, env)), (
        "run `python -m pdstack.contract.files`"
    )


def test_the_render_command_reports_nothing_stale() -> None:
    assert main(["--project", str(REPO), "--check"]) == 0


@pytest.mark.parametrize("component", list(Component))
def test_every_setting_is_a_field_of_the_components_own_pdserve_settings(component: Component) -> None:
    fields = {"PDSERVE_" + name.upper() for name in SETTINGS[component].model_fields}
    assert set(DEFAULT[component].env()) - fields == set()


def test_the_credentials_are_the_stack_secrets_and_only_the_scheduler_holds_the_identity_key() -> None:
    read = {s.secret for c in Component for s in DEFAULT[c].secrets}
    assert read == set(REQUIRED_SECRETS)
    holders = {
        c for c in Component for s in DEFAULT[c].secrets if s.secret == "scheduler-identity-key" and not s.principal
    }
    assert holders == {Component.SCHEDULER}
    for c in Component:
        files = [s.file for s in DEFAULT[c].secrets]
        assert len(files) == len(set(files)), c  # one file, one credential


@pytest.mark.parametrize("env", ["local", "dev", "staging", "prod"])
def test_prometheus_presents_the_token_the_gateways_metrics_require_and_only_there(env: str) -> None:
    """The rendered gateway job's credentials_file is the file of the stack secret the gateway reads as its
    metrics_token_file, under the folder roles/prometheus mounts its copy in; no other job carries one. The gateway
    started from the rendered settings on every address (0.0.0.0) has the token, so its /metrics is guarded."""
    rendered = yaml.safe_load(render_ansible_vars(env, environment_serving(STACKS, env)).split("\n", 1)[1])
    gateway = rendered["pdserve_components"]["gateway"]
    (token,) = [s for s in gateway["secrets"] if s["setting"] == "PDSERVE_METRICS_TOKEN_FILE"]
    (guarded,) = [g for g in rendered["prometheus_scrape_groups"] if "authorization" in g]
    assert guarded["job"] == Component.GATEWAY.job
    assert guarded["secret"] == token["secret"] == "metrics-scrape-token"
    path = f"{rendered['prometheus_secrets_dir']}/{guarded['secret_file']}"
    assert guarded["authorization"] == {"type": "Bearer", "credentials_file": path}
    assert path == gateway["env"]["PDSERVE_METRICS_TOKEN_FILE"] == f"{SECRETS_DIR}/{token['target']}"
    settings = load_settings(
        GatewaySettings,
        [],
        "pdserve gateway",
        {
            **gateway["env"],
            **gateway["tls_env"],
            "PDSERVE_SCHEDULER_URL": "https://scheduler.control.local.pdstack:8100",
        },
    )
    assert settings.host == "0.0.0.0" and str(settings.metrics_token_file) == path


def test_a_gateway_on_every_address_without_the_metrics_token_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    env = DEFAULT[Component.GATEWAY].env() | DEFAULT[Component.GATEWAY].tls_env()
    env.pop("PDSERVE_METRICS_TOKEN_FILE")
    with pytest.raises(SystemExit):
        load_settings(GatewaySettings, [], "pdserve gateway", env | {"PDSERVE_SCHEDULER_URL": "https://s:1"})
    assert "metrics_token_file: without a metrics token" in capsys.readouterr().err


def test_ports_follow_the_stack_model() -> None:
    ports = Ports(gateway=9000, scheduler=9001, prefill=9002, decode=9003, kv=9004, prometheus=9005)
    moved = contract(Serving(model=Model(name="m", path="/m"), ports=ports))
    assert (moved[Component.GATEWAY].port, moved[Component.SCHEDULER].port) == (9000, 9001)
    assert (moved[Component.PREFILL].port, moved[Component.PREFILL].kv_port) == (9002, 9004)
    assert moved[Component.DECODE].env()["PDSERVE_PORT"] == "9003" and moved[Component.DECODE].kv_port is None
    assert moved.prometheus.port == 9005
    assert [g.port for g in moved.scrape_groups] == [9001, 9000, 9002, 9003]


def test_the_command_is_the_images_entry_point() -> None:
    containerfile = (REPO / "serving" / "Containerfile").read_text()
    venv = PDSERVE_BIN.removesuffix("/bin/pdserve")
    assert f"python3 -m venv {venv}" in containerfile and 'ENTRYPOINT ["pdserve"]' in containerfile
    assert DEFAULT[Component.GATEWAY].command == (PDSERVE_BIN, "gateway")


def test_job_names_are_one_scheme() -> None:
    assert len(set(JOBS)) == len(JOBS)
    assert {g.job for g in DEFAULT.scrape_groups} == {
        f"pdserve-{c}" for c in ("scheduler", "gateway", "prefill", "decode")
    }


def test_role_defaults_outside_the_serving_plays_equal_the_contract() -> None:
    # baseline.yml runs node_exporter without playbooks/vars/serving.yml; the prometheus role may run alone.
    node_exporter = yaml.safe_load((REPO / "roles" / "node_exporter" / "defaults" / "main.yml").read_text())
    assert node_exporter["node_exporter_port"] == NODE_EXPORTER_PORT
    prometheus = yaml.safe_load((REPO / "roles" / "prometheus" / "defaults" / "main.yml").read_text())
    assert prometheus["prometheus_port"] == Ports().prometheus
    assert (prometheus["prometheus_job"], prometheus["prometheus_node_job"]) == (
        DEFAULT.prometheus.job,
        DEFAULT.node_exporter.job,
    )
    assert prometheus["prometheus_secrets_dir"] == SECRETS_DIR
    pdserve = (REPO / "roles" / "pdserve" / "defaults" / "main.yml").read_text()
    assert not re.search(r"\b(8[0-9]{3}|14579)\b", pdserve), "the pdserve role types a port of its own"


@pytest.mark.parametrize("component", list(Component))
def test_mutual_tls_requires_client_certificates_on_every_internal_listener_and_never_at_the_gateway(
    component: Component,
) -> None:
    served = contract(Serving(model=Model(name="m", path="/m"), mutual_tls=True))[component]
    node = {"PDSERVE_SCHEDULER_URL": "https://scheduler.control.local.pdstack:8200", "PDSERVE_MODEL": "/m"}
    fixed = {"role": str(component)} if component.is_server else None
    loaded = load_settings(SETTINGS[component], [], "pdserve", node | served.env() | served.tls_env(), fixed=fixed)
    assert loaded.tls_client_auth == ("none" if component is Component.GATEWAY else "required")  # type: ignore[attr-defined]
    assert DEFAULT[component].tls_client_auth == "none"  # off unless the stack says so


def test_the_policy_packs_default_kv_port_is_the_models() -> None:
    pack = (REPO / "pdstack" / "policy" / "pack.py").read_text()
    rules = (REPO / "pdstack" / "policy" / "core.py").read_text()
    assert f'"default": {Ports().kv}' in pack and f"kv_port: int = {Ports().kv}" in rules


@pytest.mark.parametrize("component", list(Component))
def test_the_tls_settings_parse_as_the_components_own_and_name_the_mounted_files(component: Component) -> None:
    rendered = yaml.safe_load(render_ansible_vars("local", environment_serving(STACKS, "local")).split("\n", 1)[1])
    tls, env = rendered["pdserve_tls"], dict(rendered["pdserve_components"][component]["tls_env"])
    fields = {"PDSERVE_" + name.upper() for name in SETTINGS[component].model_fields}
    assert set(env) <= fields
    # the local stack sets serving.mutual_tls: every listener but the gateway's asks for a client certificate
    assert env.pop("PDSERVE_TLS_CLIENT_AUTH") == ("none" if component is Component.GATEWAY else "required")
    files = {f"{tls['dir']}/{tls[name]}" for name in ("cert", "key", "ca")}
    assert set(env.values()) == files
    assert env["PDSERVE_TLS_CERT"] == env["PDSERVE_TLS_CLIENT_CERT"]  # one pair: server and client
    assert ("PDSERVE_KV_TLS_CERT" in env) is (component in (Component.PREFILL, Component.DECODE))
