"""Triton kernels, packaged as `rollplex.kernels`. Imported lazily: nothing here loads triton at import."""
