"""``python -m stalwart ...``: the same commands as the ``stalwart`` entry point."""

from stalwart.cli.main import app

if __name__ == "__main__":
    app()
