"""The stack files of stacks/: found, read and checked one way for every caller.

- files.py: one stack file (`stacks/Pulumi.<env>-<dc>.yaml`) read into the typed model, with precise problems
- environment.py: finding the project's stacks and loading one environment's stacks, checked as `validate` checks
- validate.py: `pdstack validate`: every stack file on its own, then every environment as a whole
- options.py: the `--stacks DIR`, `--env NAME` and `--json` options every subcommand that reads stacks shares
"""
