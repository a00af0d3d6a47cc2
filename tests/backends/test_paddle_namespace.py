"""PaddleNamespace forwards paddle's array-API-shaped functions through one ``__getattr__``: it still
lists them and refuses other names as any object does."""

from __future__ import annotations

import pytest

paddle = pytest.importorskip("paddle")

from polyamp.backends.paddle import PaddleNamespace  # noqa: E402


def test_the_forwarded_functions_are_listed_and_used():
    ns = PaddleNamespace(paddle.ones([2]))
    names = dir(ns)
    for name in ("where", "zeros_like", "isfinite", "maximum", "minimum", "full_like", "abs",
                 "count_nonzero", "max", "min", "astype", "stack"):
        assert name in names
        assert callable(getattr(ns, name))
    assert float(ns.max(paddle.to_tensor([1.0, 3.0]))) == 3.0


def test_a_missing_name_raises_the_usual_attribute_error():
    ns = PaddleNamespace(paddle.ones([2]))
    with pytest.raises(AttributeError, match=r"^'PaddleNamespace' object has no attribute 'sum'$") as info:
        ns.sum  # noqa: B018
    assert info.value.name == "sum" and info.value.obj is ns
    assert not hasattr(ns, "sum") and getattr(ns, "sum", None) is None
