"""One module per CLI subcommand. Each defines `register(subparsers)` and imports heavy
libraries only inside its handler, so `nsa-eval --help` stays fast."""
