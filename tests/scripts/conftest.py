"""The repro writers draw with matplotlib; without it these tests skip (it is in the dev extra)."""
import pytest

pytest.importorskip("matplotlib")
