"""The rules pdstack's infrastructure must obey (rules.py, network_rules.py, over core.py) and their pulumi-policy
registrations (pack.py).

Standard library and pulumi-policy only: the Pulumi policy pack in `policy/` runs them in a virtualenv that holds
nothing but pulumi and pulumi-policy, and `pdstack synth` and the tests call them on the graph the program builds
under mocks.
"""
