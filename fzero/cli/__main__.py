"""`python -m fzero.cli ...`: the `fzero` command."""

from fzero.cli import main

raise SystemExit(main())
