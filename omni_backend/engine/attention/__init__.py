"""Paged attention: one interface (`interface.py`), one backend per file (`torch_backend.py`, `triton_backend.py`,
`cpu_backend.py`), and the selector that picks one at start-up and says why (`selector.py`)."""
