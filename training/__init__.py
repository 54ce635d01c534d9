"""Streak-distillation: align a diffusion drafter to its verifier (ALGORITHM.md section 4).

`specdiff-distill generate | train | eval` (`vllm_specdiff_training.cli`: the folder `training/`
installs as `vllm_specdiff_training`). Importable without vLLM: vLLM is only imported inside the
optional fast data-generation backend.
"""
