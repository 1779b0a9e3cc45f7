"""`python -m zerojax.cli` and the `zerojax` command: the command line lives in `zerojax.app.cli`."""
from zerojax.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
