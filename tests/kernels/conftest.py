"""Kernel tests. TRITON_INTERPRET is set in tests/conftest.py (it must precede any import of
triton, which torch._dynamo and transformers perform at import time)."""
