"""mtp-runner: the process, model loading, tokenizer, sampling and decoding.

Importing this package makes the chosen BLAS load before MLX does (see ``runner.blas``).
"""

from runner import blas as _blas

_blas.install_hook()

__version__ = "0.1.0"
