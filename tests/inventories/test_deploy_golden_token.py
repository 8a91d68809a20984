"""deploy.yml's golden-output check holds the server token wherever the inventory keeps it: a file in
pdstack_secrets_dir locally, a Secrets Manager value in the cloud (inventories/aws: pdserve_secret_values), which it
hands to `pdstack canary golden` in a private file that is gone afterwards. The check's own tasks, taken from
deploy.yml, run on this machine; `pdstack canary golden` is a stand-in script (no decode servers here) that reports
the key file it was given."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO

BIN = Path(sys.executable).parent


def golden_play(tmp_path: Path, extra: dict[str, Any]) -> dict[str, Any]:
    plays = yaml.safe_load((REPO / "playbooks" / "deploy.yml").read_text())
    play = next(p for p in plays if p["name"] == "Analyse the canary")
    golden = play["tasks"][0]["block"][0]  # the golden outputs' block, before the traffic steps
    report = tmp_path / "golden.json"
    cli = tmp_path / "pdstack"
    cli.write_text(
        f"#!{sys.executable}\n"
        "import json, os, stat, sys\n"
        "path = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--api-key-file='))\n"
        "canary = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--canary='))\n"
        f"json.dump({{'path': path, 'mode': stat.S_IMODE(os.stat(path).st_mode),"
        f" 'key': open(path).read(), 'canary': canary, 'ca': os.environ.get('SSL_CERT_FILE'),"
        f" 'client': [os.environ.get(v) for v in ('PDSTACK_TLS_CLIENT_CERT', 'PDSTACK_TLS_CLIENT_KEY')]}},"
        f" open({str(report)!r}, 'w'))\n"
    )
    cli.chmod(0o700)
    play_vars = {k: v for k, v in play["vars"].items() if k != "pdserve_canary_baseline"}
    # the environment the check runs in, as playbooks/vars/serving.yml defines it (the rest it reads comes from `extra`)
    serving = yaml.safe_load((REPO / "playbooks" / "vars" / "serving.yml").read_text())
    play_vars["pdstack_operator_tls_env"] = serving["pdstack_operator_tls_env"]
    play_vars |= {
        "pdstack_cli": str(cli),
        "canary_decode": "decode-a",
        "baseline_decode": "decode-b",
        "decode_port": 8300,
        "pdstack_scheme": "http",
        "pdstack_operator_ca_file": "",
        "pdstack_operator_cert_file": "",
        "pdstack_operator_key_file": "",
        **extra,
    }
    (tmp_path / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "decode": {
                            "hosts": {
                                "decode-a": {"pdstack_address": "10.31.0.10"},
                                "decode-b": {"pdstack_address": "10.31.0.11"},
                            }
                        }
                    }
                }
            }
        )
    )
    (tmp_path / "golden.yml").write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Golden check",
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "vars": play_vars,
                    "tasks": [golden],
                }
            ]
        )
    )
    run = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "golden.yml"), "-vvv"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    got: dict[str, Any] = json.loads(report.read_text())
    got["log"] = run.stdout + run.stderr
    return got


def test_locally_the_golden_check_reads_the_token_file_in_the_secrets_dir(tmp_path: Path) -> None:
    token = tmp_path / "server-api.token"
    token.write_text("local-token")
    got = golden_play(tmp_path, {"pdserve_server_token_file": str(token)})
    assert got["path"] == str(token) and got["key"] == "local-token"
    assert token.exists()  # the operator's file is left alone
    assert got["canary"] == "http://10.31.0.10:8300" and got["ca"] == os.environ.get("SSL_CERT_FILE")  # unchanged


def test_over_tls_the_golden_check_calls_the_decode_servers_by_https_verifying_the_environments_ca(
    tmp_path: Path,
) -> None:
    token, ca = tmp_path / "server-api.token", tmp_path / "ca.crt"
    token.write_text("local-token")
    got = golden_play(
        tmp_path,
        {"pdserve_server_token_file": str(token), "pdstack_scheme": "https", "pdstack_operator_ca_file": str(ca)},
    )
    assert got["canary"] == "https://10.31.0.10:8300" and got["ca"] == str(ca)
    assert got["client"] == [None, None]  # no client certificate unless the stack's mutual TLS asks for one


def test_under_mutual_tls_the_golden_check_presents_the_operators_certificate(tmp_path: Path) -> None:
    token, ca = tmp_path / "server-api.token", tmp_path / "ca.crt"
    token.write_text("local-token")
    pair = {
        "pdstack_operator_cert_file": str(tmp_path / "op.crt"),
        "pdstack_operator_key_file": str(tmp_path / "op.key"),
    }
    got = golden_play(
        tmp_path,
        {
            "pdserve_server_token_file": str(token),
            "pdstack_scheme": "https",
            "pdstack_operator_ca_file": str(ca),
            **pair,
        },
    )
    assert got["client"] == [pair["pdstack_operator_cert_file"], pair["pdstack_operator_key_file"]]


def test_in_the_cloud_the_golden_check_gets_the_stores_token_in_a_private_file_then_it_is_gone(tmp_path: Path) -> None:
    value = "cloud-token-3f9a1c"
    got = golden_play(
        tmp_path,
        {
            "pdserve_secret_values": {"server-api-token": value},
            "pdserve_server_token_file": str(tmp_path / "absent.token"),
        },
    )
    assert got["key"] == value and got["path"] != str(tmp_path / "absent.token")
    assert got["mode"] == stat.S_IRUSR | stat.S_IWUSR
    assert not Path(got["path"]).exists()
    assert value not in got["log"]  # not logged, even at -vvv
