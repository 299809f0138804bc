import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real WMT sample beside the checkout; skipped when absent, except under CI where it must exist."""
    if not SHARED_DATA.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the real data at {SHARED_DATA} (../shared/data beside the checkout)")
        pytest.skip(f"real WMT sample not found at {SHARED_DATA} (../shared/data beside the checkout)")
    return SHARED_DATA
