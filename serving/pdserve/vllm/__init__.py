"""pdstack inside vLLM: `pdserve.vllm.connector.PdstackConnector`, a vLLM v1 KV connector over pdstack's KV channel.

Importing this package does not import vLLM; `pdserve.vllm.connector` does (it runs in vLLM's own environment).

Files:
  connector.py    the class vLLM loads: its scheduler side, and its worker side's calls handed on
  worker.py       what both workers share: step specs, the KV channel's loop thread, CPU binding, instance.json
  producer.py     prefill's worker: streams each prompt's blocks into a lease entry as vLLM computes them
  consumer.py     decode's worker: checks the signed params, pulls, writes the blocks, acknowledges
  settings.py     kv_connector_extra_config, checked key by key
  fingerprint.py  what must match between the two ends' KV layouts
  stats.py        the connector's metrics, through vLLM's KVConnectorStats and Prometheus
"""
