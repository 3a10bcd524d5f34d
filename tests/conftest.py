"""Shared fixtures."""

from __future__ import annotations

import os

import pytest

from runner.default_model import default_model_path, is_installed
from tests.checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (once per distinct arguments) a random Hugging Face checkpoint directory."""
    made: dict[tuple, str] = {}

    def make(model_type: str = "llama", **kwargs) -> str:
        key = (model_type, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])))
        key = repr(key)
        if key not in made:
            path = tmp_path_factory.mktemp(f"ckpt-{model_type}")
            made[key] = write_checkpoint(path, model_type, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def default_model() -> str:
    """Path of the embedded default model; CI sets MTP_RUNNER_REQUIRE_DEFAULT=1 so it must exist."""
    if not is_installed():
        if os.environ.get("MTP_RUNNER_REQUIRE_DEFAULT") == "1":
            pytest.fail("default model missing: run `python scripts/setup_default_model.py`")
        pytest.skip("default model not installed (python scripts/setup_default_model.py)")
    return default_model_path()


@pytest.fixture(params=[True, False], ids=["exact", "int8"])
def product_path(request):
    """Each quantized-panel product path in turn: exact (bit-for-bit the dequantized float32
    product) and the default int8-activation one; restores the default after the test."""
    from runner.models.layers import exact_products, set_exact_products

    before = exact_products()
    set_exact_products(request.param)
    yield request.param
    set_exact_products(before)


@pytest.fixture
def exact_products():
    """Quantized panels multiply exactly for this test (graphs built in it)."""
    from runner.models.layers import exact_products as current
    from runner.models.layers import set_exact_products

    before = current()
    set_exact_products(True)
    yield
    set_exact_products(before)


@pytest.fixture(scope="session")
def default_loaded(default_model):
    """The default model loaded once per test session (float32, packed)."""
    from runner.loader import load_model

    return load_model(default_model)
