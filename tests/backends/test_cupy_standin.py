"""The CuPy stand-in (tests/cupy_standin) keeps CuPy's contract where host code could get it
wrong: no implicit transfers between host and device, device scalars from reductions, fresh
memory not zeroed, host arrays refused as kernel arguments; and selecting it leaves no trace."""

import sys

import cupy_standin as cp
import numpy as np
import pytest
from cuda_emu import compiler
from cupy_standin import swap


def test_no_implicit_device_to_host_copy():
    a = cp.asarray(np.arange(4, dtype=np.float32))
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Unsupported type"):
        a + np.ones(4, np.float32)
    with pytest.raises(TypeError):
        np.ones(4, np.float32) + a
    assert isinstance(a.get(), np.ndarray) and isinstance(cp.asnumpy(a), np.ndarray)


def test_host_arrays_go_to_the_device_only_whole():
    a = cp.zeros(4, np.float32)
    a[:] = np.arange(4, dtype=np.float32)  # CuPy copies a host array into the whole array
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
        a[1:] = np.ones(3, np.float32)
    a[np.array([0, 1])] = 5.0  # host index arrays are fine
    assert a.get().tolist() == [5, 5, 2, 3]
    with pytest.raises(TypeError):
        cp.ascontiguousarray(np.ones(3))


def test_device_results_stay_on_the_device():
    a = cp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert isinstance(a.sum(), cp.ndarray) and a.sum().shape == ()
    assert isinstance(a[1, 2], cp.ndarray) and float(a[1, 2]) == 5.0
    assert isinstance(np.exp(a), cp.ndarray)  # numpy ufuncs dispatch to the device (NEP 13)
    assert isinstance(np.concatenate([a, a]), cp.ndarray)  # and array functions (NEP 18)
    h = cp.asarray(np.ones((2, 3), np.float16))
    assert (h @ h.T).dtype == np.float16 and float((h @ h.T)[0, 0]) == 3.0


def test_fresh_memory_is_not_zeroed():
    assert np.isnan(cp.empty(3, np.float16).get()).all()
    assert (cp.empty(3, np.int32).get().view(np.uint8) == 0xA5).all()
    assert (cp.zeros(3, np.int32).get() == 0).all()


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler")
def test_kernels_take_device_arrays_only():
    m = cp.RawModule(code='extern "C" __global__ void k(float* x, int n) { if (threadIdx.x < n) x[threadIdx.x] = 1; }')
    k = m.get_function("k")
    a = cp.zeros(4, np.float32)
    k((1,), (32,), (a, np.int32(4)))
    assert a.get().tolist() == [1, 1, 1, 1]
    with pytest.raises(TypeError, match="Unsupported type"):
        k((1,), (32,), (np.zeros(4, np.float32), np.int32(4)))


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler")
def test_selecting_it_leaves_no_trace():
    from cuda_emu import host

    import localkv.backends as backends

    before = (sys.modules.get("cupy"), getattr(backends, "cuda", None))
    with swap.standin():
        from localkv.backends import cuda_kernels
        from localkv.backends.cuda import CudaBackend

        assert isinstance(backends.select("cuda"), CudaBackend)
        assert backends.available_devices() == ["cpu", "cuda"]
        assert host.constants().defines == cuda_kernels.DEFINES  # the emulator tests build what the backend builds
    assert (sys.modules.get("cupy"), getattr(backends, "cuda", None)) == before
    assert "localkv.backends.cuda" not in sys.modules or before[1] is not None
