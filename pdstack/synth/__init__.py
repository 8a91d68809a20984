"""`pdstack synth`: the Pulumi program of one stack run offline under mocks.

- synthesis.py: runs infra/ against a mock engine and records every resource, output and policy verdict
- report.py: what `pdstack synth` prints of a synthesis (text or JSON), and the command itself
"""
