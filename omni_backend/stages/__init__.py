"""Stage logic behind the Triton stage models in `model_repository/` (testable without a server).

Each `model_repository/<stage>/1/model.py` only unpacks tensors into numpy arrays, calls the stage's `run`,
and packs the returned arrays; a `ValueError` from `run` becomes an INVALID_ARG error response.
"""
