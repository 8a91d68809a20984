"""pdstack.local.groups reads a converged server's release record where its role writes it: the path is the
serving roles' state folder (roles/pdserve and roles/vllm_engine defaults), checked here rather than typed twice
unchecked. Scaling itself runs in tests/local (a node launched under load, drained out)."""

from __future__ import annotations

import yaml

from pdstack.local.groups import SERVER_STATE_DIR
from tests.support import REPO


def test_the_release_record_is_read_where_the_serving_roles_write_it() -> None:
    for role, variable in (("pdserve", "pdserve_state_dir"), ("vllm_engine", "vllm_engine_state_dir")):
        defaults = yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())
        assert defaults[variable] == SERVER_STATE_DIR, role
