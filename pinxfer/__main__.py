"""``python -m pinxfer``: the bench and doctor commands (see pinxfer/cli/)."""

from pinxfer.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
