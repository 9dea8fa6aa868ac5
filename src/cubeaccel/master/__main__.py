"""`python -m cubeaccel.master serve …`: CubeMaster without the top-level CLI (used by `up` and tests)."""

from cubeaccel.cli.master import app

if __name__ == "__main__":
    app()
