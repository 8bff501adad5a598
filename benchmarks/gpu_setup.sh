#!/usr/bin/env bash
# Prepare an offline GPU host that already has CuPy, torch, numba, msgpack and uvloop: install the
# wheels carried in .whl (pyzmq, mlxtend) and this checkout, without touching the network.
#   source benchmarks/gpu_setup.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
python3 -c "import zmq, kvstore, cupy; print('pskv', kvstore.__version__, 'cupy', cupy.__version__, cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())"
set +e
