"""`pdstack validate`: every stack file on its own, then every environment as a whole."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

from pdstack.model import LOCAL_REGION, DatacenterRole, Environment, LinkKind, PoolRole
from pdstack.plan import link_problems
from pdstack.plan.catalog import Catalog, load_catalog
from pdstack.stacks.component_settings import settings_problems
from pdstack.stacks.files import Problem, StackFile, StackFileError, load_stack_file, stack_name_of
from pdstack.vllm.checks import vllm_problems

POOL_ROLES_BY_DATACENTER = {
    DatacenterRole.PREFILL: {PoolRole.PREFILL},
    DatacenterRole.DECODE: {PoolRole.DECODE},
    DatacenterRole.CONTROL: {PoolRole.CONTROL},
    DatacenterRole.MIXED: set(PoolRole),
}


@dataclass
class Report:
    stacks: list[StackFile] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems

    def environments(self) -> dict[str, list[StackFile]]:
        by_env: dict[str, list[StackFile]] = defaultdict(list)
        for stack in self.stacks:
            by_env[stack.config.environment].append(stack)
        return dict(by_env)

    def as_json(self) -> dict[str, object]:
        return {
            "valid": self.valid,
            "stacks": sorted(s.stack_name for s in self.stacks),
            "problems": [{"file": p.file, "path": p.path, "reason": p.reason} for p in sorted(self.problems)],
        }


def stack_paths(paths: Iterable[Path]) -> list[Path]:
    """Expand folders to the stack files they hold; keep files as given."""
    found: list[Path] = []
    for path in paths:
        found += sorted(path.glob("Pulumi.*.yaml")) if path.is_dir() else [path]
    return found


def validate(paths: Iterable[Path], catalog: Catalog | None = None) -> Report:
    catalog = catalog or load_catalog()
    report = Report()
    unreadable: set[str] = set()  # environments with a file that did not load: their picture is incomplete
    for path in stack_paths(paths):
        try:
            stack = load_stack_file(path)
        except StackFileError as exc:
            report.problems += exc.problems
            unreadable.add((stack_name_of(path) or "").split("-", 1)[0])
            continue
        report.stacks.append(stack)
        report.problems += check_stack(stack, catalog)
    for env, stacks in report.environments().items():
        report.problems += check_environment(stacks, complete=env not in unreadable, catalog=catalog)
    return report


def check_stack(stack: StackFile, catalog: Catalog) -> list[Problem]:
    """Checks of one file against the catalog and its own environment kind."""
    where, cfg = str(stack.path), stack.config
    dc = cfg.datacenter
    problems: list[Problem] = []
    is_local_env = cfg.environment is Environment.LOCAL
    if is_local_env != (dc.region == LOCAL_REGION):
        problems.append(
            Problem(where, "pdstack:datacenter.region", "the local environment uses region `local`, and only it does")
        )
    aws_region = stack.pulumi_config.get("aws:region")
    if dc.region not in (LOCAL_REGION, aws_region):
        problems.append(
            Problem(where, "aws:region", f"must be set to the datacenter's region {dc.region!r}, got {aws_region!r}")
        )
    for i, pool in enumerate(dc.pools):
        at = f"pdstack:datacenter.pools[{i}]"
        if pool.role not in POOL_ROLES_BY_DATACENTER[dc.role]:
            problems.append(
                Problem(where, f"{at}.role", f"a {pool.role} pool does not belong in a {dc.role} datacenter")
            )
        inst = catalog.instance(pool.instance_type)
        if inst is None:
            close = [n for n in catalog.instances if n.split(".")[0] == pool.instance_type.split(".")[0]]
            hint = f" (known {close[0].split('.')[0]} types: {', '.join(close)})" if close else ""
            problems.append(
                Problem(where, f"{at}.instance_type", f"unknown instance type {pool.instance_type!r}{hint}")
            )
            continue
        if (inst.provider == "local") != (dc.region == LOCAL_REGION):
            problems.append(
                Problem(
                    where,
                    f"{at}.instance_type",
                    f"{pool.instance_type} is a {inst.provider} type, not for region {dc.region}",
                )
            )
        if pool.role.needs_gpu and not inst.has_gpu and inst.provider != "local":
            problems.append(
                Problem(
                    where, f"{at}.instance_type", f"a {pool.role} pool needs GPUs, and {pool.instance_type} has none"
                )
            )
        if pool.efa and not inst.efa:
            problems.append(Problem(where, f"{at}.efa", f"{pool.instance_type} does not support EFA"))
    if cfg.environment is Environment.PROD and dc.role is DatacenterRole.CONTROL:
        problems += _alert_receiver_problems(stack)
    for i, link in enumerate(dc.links):
        if (link.kind is LinkKind.EMULATED) != is_local_env:
            problems.append(
                Problem(
                    where,
                    f"pdstack:datacenter.links[{i}].kind",
                    "`emulated` links are for the local environment, and only they are",
                )
            )
    return problems


def _alert_receiver_problems(stack: StackFile) -> list[Problem]:
    """prod's alerts must reach someone: its control stack, which holds the environment-wide settings, names the
    webhook Alertmanager posts to (pdstack/contract/alerting.py); without one every alert is only listed."""
    alerting = stack.config.alerting
    if alerting is not None and alerting.webhook_url is not None:
        return []
    return [
        Problem(
            str(stack.path),
            "pdstack:alerting.webhook_url",
            "a prod environment needs an alert receiver: set the webhook Alertmanager posts to (a secret if it "
            "holds a token: `pulumi config set --secret --path pdstack:alerting.webhook_url URL`; docs/alerts.md)",
        )
    ]


def check_environment(stacks: list[StackFile], complete: bool = True, catalog: Catalog | None = None) -> list[Problem]:
    """Checks across the stacks of one environment: names, address plans, links and roles.

    When some file of the environment did not load (`complete=False`), only the pairwise checks run: a missing peer
    or role would be an echo of that file's own problems.
    """
    env = stacks[0].config.environment
    where = f"environment {env}"
    problems: list[Problem] = []
    by_name: dict[str, StackFile] = {}
    for stack in stacks:
        name = stack.config.datacenter.name
        if name in by_name:
            problems.append(
                Problem(
                    str(stack.path),
                    "pdstack:datacenter.name",
                    f"datacenter {name!r} is also defined in {by_name[name].path}",
                )
            )
        by_name.setdefault(name, stack)
    for a, b in combinations(stacks, 2):
        cidr_a, cidr_b = a.config.datacenter.cidr, b.config.datacenter.cidr
        if cidr_a.overlaps(cidr_b):
            problems.append(Problem(str(b.path), "pdstack:datacenter.cidr", f"{cidr_b} overlaps {cidr_a} of {a.path}"))
    problems += _check_links(stacks, by_name, complete)
    if complete:
        problems += _check_roles(where, stacks)
        problems += link_problems(stacks)
        problems += vllm_problems(stacks, catalog or load_catalog())
        problems += settings_problems(stacks)
    return problems


def _check_links(stacks: list[StackFile], by_name: dict[str, StackFile], complete: bool) -> list[Problem]:
    problems: list[Problem] = []
    for stack in stacks:
        dc = stack.config.datacenter
        for i, link in enumerate(dc.links):
            at = f"pdstack:datacenter.links[{i}]"
            peer = by_name.get(link.peer)
            if peer is None:
                if not complete:
                    continue
                problems.append(
                    Problem(
                        str(stack.path),
                        f"{at}.peer",
                        f"no datacenter {link.peer!r} in environment {stack.config.environment} "
                        f"(known: {', '.join(sorted(by_name))})",
                    )
                )
                continue
            back = next((b for b in peer.config.datacenter.links if b.peer == dc.name), None)
            if back is not None and back.model_dump(exclude={"peer"}) != link.model_dump(exclude={"peer"}):
                problems.append(
                    Problem(str(stack.path), at, f"disagrees with the link {peer.path} declares back to {dc.name!r}")
                )
    return problems


def linked(stacks: list[StackFile]) -> set[frozenset[str]]:
    """Datacenter pairs joined by a link, whichever side declares it."""
    return {frozenset((s.config.datacenter.name, link.peer)) for s in stacks for link in s.config.datacenter.links}


def _check_roles(where: str, stacks: list[StackFile]) -> list[Problem]:
    problems: list[Problem] = []
    pool_roles = {pool.role for s in stacks for pool in s.config.datacenter.pools}
    for role in (PoolRole.PREFILL, PoolRole.DECODE):
        if role not in pool_roles:
            problems.append(Problem(where, "", f"needs at least one {role} pool"))
    controls = [s for s in stacks if s.config.datacenter.role is DatacenterRole.CONTROL]
    if len(controls) != 1:
        names = ", ".join(s.config.datacenter.name for s in controls) or "none"
        problems.append(
            Problem(where, "", f"needs exactly one control-plane datacenter, found {len(controls)} ({names})")
        )
        return problems
    control = controls[0].config.datacenter.name
    pairs = linked(stacks)
    serving = [s.config.datacenter for s in stacks if s.config.datacenter.role is not DatacenterRole.CONTROL]
    for dc in serving:
        if frozenset((dc.name, control)) not in pairs:
            problems.append(Problem(where, "", f"datacenter {dc.name!r} has no link to the control plane {control!r}"))
    prefill = {dc.name for dc in serving if dc.role in (DatacenterRole.PREFILL, DatacenterRole.MIXED)}
    decode = {dc.name for dc in serving if dc.role in (DatacenterRole.DECODE, DatacenterRole.MIXED)}
    for name in sorted(decode - prefill):
        if not any(frozenset((name, p)) in pairs for p in prefill):
            problems.append(Problem(where, "", f"decode datacenter {name!r} has no link to any prefill datacenter"))
    return problems
