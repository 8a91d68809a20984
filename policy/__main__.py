"""The pdstack policy pack: `pulumi preview --policy-pack policy/` runs this file.

Pulumi runs it in the pack's own virtualenv (PulumiPolicy.yaml: venv/, from requirements.txt: pulumi and
pulumi-policy, no pdstack), so the rules are imported from the source tree this folder sits in: pdstack.policy needs
nothing else.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pulumi_policy import EnforcementLevel, PolicyPack

from pdstack.policy.pack import PACK_NAME, policies

PolicyPack(name=PACK_NAME, policies=policies(), enforcement_level=EnforcementLevel.MANDATORY)
