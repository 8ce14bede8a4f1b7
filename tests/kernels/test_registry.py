import sys
import types

import pytest
import torch

import sonic.kernels as kernels
from sonic.registry import Entry

CPU = torch.device("cpu")


@pytest.fixture
def fake_backends(monkeypatch):
    """Two always-available fake backends, one without bias support, first in the auto order."""
    for name, supports_bias in (("fast_nobias", False), ("fast_bias", True)):
        module = types.ModuleType(f"fake_{name}")
        module.unavailable_reason = lambda device: None
        module.experts = lambda *args, _name=name: _name
        module.SUPPORTS_BIAS = supports_bias
        monkeypatch.setitem(sys.modules, f"fake_{name}", module)
        monkeypatch.setitem(kernels.BACKENDS.entries, name, Entry(name, f"fake_{name}"))
    monkeypatch.setattr(kernels, "AUTO_ORDER", ("fast_nobias", "fast_bias", "reference"))
    kernels.resolve_backend.cache_clear()
    yield
    kernels.resolve_backend.cache_clear()


def test_auto_skips_a_backend_without_bias_support(fake_backends):
    assert kernels.resolve_backend("auto", CPU) == "fast_nobias"
    assert kernels.resolve_backend("auto", CPU, bias=True) == "fast_bias"


def test_explicit_backend_without_bias_support_names_the_reason(fake_backends):
    with pytest.raises(ValueError, match="expert_bias"):
        kernels.resolve_backend("fast_nobias", CPU, bias=True)


def test_auto_on_cpu_is_the_reference_and_unknown_names_fail():
    assert kernels.resolve_backend("auto", CPU) == "reference"
    with pytest.raises(ValueError, match="model.moe.kernel_backend='nope' is not one of auto, reference"):
        kernels.resolve_backend("nope", CPU)


def test_a_triton_too_old_for_the_tma_kernels_is_named_with_the_fix(monkeypatch):
    import sonic.kernels.triton as triton_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.2.0"))
    kernels.resolve_backend.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"triton 3\.2\.0 is older than 3\.4.*pip install 'triton>=3\.4'"):
            kernels.resolve_backend("triton", torch.device("cuda"))
    finally:
        kernels.resolve_backend.cache_clear()
    assert triton_backend.version_reason("3.4.0") is None
    assert triton_backend.version_reason("3.6.0+git8f3a1b2") is None
    assert triton_backend.version_reason("3.3.1") is not None
