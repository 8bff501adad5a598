"""CUDA source shared by the quantizing codecs' CuPy kernels (the ``cuda_kernels`` modules of
the sign, stochastic and cast families): the counter generator, the warp and block forms of the
blocked lane sum, and code packing, bit for bit as :mod:`kvstore.codecs.quantize` and
:mod:`kvstore.codecs.counter_rng` define them.

The source is ``quant_ops.cu`` (:func:`quant_ops`); a kernel source puts it after the IEEE
helpers it builds on (:func:`kvstore.codecs.cuda_source.ieee_ops`) and before its own code.

The blocked lane sum maps one block of ``SUM_BLOCK`` elements to one warp: thread ``l`` sums its
lane (elements ``l, l + 32, ...`` of the block: the warp's loads are coalesced) in order from
``+0.0``, and ``quant_combine_lanes`` adds the 32 lane sums in lane order. The block sums are
lane-summed again on the device, by one warp (``quant_lane_sum_warp``) or, for a chunk of many
blocks, by one block that stages them in shared memory for its first warp
(``quant_lane_sums_block``), so a kernel that needs a chunk's scale reads it from device memory
instead of waiting for the host. float64 adds go through ``__dadd_rn`` (never contracted);
products of two float32 are exact in float64, so contraction could not change them anyway.

Reading it does not need CuPy.
"""

from kvstore.codecs.cuda_source import read_cu


def quant_ops() -> str:
    """The quantizers' CUDA helpers (module docstring): ``quant_hash32``, ``quant_uniform``, the
    lane sums and ``quant_store_group``; they use the IEEE helpers."""
    return read_cu("kvstore.codecs.quantize", "quant_ops.cu")
