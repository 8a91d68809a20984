"""pdstack: infrastructure as code for prefill/decode-disaggregated LLM inference across datacenters.

Its subpackages, one concern each (stacks, model, plan, contract, vllm, synth, policy, dashboards, canary, bench,
local), are mapped in docs/layout.md.
"""
