"""A GPU node that joins by itself (#35): from a fresh instance with only its instance role and tags (its user data)
to a node of the environment's current release. docs/node-bootstrap.md tells the whole path.

- userdata.py: the pool's `#cloud-config` rendered from the stack files, for its launch template and for the local
  environment's nodes alike (NoCloud); config.py: the node.json it writes (NodeConfig)
- release.py: the release record (images by digest, the model's manifest, the node bundle) in SSM, published and read
- loader.py: stage 0, carried in the user data (standard library and Debian's boto3 only): the bundle, its venv, and
  how a failure is reported (the metric for node_exporter, Unhealthy to Auto Scaling)
- bootstrap.py: the phases in order, timed and idempotent; one module per phase beside it: secrets.py (Secrets
  Manager to files), registry.py (ECR's token to podman's auth file), model_files.py (S3 to disk, parallel,
  resumable, checked), apply.py (the bundle's playbook on the node itself)
- join.py: the node's scheduler token, asked for with its instance role (a signed sts:GetCallerIdentity the
  scheduler replays to STS: pdserve.scheduler.join); the bootstrap does not call it yet
- cli.py: `pdstack node bootstrap` (what the node runs, as `python -m pdstack.node bootstrap`) and `pdstack node
  user-data` (what a pool boots from)
"""
