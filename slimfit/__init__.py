"""slimfit: fine-tune transformers in far less accelerator memory."""
from . import kernels

__version__ = "0.1.0"

__all__ = ["kernels", "__version__"]
