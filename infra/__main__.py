"""Entry point `pulumi up` runs (Pulumi.yaml: `main: infra/`) in the project's virtualenv, where the pdstack
distribution installs this program as the `infra` package (pyproject.toml)."""

from infra.program import main

main()
