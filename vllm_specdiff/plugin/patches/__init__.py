"""Guarded fixes of vLLM 0.32's spec-decode path, one module each with its reason and its test.

Each fix checks that vLLM still has the bug and the private layout it patches; otherwise it
logs a warning and leaves vLLM as it is. `plugin.vllm_plugin.install_vllm_fixes` installs them.
"""
