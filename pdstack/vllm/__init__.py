"""vLLM as a serving engine: what pdstack checks, renders and pins for a stack with `serving.engine: vllm`.

- command.py: the vLLM engine's and its agent's command lines and environment, from the stack's serving block and
  the contract
- checks.py: `pdstack validate`'s vLLM rules (parallelism fits the pools, the KV connector and ports agree)
- deploy.py: what roles/vllm_engine deploys, committed as playbooks/vars/vllm/<env>.yml
  (`python -m pdstack.vllm.deploy [--check]`)
- lock.py: the vLLM-cpu image's package lock, run by the vLLM environment's own Python (a script: no pdstack imports)
"""
