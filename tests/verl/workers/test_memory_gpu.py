"""verl.workers.memory's line fit on a GPU, with probes whose memory is known to the byte."""
from __future__ import annotations

import pytest
import torch

from verl.workers.memory import measure

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KEPT = 256 << 20        # what the first probe leaves allocated, as the update's gradients are
PER_TOKEN = 64 << 10    # what a probe allocates a token, freed when it returns, as activations are


def test_a_second_line_counts_what_the_first_line_left_allocated():
    # The plan measures the line with no layer recomputed, then the one with all of them, while the
    # gradients of the first probes are still held: both lines must count them in their fixed part,
    # or every line in between plans too little.
    torch.cuda.synchronize()
    kept = []

    def probe(tokens: int) -> None:
        if not kept:
            kept.append(torch.zeros(KEPT, dtype=torch.uint8, device="cuda"))
        activations = torch.ones(tokens * PER_TOKEN, dtype=torch.uint8, device="cuda")
        del activations

    held = torch.cuda.memory_allocated()
    first = measure(probe, held=held)
    second = measure(probe, held=held)
    for line in (first, second):
        assert line.per_token == pytest.approx(PER_TOKEN, rel=0.01)
        assert line.fixed == pytest.approx(KEPT, rel=0.01)
    assert measure(probe).fixed < KEPT / 100   # counted from now, what is already held is not the line's
