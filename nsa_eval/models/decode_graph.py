"""One decode step of the NSA model, captured as a CUDA graph and replayed for every later token.

A decode step is hundreds of small launches (16 layers of projections, rotary embedding, cache writes,
compression and the four NSA decode kernels: about 22 a layer on the fused path,
`NSAModel._decode_layers`, 80 unfused); launched one by one from Python, the host takes several times the
GPU's time. The cache (`cache_nsa.py`) keeps every buffer at a fixed address and the position on the
device, and the decode kernels read the length from the device, so one capture serves every position
up to the cache's capacity. The cache owns its graph: a new cache (a new `generate()`)
or a larger one captures again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# below this share of the card free, a capture first returns the allocator's unused blocks to the driver
LOW_MEMORY = 1 / 16


class DecodeGraph:
    """`step(x)` captured once over a static copy of `x` `[B, 1, C]`; calling it replays the step.

    The step's outputs (the tensors `step` returned at capture) are rewritten by every replay: copy
    what must outlive the next step. Capture only after the step ran once eagerly (the kernels are
    compiled and loaded, which capture cannot do).
    """

    def __init__(self, step: Callable[[torch.Tensor], tuple], x: torch.Tensor):
        self.x = x.clone()  # [B, 1, C] the captured input
        self.graph = torch.cuda.CUDAGraph()
        # Captured on a side stream as `torch.cuda.graph` does, without its garbage collection, and
        # emptying the allocator's cache only when the card is nearly full: the graph's private pool
        # cannot use blocks the cache holds free, and after a long batch prefill those can be most of it.
        free, total = torch.cuda.mem_get_info(x.device)
        if free < total * LOW_MEMORY:
            torch.cuda.empty_cache()
        stream = torch.cuda.Stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            self.graph.capture_begin()
            try:
                self.outputs = step(self.x)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(x.device).wait_stream(stream)

    def __call__(self, x: torch.Tensor) -> tuple:
        self.x.copy_(x)
        self.graph.replay()
        return self.outputs
