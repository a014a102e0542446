"""The one error type users see: it names the file, row or key and the problem."""

__all__ = ["TransferError"]


class TransferError(Exception):
    """A problem with the user's input, params or files; printed without a traceback by the CLI."""
