"""Every registered codec: the numpy reference and the numba kernels give the same payload bytes
and the same encoder state, push after push (the CuPy twin: tests/gpu/test_codec_parity_gpu.py)."""

from __future__ import annotations

import pytest
from codec_parity import LENGTHS_AND_BOUNDS, SPECS, gradients, parity_codecs, run_pushes

from kvstore.codecs import codec_from_spec
from kvstore.codecs.registry import built_in_codecs, installed_codecs


def test_every_built_in_codec_has_a_parity_spec():
    # (other tests register codecs of their own, from their modules)
    assert {spec["type"] for spec in SPECS} == set(built_in_codecs()) | set(installed_codecs())
    assert set(parity_codecs()) >= set(built_in_codecs())
    for spec in SPECS:
        assert codec_from_spec(spec).spec()["type"] == spec["type"]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("numel, bounds", LENGTHS_AND_BOUNDS, ids=lambda x: str(x)[:12])
def test_numpy_and_numba_encode_alike(spec, numel, bounds):
    grads = gradients(numel, 6, seed=numel)
    reference = run_pushes(spec, numel, bounds, grads, kernels="numpy")
    compiled = run_pushes(spec, numel, bounds, grads, kernels="numba")
    for step, (want, got) in enumerate(zip(reference, compiled, strict=True)):
        assert got == want, f"push {step} differs"
