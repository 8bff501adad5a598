"""Every registered codec: its CuPy implementation gives the numpy reference's payload bytes
and encoder state, push after push (the CPU pair: tests/unit/test_codec_parity.py)."""

from __future__ import annotations

import pytest
from codec_parity import LENGTHS_AND_BOUNDS, SPECS, gradients, run_pushes
from kvtest import require_cupy

cupy = require_cupy()

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("numel, bounds", LENGTHS_AND_BOUNDS, ids=lambda x: str(x)[:12])
def test_cupy_encodes_like_the_numpy_reference(spec, numel, bounds):
    grads = gradients(numel, 6, seed=numel)
    reference = run_pushes(spec, numel, bounds, grads, kernels="numpy")
    device = run_pushes(
        spec, numel, bounds, grads, device=cupy.cuda.Device(0), to_device=cupy.asarray
    )
    for step, (want, got) in enumerate(zip(reference, device, strict=True)):
        assert got == want, f"push {step} differs"
