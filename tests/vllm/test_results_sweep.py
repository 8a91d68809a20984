"""Results the prefill worker leaves for request_finished are removed once nobody can read them any more."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pdserve.vllm.connector import PdstackConnector
from pdserve.vllm.settings import ConnectorSettings
from pdserve.vllm.worker import result_path, write_json_atomically


def test_stale_results_are_swept_and_fresh_ones_kept(kv_key_file: Path, tmp_path: Path) -> None:
    connector = PdstackConnector.__new__(PdstackConnector)  # the scheduler-side state only, without a vLLM config
    extra = {"kv_key_file": str(kv_key_file), "kv_port": 14600, "kv_lease_seconds": 10, "run_dir": str(tmp_path)}
    connector.settings = ConnectorSettings.of(extra, producer=True, engine_id="e1")
    connector._next_sweep = 0.0
    run_dir = connector.settings.worker_dir
    run_dir.mkdir(parents=True)
    write_json_atomically(run_dir / "fingerprint.json", {"fields": {}, "digest": "d"})
    stale, fresh = result_path(run_dir, "aborted-in-flight"), result_path(run_dir, "about-to-finish")
    for path in (stale, fresh):
        write_json_atomically(path, {"checksum": "sha256:00", "num_tokens": 3})
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    os.utime(run_dir / "fingerprint.json", (an_hour_ago, an_hour_ago))

    assert connector._take_result("about-to-finish") == [{"checksum": "sha256:00", "num_tokens": 3}]
    assert not stale.exists() and not fresh.exists()
    assert (run_dir / "fingerprint.json").exists()
    assert connector._take_result("about-to-finish") is None


def test_a_tp_prefill_offers_kv_only_when_every_rank_holds_it(kv_key_file: Path, tmp_path: Path) -> None:
    """Each TP rank leaves its own shard's checksum in its own run dir; one rank missing (its store refused the
    request) means no KV is offered, and the other ranks' results are removed all the same."""
    connector = PdstackConnector.__new__(PdstackConnector)
    extra = {"kv_key_file": str(kv_key_file), "kv_port": 14600, "run_dir": str(tmp_path)}
    connector.settings = ConnectorSettings.of(
        extra, producer=True, engine_id="e1_dp1", tp_size=2, dp_index=1, data_parallel=True
    )
    connector._next_sweep = 0.0
    ranks = [connector.settings.for_rank(r).worker_dir for r in range(2)]
    assert ranks == [tmp_path / "e1_dp1-14602", tmp_path / "e1_dp1-14603"]  # 14600 + DP 1 x TP 2 + rank
    for rank, run_dir in enumerate(ranks):
        run_dir.mkdir(parents=True)
        write_json_atomically(result_path(run_dir, "whole"), {"checksum": f"sha256:0{rank}", "num_tokens": 3})
    write_json_atomically(result_path(ranks[0], "half"), {"checksum": "sha256:00", "num_tokens": 3})

    assert [r["checksum"] for r in connector._take_result("whole") or []] == ["sha256:00", "sha256:01"]
    assert connector._take_result("half") is None
    assert not result_path(ranks[0], "half").exists()
