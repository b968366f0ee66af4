"""Both backends against the Backend protocol (localkv/backends/base.py): every member it declares,
with a signature the model can call as the protocol states it; every optional ability in one
Capabilities value; nothing public on a backend class that the protocol does not declare (the
model would have to probe for it). The CUDA backend is imported through the CuPy stand-in, so
this runs without a GPU and without a compiler (nothing is launched)."""

import dataclasses
import inspect

import numpy as np
import pytest
from cupy_standin import swap

from localkv import kv_format
from localkv.backends.base import Backend, Capabilities
from localkv.backends.cpu import CpuBackend

P = inspect.Parameter
# what the model may pass paged_attention beyond the protocol's
ATTENTION_OPTIONS = {"softcap", "window", "head_tables"}
# the methods of an optional ability, by the Capabilities flag that says whether a backend has them
ABILITIES = {
    "batched_decode": ("decode_batch", "decode"),
    "quant_weights": (),  # prepare_weights takes QTensor/QStack weights as they are
}


def _methods() -> dict[str, inspect.Signature]:
    """The protocol's methods, their signatures without self."""
    out = {}
    for name, f in vars(Backend).items():
        if inspect.isfunction(f) and not name.startswith("_"):
            sig = inspect.signature(f)
            out[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return out


def _attributes() -> dict[str, object]:
    return {k: v for k, v in Backend.__annotations__.items() if not k.startswith("_")}


@pytest.fixture(scope="module", params=["CPU", "CUDA"])
def backend(request):
    if request.param == "CPU":
        yield CpuBackend(1)
        return
    with swap.standin():
        from localkv.backends.cuda import CudaBackend

        yield CudaBackend()


def _mismatch(proto: inspect.Signature, impl: inspect.Signature, keywords) -> str:
    """Why impl cannot be called as proto declares (and with the keywords), or ""."""
    have = list(impl.parameters.values())
    varkw = any(p.kind is P.VAR_KEYWORD for p in have)
    for i, p in enumerate(q for q in proto.parameters.values() if q.kind is not P.VAR_KEYWORD):
        if i >= len(have) or have[i].name != p.name or have[i].kind is not P.POSITIONAL_OR_KEYWORD:
            return f"parameter {i} should be {p.name}"
        if (p.default is P.empty) != (have[i].default is P.empty):
            return f"{p.name}: a default in one and not the other"
    names = [p.name for p in proto.parameters.values()]
    extra = [p.name for p in have if p.name not in names and p.default is P.empty and p.kind is P.POSITIONAL_OR_KEYWORD]
    if extra:
        return f"required parameters the protocol lacks: {extra}"
    missing = [k for k in keywords if k not in impl.parameters and not varkw]
    return f"does not take {missing}" if missing else ""


def test_every_protocol_method_exists_with_a_compatible_signature(backend):
    for name, proto in _methods().items():
        impl = getattr(backend, name, None)
        assert callable(impl), f"{backend.name}: {name} missing"
        keywords = backend.caps.attention_options if name == "paged_attention" else ()
        why = _mismatch(proto, inspect.signature(impl), keywords)
        assert not why, f"{backend.name}.{name}{inspect.signature(impl)} against {name}{proto}: {why}"


def test_every_protocol_attribute_is_set(backend):
    for name, kind in _attributes().items():
        assert hasattr(backend, name), f"{backend.name}: attribute {name} missing"
        if kind in (str, bool, Capabilities):
            assert isinstance(getattr(backend, name), kind), f"{backend.name}.{name} is not a {kind.__name__}"
    assert all(callable(getattr(backend.xp, f)) for f in ("asarray", "empty", "zeros"))  # an array module
    np.dtype(backend.act_dtype)


def test_nothing_public_outside_the_protocol(backend):
    """An ability a backend adds goes into the protocol (and, if optional, into Capabilities)."""
    declared = set(_methods()) | set(_attributes())
    public = {n for n in dir(type(backend)) if not n.startswith("_")}
    assert public - declared == set()


def test_capabilities_are_complete(backend):
    caps = backend.caps
    assert type(caps) is Capabilities and dataclasses.is_dataclass(caps)
    for f in dataclasses.fields(Capabilities):
        assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.batched_decode = not caps.batched_decode
    flags = {f.name for f in dataclasses.fields(Capabilities) if f.type in (bool, "bool")}
    assert flags == set(ABILITIES), "every boolean ability names its methods in ABILITIES"
    assert all(isinstance(getattr(caps, f), bool) for f in flags)
    for head_dim in (16, 64, 80, 96, 128):  # "auto" must be a format it takes, one that splits the heads
        for fmt in kv_format.parse(backend.default_kv(head_dim)):
            assert fmt.name in caps.kv_dtypes and fmt.row_len(head_dim)
    assert all(d in kv_format.FORMATS for d in caps.kv_dtypes)
    assert isinstance(caps.attention_options, frozenset) and caps.attention_options <= ATTENTION_OPTIONS


def test_an_ability_a_backend_lacks_raises_as_a_caller_bug(backend):
    for flag, methods in ABILITIES.items():
        if getattr(backend.caps, flag):
            continue
        for name in methods:
            sig = _methods()[name]
            args = [None] * sum(p.default is P.empty for p in sig.parameters.values())
            with pytest.raises(RuntimeError, match=rf"no {name} \(caps\.{flag} is False\).*caller's logic"):
                getattr(backend, name)(*args)
