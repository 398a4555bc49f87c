"""The kernels run here as the executors configure them: with the row-count crossovers of their table."""

from __future__ import annotations

import pytest

from kvflow.executors.thresholds import ROW_THRESHOLDS
from kvflow.kernels import abi


@pytest.fixture(scope="session", autouse=True)
def kernel_tuning() -> None:
    if abi.native() is not None:
        abi.native().kvflow_set_tuning(tuning=ROW_THRESHOLDS.kernel_tuning())
