"""Values a worker must not store as garbage: non-native byte order is converted on every path
(init, push, borrowed push, pushpull, pull into ``out``), and NaN or infinities in a push are
refused before anything is sent, leaving residuals and rounds as they were, unless
``KVSTORE_ALLOW_NONFINITE=1``."""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import connect, oracle_decode, oracle_encode

import kvstore
from kvstore.errors import NonFiniteError

pytestmark = pytest.mark.integration

VALUES = np.array([1, 2, 3, 4.5], np.float32)


@pytest.fixture
def kv(one_server):
    with connect([one_server]) as store:
        yield store


def test_big_endian_values_are_converted_on_every_path(kv):
    """``np.array([1, 2, 3, 4], ">f4")`` was stored byte-swapped by init and push(borrow=True)."""
    big = VALUES.astype(">f4")
    kv.init("be", big)
    out = np.zeros(4, np.float32)
    kv.pull("be", out=out)
    assert out.tolist() == VALUES.tolist()  # init
    for borrow in (False, True):
        kv.push("be", big, borrow=borrow)
        big_out = np.zeros(4, ">f4")
        kv.pull("be", out=big_out)
        assert big_out.dtype == np.dtype(">f4")  # out keeps its byte order
        assert big_out.tolist() == VALUES.tolist(), borrow
    swapped = np.zeros(4, ">f4")
    kv.pushpull("be", big * 2, out=swapped)
    assert swapped.tolist() == (VALUES * 2).tolist()
    strided = np.zeros((4, 2), ">f8")[:, 0]  # also not contiguous
    kv.init("be64", VALUES.astype(">f8"))
    kv.pull("be64", out=strided)
    assert strided.tolist() == VALUES.tolist()


def test_big_endian_gradients_encode_like_native_ones_in_2bit(one_server):
    with connect([one_server]) as kv:
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init("native", np.zeros(20, np.float32))
        kv.init("swapped", np.zeros(20, np.float32))
        rng = np.random.default_rng(1)
        for _ in range(3):
            grad = rng.standard_normal(20).astype(np.float32)
            kv.push("native", grad)
            kv.push("swapped", grad.astype(">f4"))
            a, b = np.zeros(20, np.float32), np.zeros(20, np.float32)
            kv.pull("native", out=a)
            kv.pull("swapped", out=b)
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_dense_push_with_nonfinite_values_is_refused_and_sends_nothing(kv, bad):
    kv.init("g", np.zeros(4, np.float32))
    grad = VALUES.copy()
    grad[2] = bad
    for call in (
        lambda: kv.push("g", grad),
        lambda: kv.push("g", grad, borrow=True),
        lambda: kv.pushpull("g", grad, out=np.zeros(4, np.float32)),
    ):
        with pytest.raises(NonFiniteError, match="key 'g' .* holds 1 NaN or infinite"):
            call()
    out = np.full(4, -1, np.float32)
    kv.pull("g", out=out)  # no half-sent push to wait for: the value is still the init's
    assert out.tolist() == [0, 0, 0, 0]
    kv.push("g", VALUES)  # the next round is whole
    kv.pull("g", out=out)
    assert out.tolist() == VALUES.tolist()


def test_a_list_push_is_refused_whole(kv):
    kv.init(["a", "b"], [np.zeros(4, np.float32), np.zeros(4, np.float64)])
    with pytest.raises(NonFiniteError, match="key 'b'"):
        kv.push(["a", "b"], [VALUES, np.array([1, 2, np.nan, 4])])
    out = np.full(4, -1, np.float32)
    kv.pull("a", out=out)
    assert out.tolist() == [0, 0, 0, 0]  # "a" came first and was not sent either


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_every_float_dtype_is_checked_and_integers_are_not(kv, dtype):
    kv.init("f", np.zeros(3, dtype))
    with pytest.raises(NonFiniteError):
        kv.push("f", np.array([1, np.inf, 2], dtype))
    kv.init("i", np.zeros(3, np.int32))
    kv.push("i", np.array([-1, 0x7F800000, 0x7FC00000], np.int32))  # NaN bit patterns
    out = np.zeros(3, np.int32)
    kv.pull("i", out=out)
    assert out.tolist() == [-1, 0x7F800000, 0x7FC00000]


def test_a_refused_2bit_push_leaves_the_residual_as_it_was(one_server):
    """A NaN encoded with error feedback would stay in the residual for good (NaN >= t is
    false: that element would never send again); refused, it never reaches it."""
    t = 0.5
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(40).astype(np.float32) for _ in range(3)]
    with connect([one_server]) as kv:
        kv.set_gradient_compression({"type": "2bit", "threshold": t})
        kv.init("q", np.zeros(40, np.float32))
        residual = np.zeros(40, np.float32)
        for step, grad in enumerate(grads):
            kv.push("q", grad)
            if step == 1:
                poisoned = grad.copy()
                poisoned[[0, 17]] = [np.nan, np.inf]
                with pytest.raises(NonFiniteError, match="holds 2 NaN"):
                    kv.push("q", poisoned)
            _, codes = oracle_encode(grad, residual, t)
            out = np.zeros(40, np.float32)
            kv.pull("q", out=out)
            assert out.tobytes() == oracle_decode(codes, t).tobytes(), step


def test_nonfinite_values_pass_with_the_switch(one_server, monkeypatch):
    monkeypatch.setenv("KVSTORE_ALLOW_NONFINITE", "1")
    with connect([one_server]) as kv:
        kv.init("n", np.zeros(3, np.float32))
        kv.push("n", np.array([np.nan, np.inf, 1], np.float32))
        out = np.zeros(3, np.float32)
        kv.pull("n", out=out)
        assert np.isnan(out[0]) and out[1] == np.inf and out[2] == 1


def test_the_local_mode_refuses_them_too():
    with kvstore.create("local") as kv:
        kv.init(0, np.zeros(2, np.float32))
        with pytest.raises(NonFiniteError):
            kv.push(0, np.array([np.nan, 0], np.float32))
        with pytest.raises(ValueError):  # NonFiniteError is a ValueError
            kv.pushpull(0, np.array([0, -np.inf], np.float32))
