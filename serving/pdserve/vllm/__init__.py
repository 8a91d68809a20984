"""pdstack inside vLLM: `pdserve.vllm.connector.PdstackConnector`, a vLLM v1 KV connector over pdstack's KV channel.

Importing this package does not import vLLM; `pdserve.vllm.connector` does (it runs in vLLM's own environment).
"""
