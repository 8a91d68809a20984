"""The deployment contract: what every component is started with, derived once from the typed stack model, and the
files it is rendered into for the consumers that cannot import the toolkit.

- components.py: the contract itself: each component's ports, probes, command, PDSERVE_* settings, secret files and
  scrape jobs, and the names (DNS, secrets, SSM parameters) shared by Ansible, Pulumi and the policy pack
- serving_env.py: the stack's serving settings (limits, timeouts, routing, the KV channel, tracing) as the PDSERVE_*
  variables of each pdserve component
- alerting.py: the Alertmanager configuration (routes, inhibitions, receivers) of an environment
- files.py: the contract as committed files: playbooks/vars/contract/<env>.yml and policy/config/<env>.json
  (`python -m pdstack.contract.files [--check]`)
- cloud_inventory.py: what inventories/aws/ needs from the stacks (`python -m pdstack.contract.cloud_inventory`)
- yamlfiles.py: YAML written the way ansible-lint's yaml rule accepts it, for every file rendered for Ansible
"""
