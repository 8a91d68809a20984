"""`python -m pdstack.dashboards [--check] [--dir DIR]`, the same as `pdstack dashboards`."""

import typer

from pdstack.dashboards.command import dashboards_command

typer.run(dashboards_command)
