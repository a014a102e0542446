"""ULMFiT transfer learning for text classification: the library (torch, sentencepiece, numpy, pandas)."""

from transfer.errors import TransferError

__all__ = ["TransferError"]
__version__ = "0.1.0"
