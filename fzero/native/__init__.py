"""Native kernels bound through cffi. Not built yet: every caller uses the torch path."""

__all__ = ["available"]


def available() -> bool:
    """Whether the compiled kernels loaded; always False until they are built."""
    return False
