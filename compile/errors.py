"""Errors that mean "the user asked for something we cannot do" (CLI exit code 2)."""


class CompileError(Exception):
    """A bad input to the compile stage: reported as one line, nothing written."""


class ValidationError(CompileError):
    """A compiled artifact disagrees with PyTorch beyond the tolerance."""
