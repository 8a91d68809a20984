from pdstack.cli import app

app(prog_name="pdstack")
