"""Verifier features read in place: feature shards memory-mapped, indexed like one tensor.

The features of all the training data run to many gigabytes (~3.4 KB a token for three taps of
SmolLM2-135M: 12 GB for 2.7M tokens). Read into memory, one training run took 14 GB of a 24 GiB
machine, two could not run side by side, and the data could not grow past the memory. Mapped,
they live in the page cache: shared by every run that reads them, dropped and read again from
disk under memory pressure, and never copied by a train / held-out split (a subset is views).
"""

from __future__ import annotations

import bisect
import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def map_safetensor(path: Path, name: str) -> torch.Tensor:
    """Tensor `name` of a safetensors file as a copy-on-write memory map (read lazily)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(header_len))[name]
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if info["dtype"] not in _DTYPES:
        raise ValueError(f"{path}: {name} is {info['dtype']}, not one of {', '.join(_DTYPES)}")
    begin, end = info["data_offsets"]
    dtype = _DTYPES[info["dtype"]]
    if begin == end:  # an empty tensor: nothing to map
        return torch.empty(info["shape"], dtype=dtype)
    flat = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize,
                            offset=8 + header_len + begin)
    return flat.view(info["shape"])


class FeatureRows:
    """Rows [T, F] of features held as segments (views, e.g. of mapped shards), sliced like one
    tensor: `rows[lo:hi]` must fall inside one segment (one sequence never spans two)."""

    def __init__(self, segments: list[torch.Tensor], width: int, dtype: torch.dtype) -> None:
        self.segments = segments
        self.starts = [0]
        for seg in segments:
            self.starts.append(self.starts[-1] + seg.shape[0])
        self.shape = (self.starts[-1], width)
        self.dtype = dtype

    def __getitem__(self, key: slice) -> torch.Tensor:
        lo = int(key.start or 0)
        hi = self.shape[0] if key.stop is None else int(key.stop)
        k = bisect.bisect_right(self.starts, lo) - 1
        if not 0 <= k < len(self.segments) or hi > self.starts[k + 1]:
            if lo == hi:
                return torch.empty(0, self.shape[1], dtype=self.dtype)
            raise IndexError(f"rows {lo}:{hi} are not inside one segment")
        return self.segments[k][lo - self.starts[k]:hi - self.starts[k]]

    def subset(self, spans: list[tuple[int, int]]) -> FeatureRows:
        """The rows of the given (lo, hi) spans, in that order, as views."""
        return FeatureRows([self[lo:hi] for lo, hi in spans], self.shape[1], self.dtype)
