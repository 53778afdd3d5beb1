"""What the ucx tests share: whether HMC's UCP binding loads here, and the mark that skips them, with the reason,
where it does not (UCX not installed, the binding not built)."""

from __future__ import annotations

import pytest

from hmc.errors import UnsupportedError
from hmc.transport import _ucx_engine

try:
    _ucx_engine.load()
    UCX_MISSING = ""
except UnsupportedError as exc:
    UCX_MISSING = str(exc)

requires_ucx = pytest.mark.skipif(bool(UCX_MISSING), reason=f"UCX binding: {UCX_MISSING}")
