from pdstack.node.cli import node_app

node_app(prog_name="python -m pdstack.node")
