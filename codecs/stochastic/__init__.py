"""The stochastic quantizers: unbiased random rounding, no residual.

* ``terngrad`` (:mod:`kvstore.codecs.stochastic.terngrad`): each element becomes ``-s``, 0 or
  ``+s`` of the chunk's (clipped) largest magnitude ``s``.
* ``qsgd`` (:mod:`kvstore.codecs.stochastic.qsgd`): each element's magnitude rounded to one of
  ``levels`` levels of its bucket's 2-norm.

Both draw their uniforms from the counter generator (:mod:`kvstore.codecs.counter_rng`), keyed by
seed, worker, key, push and element, and use the quantizers' scales and code layout
(:mod:`kvstore.codecs.quantize`). Their numpy references are in those modules; the numba
kernels of both are :mod:`kvstore.codecs.stochastic.numba_kernels`, the CuPy kernels
:mod:`kvstore.codecs.stochastic.cuda_kernels`.
"""
