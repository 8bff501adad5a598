"""Every registered codec: the numpy reference and the numba kernels give the same payload bytes
and the same encoder state, push after push (the CuPy twin: tests/gpu/test_codec_parity_gpu.py)."""

from __future__ import annotations

import pytest
from codec_parity import EXTRA_SPECS, LENGTHS_AND_BOUNDS, SPECS, gradients, run_pushes

from kvstore.codecs.registry import built_in_codecs


def test_every_built_in_codec_has_a_parity_spec():
    # (other tests register codecs of their own, from their modules)
    assert set(SPECS) == set(built_in_codecs())


@pytest.mark.parametrize("spec", [*SPECS.values(), *EXTRA_SPECS], ids=str)
@pytest.mark.parametrize("numel, bounds", LENGTHS_AND_BOUNDS, ids=lambda x: str(x)[:12])
def test_numpy_and_numba_encode_alike(spec, numel, bounds):
    grads = gradients(numel, 6, seed=numel)
    reference = run_pushes(spec, numel, bounds, grads, kernels="numpy")
    compiled = run_pushes(spec, numel, bounds, grads, kernels="numba")
    for step, (want, got) in enumerate(zip(reference, compiled, strict=True)):
        assert got == want, f"push {step} differs"
