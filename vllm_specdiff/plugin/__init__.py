"""Everything that touches vLLM: the proposer, its configuration, engine helpers, CPU settings.

Importing this package does not import vLLM; the submodules that need it import it lazily.
"""
