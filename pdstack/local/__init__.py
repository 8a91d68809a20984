"""The local environment: two emulated datacenters and a control plane on one machine."""
