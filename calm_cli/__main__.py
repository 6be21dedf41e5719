from calm_cli.main import app

app()
