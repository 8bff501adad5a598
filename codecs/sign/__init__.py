"""The sign quantizers: one bit per element and a chunk's two levels, with error feedback.

* ``1bit`` (:mod:`kvstore.codecs.sign.onebit`): 1-bit SGD, the levels are the means of the two
  sides; the module also holds what the two codecs share (encoder, codec base, server decode).
* ``efsign`` (:mod:`kvstore.codecs.sign.efsign`): EF-signSGD, the levels are plus and minus the
  mean magnitude.

Their numpy references are in those modules; the numba kernels of both are
:mod:`kvstore.codecs.sign.numba_kernels`, the CuPy kernels :mod:`kvstore.codecs.sign.cuda_kernels`.
The scales and code layout are the quantizers' (:mod:`kvstore.codecs.quantize`).
"""
