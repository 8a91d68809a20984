"""pdstack: infrastructure as code for prefill/decode-disaggregated LLM inference across datacenters."""
