"""`python -m fzero.cli ...`: the `fzero` command."""

from fzero_cli import main

raise SystemExit(main())
