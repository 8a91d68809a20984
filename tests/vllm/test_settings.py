"""kv_connector_extra_config is checked when vLLM builds the connector; each refusal names the key."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from pdserve.kv.settings import KVChannelSettings
from pdserve.vllm import fingerprint
from pdserve.vllm.settings import ConnectorSettings, SettingsError


def test_defaults_and_worker_dir(kv_key_file: Path, tmp_path: Path) -> None:
    extra = {"kv_key_file": str(kv_key_file), "kv_port": 14600, "run_dir": str(tmp_path)}
    settings = ConnectorSettings.of(extra, producer=True, engine_id="e1")
    defaults = KVChannelSettings()  # the KV channel's knobs default as pdserve's servers' do
    assert (settings.kv_streams, settings.kv_lease_seconds) == (defaults.kv_streams, defaults.kv_lease_seconds)
    assert settings.kv_transfer_timeout_seconds == defaults.kv_transfer_timeout_seconds
    assert (settings.advertise_host, settings.bind_host, settings.kv_open_wait_seconds) == ("127.0.0.1",) * 2 + (10.0,)
    assert settings.worker_dir == tmp_path / "e1-14600"
    assert settings.server_tls() is None and settings.client_tls() is None
    assert settings.kv_cpus is None


def test_a_pull_opens_one_stream_per_bytes_per_stream_up_to_streams(kv_key_file: Path) -> None:
    """A small pull stays on one connection (one congestion window); a large one spreads over up to `kv_streams`."""
    default = ConnectorSettings.of({"kv_key_file": str(kv_key_file)}, producer=False, engine_id="e1")
    assert default.kv_bytes_per_stream == 32 << 20
    assert [default.streams_for(n) for n in (1, 2 << 20, 32 << 20, (32 << 20) + 1, 1 << 30)] == [1, 1, 1, 2, 4]
    extra = {"kv_key_file": str(kv_key_file), "kv_streams": 2, "kv_bytes_per_stream": 1 << 20}
    two = ConnectorSettings.of(extra, producer=False, engine_id="e1")
    assert [two.streams_for(n) for n in (1 << 20, 3 << 20)] == [1, 2]


def test_kv_cpus_takes_linux_cpu_lists(kv_key_file: Path) -> None:
    extra = {"kv_key_file": str(kv_key_file), "kv_cpus": "0,2-3"}
    assert ConnectorSettings.of(extra, producer=False, engine_id="e1").kv_cpus == {0, 2, 3}


def test_connector_threads_run_where_kv_cpus_says_else_beside_the_forward() -> None:
    from pdserve.vllm.worker import connector_cpus, run_on  # noqa: PLC0415 (vLLM's import: only where needed)

    allowed = os.sched_getaffinity(0)
    seen: list[set[int]] = []

    def pinned_forward() -> None:
        os.sched_setaffinity(0, {min(allowed)})
        for wanted in (None, frozenset(allowed)):
            worker = threading.Thread(
                target=lambda w=wanted: (run_on(connector_cpus(w))(), seen.append(os.sched_getaffinity(0)))
            )
            worker.start()
            worker.join()

    forward = threading.Thread(target=pinned_forward)
    forward.start()
    forward.join()
    assert seen == [{min(allowed)}, allowed]


@pytest.mark.parametrize(
    ("extra", "producer", "named"),
    [
        ({"kv_port": 14600, "kv_key_flie": "x"}, True, "kv_key_flie"),
        ({"kv_port": 14600}, True, "kv_key_file"),
        ({"kv_port": 0}, True, "kv_port"),
        ({"port": 14600}, True, "port"),  # the names before pdserve's: refused, not ignored
        ({"kv_port": 14600, "kv_streams": 0}, True, "kv_streams"),
        ({"kv_bytes_per_stream": 0}, False, "kv_bytes_per_stream"),
        ({"kv_open_wait_seconds": -1}, False, "kv_open_wait_seconds"),
        ({"kv_lease_seconds": "soon"}, False, "kv_lease_seconds"),
        ({"kv_transfer_timeout_seconds": 0}, False, "kv_transfer_timeout_seconds"),
        ({"kv_tls_cert": "/c.pem"}, False, "kv_tls_cert"),
        ({"kv_cpus": "1,x"}, False, "kv_cpus"),
        ({"kv_cpus": "-1"}, False, "kv_cpus"),
        ({"release_version": "r 1"}, False, "release_version"),
        ({"release_version": 7}, False, "release_version"),
    ],
)
def test_bad_extra_config_is_refused_naming_the_key(
    kv_key_file: Path, extra: dict[str, object], producer: bool, named: str
) -> None:
    config = {"kv_key_file": str(kv_key_file), **extra} if named != "kv_key_file" else extra
    with pytest.raises(SettingsError, match=rf"^kv_connector_extra_config\.{named}:"):
        ConnectorSettings.of(config, producer=producer, engine_id="e1")


def test_short_key_file_is_refused(tmp_path: Path) -> None:
    short = tmp_path / "key"
    short.write_text("short")
    with pytest.raises(SettingsError, match="kv_key_file"):
        ConnectorSettings.of({"kv_key_file": str(short)}, producer=False, engine_id="e1")


def test_fingerprint_compare_names_the_first_differing_field() -> None:
    ours = {name: 1 for name in fingerprint.FIELDS}
    fingerprint.compare(dict(ours), ours)
    with pytest.raises(fingerprint.FingerprintMismatch, match=r"kv_fingerprint_fields\.head_size: .*head_size=2"):
        fingerprint.compare({**ours, "head_size": 2}, ours)
    with pytest.raises(fingerprint.FingerprintMismatch, match=r"kv_fingerprint_fields\.cpu_isa"):
        fingerprint.compare({k: v for k, v in ours.items() if k != "cpu_isa"}, ours)
