"""``python -m piecewise``: the ``piecewise`` command."""

from .cli import main

raise SystemExit(main())
