"""The version of gradfuse (also in pyproject.toml; tests/test_layout.py checks they agree)."""
__version__ = "0.1.0"
