"""Triton kernels. Imported lazily: nothing here loads triton at import."""
