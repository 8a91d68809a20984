"""Entry point `pulumi up` runs (Pulumi.yaml: `main: infra/`)."""

import sys
from pathlib import Path

# Pulumi runs this file with infra/ itself on sys.path; the program's modules import as the `infra` package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra.program import main

main()
