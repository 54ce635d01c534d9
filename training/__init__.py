"""Streak-distillation: align a diffusion drafter to its verifier (ALGORITHM.md section 4).

`specdiff-distill generate | train | eval` (training.cli). Importable without vLLM: vLLM is only
imported inside the optional fast data-generation backend.
"""
