"""Stand-ins for vLLM's `current_platform`, to test the worker chosen per platform without one."""

from __future__ import annotations


class FakePlatform:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.device_name = kind

    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def is_cuda(self) -> bool:
        return self.kind == "cuda"


CPU, CUDA, ROCM = FakePlatform("cpu"), FakePlatform("cuda"), FakePlatform("rocm")
