"""What `pdstack local up` does for encrypted, named transport (#17): the local CA and each node's certificate
(pdstack.local.tls), the names on the host (pdstack.local.names), the release variables that hand both to the
playbooks, and the https endpoints `status` prints.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from openai import DefaultHttpxClient

from pdstack.contract.components import Component, Contract
from pdstack.local.names import LOCAL_ZONE, host_entries, leaves, remove_hosts, service_name, write_hosts
from pdstack.local.tls import Leaf, LocalCA
from pdstack.local.topology import Topology

# The user's own client certificate: under the stack's serving.mutual_tls the scheduler's and the servers' APIs
# admit only callers with a certificate from the local CA (docs/tls.md), like a kubeconfig's client pair.
OPERATOR = Leaf("operator", (f"operator.{LOCAL_ZONE}",), ())


def local_ca(state_dir: Path) -> LocalCA:
    return LocalCA(state_dir / "tls")


def ensure_certificates(topology: Topology, state_dir: Path) -> list[str]:
    """The CA (once) and a current certificate for every node and the operator; those (re)issued."""
    return local_ca(state_dir).ensure([*leaves(topology), OPERATOR])


def client_files(state_dir: Path) -> dict[str, str]:
    """The operator's certificate and key (status: client_cert, client_key): httpx.Client(cert=(cert, key))."""
    tls = local_ca(state_dir)
    return {"client_cert": str(tls.cert(OPERATOR.name)), "client_key": str(tls.key(OPERATOR.name))}


def name_hosts(topology: Topology) -> bool:
    """The environment's names in the host's /etc/hosts; True when it changed."""
    return write_hosts(host_entries(topology))


def unname_hosts() -> bool:
    return remove_hosts()


def release_vars(topology: Topology, state_dir: Path) -> dict[str, Any]:
    """The playbooks' TLS and names (playbooks/vars/serving.yml): the folder of every node's files on this machine,
    the names the nodes resolve, and the scheduler by its name."""
    return {
        "pdstack_tls_dir": str(local_ca(state_dir).folder),
        "pdstack_hosts": host_entries(topology),
        "pdstack_scheduler_name": service_name(topology, "scheduler"),
    }


def endpoints(topology: Topology, served: Contract) -> dict[str, str]:
    """Where a user reaches the environment: the gateway, the scheduler and Prometheus over https by name."""
    return {
        "gateway_url": f"https://{service_name(topology, 'gateway')}:{served[Component.GATEWAY].port}/v1",
        "scheduler_url": f"https://{service_name(topology, 'scheduler')}:{served[Component.SCHEDULER].port}",
        "prometheus_url": f"https://{service_name(topology, 'prometheus')}:{served.prometheus.port}",
    }


def verified_client(ca_file: Path) -> DefaultHttpxClient:
    """The openai client's HTTP client, trusting the local CA only: OpenAI(http_client=verified_client(ca))."""
    return DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(ca_file)))
