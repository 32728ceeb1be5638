"""Unit tests: pure functions and small objects, with no simulator and no Ray (`python -m pytest tests/unit`)."""
