"""Everything that touches vLLM: the proposer, its configuration, the tree-verifying workers and
attention, engine helpers, CPU settings; `patches/` holds the guarded fixes of vLLM itself.

Importing this package does not import vLLM; the submodules that need it import it lazily.
"""
