"""One module per CLI command; each has `add_arguments(parser)` and `run(args) -> int`."""
