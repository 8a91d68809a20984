"""The pdstack policy pack: `pulumi preview --policy-pack policy/` runs this file."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rules.py and pack.py sit beside this file

from pack import PACK_NAME, policies
from pulumi_policy import EnforcementLevel, PolicyPack

PolicyPack(name=PACK_NAME, policies=policies(), enforcement_level=EnforcementLevel.MANDATORY)
