"""`python -m service`: the same entry point as the `bert-serve` console script."""

from .cli import main

raise SystemExit(main())
