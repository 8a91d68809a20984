"""pdstack's dashboards, one module each: fleet, prefill_decode (P/D), kv and node. Every query uses only metric
names the components register.

Label names are those Prometheus stores: its scrape configs (roles/prometheus, infra/prometheus.py) set `role`
(the inventory group or pool role: control, prefill, decode), `datacenter` and `pool` on every pdserve target, so
a label the process itself calls `role` (the KV channel's sender/receiver, the scheduler's and the gateway's
prefill/decode) is stored as `exported_role`. Panels that show one engine's metric beside the other's (pdserve_*
and vllm:*) show whichever engine runs; the other query returns nothing.
"""

from __future__ import annotations

from .fleet import fleet
from .kv import kv
from .node import node
from .prefill_decode import prefill_decode

DASHBOARDS = {"fleet": fleet, "prefill-decode": prefill_decode, "kv": kv, "node": node}
