"""Hardware inventory and operational policy (dtypes, kernels, governor)."""
