"""mtp-runner: the process, model loading, tokenizer, sampling and decoding.

Importing this package loads the system OpenBLAS before MLX (see ``runner.blas``).
"""

from runner import blas as _blas

_blas.preload()

__version__ = "0.1.0"
