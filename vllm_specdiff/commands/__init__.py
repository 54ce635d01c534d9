"""Subcommands of `vllm-specdiff`; each module exposes `register(subparsers)` setting `func`."""
