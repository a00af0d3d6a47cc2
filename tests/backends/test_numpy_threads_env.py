"""``$POLYAMP_NUMPY_THREADS`` takes ASCII digits only: '²' passes str.isdigit() but is no number."""

from __future__ import annotations

import numpy as np
import pytest
from polyamp.backends import _numpy_kernels as K


@pytest.mark.parametrize("text", ["²", "٣", "1²", "⁴"])
def test_digits_that_are_not_ascii_are_a_clear_error(text, monkeypatch):
    K.set_threads(None)
    monkeypatch.setenv(K.THREADS_ENV_VAR, text)
    with pytest.raises(ValueError, match=rf"{K.THREADS_ENV_VAR}=.*Fix: set {K.THREADS_ENV_VAR}=4"):
        K.unscale_and_check_([np.ones(3, np.float32)], np.array(0.5, np.float32), np.zeros(()))
    monkeypatch.setenv(K.THREADS_ENV_VAR, "2")
    assert K.threads() == 2
