"""The runner's MLX C++ primitives for the CPU: few-row float32 products ``x @ W`` over a
column-panel weight layout, routed experts over the same panels, and fused prefill attention.

A product with a few rows (speculative verify rows, batched decode) is memory-bound: the BLAS
libraries still run it as a small GEMM and pay 2-8x a one-row product for 4-8 rows. Here the
weight is re-laid out once, at load, into column panels ``P[ceil(N/16)][K][16]``
(:func:`to_panels`); the primitive ``_smallrow.panel_matmul`` reads each panel once for all the
rows (their accumulators in vector registers, several panels side by side for 1-4 rows),
on MLX's CPU stream thread (one thread for decode-sized M, every core for prefill chunks).
The primitive serves every M, prefill chunks included, at about the speed of oneMKL's GEMM
there, so only the panel layout need be kept in memory.

Row ``i`` of an ``M``-row product is bit-for-bit the one-row product of that row, for every
``M`` and thread count (one FMA chain per output element, in ``k`` order, whatever ``M``):
verify rows match plain decoding.

The routed experts of a mixture-of-experts block use the same panels per expert, stacked
(:func:`expert_panels`): ``gather_panel_matmul`` multiplies each row by the experts its router
picked, grouping the (row, expert) pairs by expert so each selected expert's panels are read
once for all the rows that chose it; each pair is the one-row product above, so it too is the
same whatever rows share the feed.

Prefill chunks' attention runs fused (:func:`flash_attention`): per block of query rows the
scores, their online softmax and the weighted values stay in cache-sized tiles, on every core.

Build the extension with ``python -m runner.native.build``. Importing this module never fails:
without a usable build, :func:`available` is False, :func:`reason` says why, and
:func:`panel_matmul` computes every ``M`` with MLX ops (slowly: it rebuilds [K, N] each call).
"""

from __future__ import annotations

import importlib
import os

import mlx.core as mx

from runner.native import quantized

PANEL = 16  # columns per panel (kernels.h kPanel)
SMALL_ROWS = 16  # M <= SMALL_ROWS (decode, verify rows) runs on one thread by default
# ... except a quantized product over this many weight bytes (a vocabulary projection): its
# read takes long enough that a second core's share of the memory bandwidth outweighs
# starting a thread, and the next step's graph is built by then.
SPLIT_BYTES = 8 << 20

_ext = None
_reason = "not checked"


def _load() -> None:
    global _ext, _reason
    try:
        ext = importlib.import_module("runner.native._smallrow")
    except ModuleNotFoundError:
        _reason = "runner.native._smallrow is not built: run `python -m runner.native.build`"
        return
    except Exception as exc:  # built for another Python or MLX (undefined symbols), ...
        _reason = (
            f"runner.native._smallrow does not import ({type(exc).__name__}: {exc}); "
            "rebuild it with `python -m runner.native.build`"
        )
        return
    if getattr(ext, "PANEL", None) != PANEL:
        _reason = f"runner.native._smallrow uses panels of {getattr(ext, 'PANEL', '?')} columns"
        _reason += f", this wrapper {PANEL}; rebuild with `python -m runner.native.build`"
        return
    built_for = getattr(ext, "MLX_VERSION", "?")
    running = mx.__version__.split("+")[0].split(".dev")[0]
    if built_for != running:
        _reason = (
            f"runner.native._smallrow was built for mlx {built_for}, this is mlx {running}; "
            "rebuild with `python -m runner.native.build`"
        )
        return
    try:
        # Builds (does not evaluate) one node: a nanobind ABI other than mlx.core's shows up
        # here as a TypeError, before any real use.
        ext.panel_matmul(mx.zeros((1, 1)), mx.zeros((1, 1, PANEL)), 1)
    except Exception as exc:
        _reason = (
            f"runner.native._smallrow does not accept mlx arrays ({type(exc).__name__}: "
            f"{exc}); rebuild with `python -m runner.native.build`"
        )
        return
    _ext, _reason = ext, ""


_load()


def available() -> bool:
    """Whether the compiled primitive is importable and matches this MLX."""
    return _ext is not None


def reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    return _reason


def isa() -> str | None:
    """The kernel path compiled in (``avx512``, ``avx2`` or ``portable``), None if unavailable."""
    return _ext.isa() if _ext is not None else None


def to_panels(w_t: mx.array) -> mx.array:
    """The panel layout ``[ceil(N / PANEL), K, PANEL]`` (float32, row-contiguous, N padded with
    zero columns) of a ``[K, N]`` (in, out) weight. Lazy: evaluate it once at load, drop w_t."""
    if w_t.ndim != 2:
        raise ValueError(f"to_panels takes a [K, N] weight, got shape {tuple(w_t.shape)}")
    k, n = w_t.shape
    nb = -(-n // PANEL)
    w = w_t.astype(mx.float32) if w_t.dtype != mx.float32 else w_t
    if nb * PANEL != n:
        w = mx.pad(w, [(0, 0), (0, nb * PANEL - n)])
    return mx.contiguous(w.reshape(k, nb, PANEL).transpose(1, 0, 2))


def _rows(x: mx.array) -> int:
    m = 1
    for d in x.shape[:-1]:
        m *= d
    return m


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


LARGE_M_THREADS = _cores()  # threads for M > SMALL_ROWS (prefill chunks use every core)


def panel_matmul(x: mx.array, panels: mx.array, n: int, *, threads: int | None = None) -> mx.array:
    """``x @ W`` ([..., K] -> [..., n]) for W given as ``panels = to_panels(W)``.

    Runs the primitive for every M (the product of x's leading dims). ``threads`` (how many
    threads split the panels; the CPU stream's own thread is one of them) defaults to 1 for
    ``M <= SMALL_ROWS`` (decode and verify rows: the other core builds the next graph) and to
    :data:`LARGE_M_THREADS` above (prefill chunks). The primitive's FMA order does not depend
    on M or threads, so every row's result is the same whatever batch it is computed in.
    The thread count is fixed when the graph is built (under ``mx.compile``: at trace time,
    from the traced shape). Without the compiled primitive it falls back to
    :func:`mlx_panel_matmul` (correct, but it copies the weight back to [K, N] on every call:
    keep w_t instead when the primitive is unavailable)."""
    if x.ndim < 1 or panels.ndim != 3 or x.shape[-1] != panels.shape[1]:
        raise ValueError(
            f"panel_matmul: x {tuple(x.shape)} does not match panels {tuple(panels.shape)}"
        )
    if _ext is None or x.dtype != mx.float32:
        return mlx_panel_matmul(x, panels, n)
    if threads is None:
        threads = 1 if _rows(x) <= SMALL_ROWS else LARGE_M_THREADS
    return _ext.panel_matmul(x, panels, n, threads)


def mlx_panel_matmul(x: mx.array, panels: mx.array, n: int, *, method: str = "rebuild") -> mx.array:
    """``x @ W`` over the panel layout with MLX ops only (no primitive), under the runner's BLAS.

    ``rebuild``: copy the panels back to W [K, N] (one transpose copy of the weight) and run
    one GEMM. ``batched``: one [M, K] @ [K, PANEL] GEMM per panel, then one transpose copy of
    the output from [NB, M, PANEL] to [M, N] (many narrow GEMMs: slow at this panel width)."""
    nb, k, width = panels.shape
    lead = x.shape[:-1]
    m = _rows(x)
    x2 = x.reshape(m, k)
    if x2.dtype != panels.dtype:
        x2 = x2.astype(panels.dtype)
    if method == "rebuild":
        w = mx.contiguous(panels.transpose(1, 0, 2)).reshape(k, nb * width)
        y = x2 @ (w[:, :n] if nb * width != n else w)
    elif method == "batched":
        y = mx.matmul(x2, panels).transpose(1, 0, 2).reshape(m, nb * width)
        if nb * width != n:
            y = y[:, :n]
    else:
        raise ValueError(f"mlx_panel_matmul: unknown method {method!r}")
    return y.reshape(*lead, n) if len(lead) != 1 else y


def gathered_available() -> bool:
    """Whether the compiled module has the routed-experts product (a build from before it was
    added has only :func:`panel_matmul`)."""
    return _ext is not None and hasattr(_ext, "gather_panel_matmul")


def expert_panels(w: mx.array) -> mx.array:
    """The stacked panel layout ``[E, ceil(N / PANEL), K, PANEL]`` (float32, contiguous, N
    padded with zero columns) of experts stacked as ``[E, N, K]`` (out, in: the Hugging Face
    and mlx-lm orientation); expert e's block is ``to_panels(w[e].T)``. Lazy: evaluate it
    once at load, drop w."""
    if w.ndim != 3:
        raise ValueError(f"expert_panels takes [E, N, K] experts, got shape {tuple(w.shape)}")
    e, n, k = w.shape
    nb = -(-n // PANEL)
    w = w.astype(mx.float32) if w.dtype != mx.float32 else w
    if nb * PANEL != n:
        w = mx.pad(w, [(0, 0), (0, nb * PANEL - n), (0, 0)])
    return mx.contiguous(w.reshape(e, nb, PANEL, k).transpose(0, 1, 3, 2))


def gather_panel_matmul(
    x: mx.array, panels: mx.array, indices: mx.array, n: int, *, threads: int | None = None
) -> mx.array:
    """``y[t, j] = x[t, j or 0] @ W[indices[t, j]]`` (``[T, k, n]``) for experts given as
    ``panels = expert_panels(W)``: ``x`` ``[T, 1, K]`` (every expert of row t reads row t: gate
    and up) or ``[T, k, K]`` (pair (t, j) reads its own row: down), ``indices`` ``[T, k]``
    int32 or uint32 (an index outside the experts gives a zero row).

    The primitive groups the pairs by expert and reads each selected expert's panels once for
    all its rows; ``threads`` (experts split over threads) defaults as for
    :func:`panel_matmul`, by the rows T. Without the compiled primitive, or for another dtype,
    it falls back to :func:`mlx_gather_panel_matmul`."""
    if (
        x.ndim != 3
        or panels.ndim != 4
        or indices.ndim != 2
        or x.shape[0] != indices.shape[0]
        or x.shape[1] not in (1, indices.shape[1])
        or x.shape[2] != panels.shape[2]
    ):
        raise ValueError(
            f"gather_panel_matmul: x {tuple(x.shape)}, panels {tuple(panels.shape)} and "
            f"indices {tuple(indices.shape)} do not match"
        )
    if not gathered_available() or x.dtype != mx.float32:
        return mlx_gather_panel_matmul(x, panels, indices, n)
    if threads is None:
        threads = 1 if x.shape[0] <= SMALL_ROWS else LARGE_M_THREADS
    return _ext.gather_panel_matmul(x, panels, indices, n, threads)


def gathered_quantized_available() -> bool:
    """Whether the compiled module multiplies quantized experts (``gather_qpanel_matmul``)."""
    return _ext is not None and hasattr(_ext, "gather_qpanel_matmul")


def expert_qpanels(w: mx.array, bits: int, group: int = 64) -> mx.array:
    """Experts stacked ``[E, N, K]`` quantized (affine, ``bits`` 4 or 8, float16 scales and
    biases per ``group`` inputs: MLX's ``mx.quantize`` where it takes the group, else
    ``runner.quantized.affine_quantize``), each in quantized panels
    (:func:`runner.native.quantized.to_qpanels`), stacked ``[E, NB, K / group, rows, 2 bits]``;
    one expert unpacked at a time."""
    import numpy as np

    from runner.quantized import affine_quantize

    out = []
    for e in range(w.shape[0]):
        if group in (32, 64, 128):
            out.append(quantized.tensor_panels(quantized.mlx_affine_half(w[e], group, bits)))
        else:
            parts = affine_quantize(np.array(w[e].astype(mx.float32)), group, bits)
            out.append(quantized.to_qpanels(*parts, quantized.kernel_bits(bits)))
        mx.eval(out[-1])
    return mx.stack(out)


def gather_qpanel_matmul(
    x: mx.array,
    panels: mx.array,
    indices: mx.array,
    n: int,
    *,
    exact: bool,
    threads: int | None = None,
) -> mx.array:
    """:func:`gather_panel_matmul` over quantized experts (:func:`expert_qpanels`); ``exact``
    as :func:`qpanel_matmul`. Without the compiled product: each expert dequantized through MLX
    (the exact values, slowly)."""
    if not gathered_quantized_available() or x.dtype != mx.float32:
        dense = mx.stack([quantized.dense(panels[e], n) for e in range(panels.shape[0])])
        return mlx_gather_panel_matmul(x, expert_panels(dense.swapaxes(1, 2)), indices, n)
    if threads is None:
        threads = 1 if x.shape[0] <= SMALL_ROWS else LARGE_M_THREADS
    return _ext.gather_qpanel_matmul(x, panels, indices, n, exact, threads)


def mlx_gather_panel_matmul(x: mx.array, panels: mx.array, indices: mx.array, n: int) -> mx.array:
    """:func:`gather_panel_matmul` with MLX ops only: rebuild the experts' ``[E, K, N]`` from
    the panels (one transpose copy of every expert) and run ``mx.gather_mm``. Correct, slow:
    for builds without the primitive and the tests."""
    e, nb, k, width = panels.shape
    w = mx.contiguous(panels.transpose(0, 2, 1, 3)).reshape(e, k, nb * width)[..., :n]
    index = indices.astype(mx.uint32)
    valid = index < e
    rows = x.astype(panels.dtype)[:, :, None, :]  # [T, 1 or k, 1, K]: broadcasts over k
    y = mx.gather_mm(rows, w, rhs_indices=mx.where(valid, index, 0)).squeeze(-2)
    return mx.where(valid[..., None], y, 0.0)


def attention_available() -> bool:
    """Whether the compiled module has the fused attention (a build from before it was added
    has only the products)."""
    return _ext is not None and hasattr(_ext, "flash_attention")


def flash_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool,
    threads: int | None = None,
) -> mx.array:
    """softmax(scale q k^T + mask) v for float32 ``q`` ``[B, H, L, D]`` and ``k``, ``v``
    ``[B, G, T, D]`` (G divides H: grouped-query heads), fused per block of 64 query rows
    (``flash.h``). ``causal``: row i sits at position ``T - L + i`` and sees the keys up to it;
    otherwise every key. ``threads`` (blocks split over threads) defaults to every core.
    Raises RuntimeError when the build has no attention (:func:`attention_available`)."""
    if not attention_available():
        raise RuntimeError(
            "runner.native has no fused attention: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext.flash_attention(q, k, v, scale, causal, threads or LARGE_M_THREADS)


def delta_available() -> bool:
    """Whether the compiled module has the gated delta rule's one-row step and mixer."""
    return _ext is not None and hasattr(_ext, "delta_row")


def delta_step(q, k, v, g, beta, state, *, threads: int | None = None) -> list[mx.array]:
    """One row of the gated delta rule (``delta.h``; ``runner.models.gated_delta``'s
    ``recurrent_step``): float32 ``q``, ``k`` ``[B, H, Dk]``, ``v`` ``[B, H, Dv]``, ``g``,
    ``beta`` ``[B, H]``, ``state`` ``[B, H, Dk, Dv]``; returns ``[y, new state]``. ``threads``
    (heads split over threads) defaults to every core."""
    if not delta_available():
        raise RuntimeError("runner.native has no delta step: " + (_reason or "rebuild it"))
    return _ext.delta_step(q, k, v, g, beta, state, threads or LARGE_M_THREADS)


def delta_row(qkv, conv, weight, b, a, a_log, dt_bias, state, key_heads: int) -> list[mx.array]:
    """A Gated DeltaNet layer's whole one-row mixer (``delta.h``; ``GatedDeltaNet.mix`` for
    one row): returns ``[y, the conv rows after, the new state]``, heads over every core."""
    if not delta_available():
        raise RuntimeError("runner.native has no delta step: " + (_reason or "rebuild it"))
    args = (qkv, conv, weight, b, a, a_log, dt_bias, state, key_heads, LARGE_M_THREADS)
    return _ext.delta_row(*args)


def qpanels_available() -> bool:
    """Whether the compiled module has the quantized panel product."""
    return _ext is not None and hasattr(_ext, "qpanel_matmul")


def qpanels_fast() -> bool:
    """Whether the quantized product runs on vector kernels (AVX-512 or AVX2); the portable
    build computes the same bits one column at a time, slower than float32 panels, so
    quantized checkpoints are dequantized by default there."""
    return qpanels_available() and (qpanel_isa() or "portable") != "portable"


def quantized_decode_threads(default: int) -> int:
    """Threads for a decode step's quantized products: every core wherever the fast product
    runs on vector kernels, else ``default`` (the caller's choice for float32 products, which
    leaves a core to build the next graph). A quantized step reads several times fewer bytes
    than a float32 step, so its products are short and bound by their arithmetic (AVX2 has
    no 4-byte integer dot product; two int8 levels double AVX-512's): a second core's share
    of them outweighs the graph building it delays, and it also splits a verify feed's extra
    rows. Where the user sets ``MTP_RUNNER_DECODE_THREADS``, ``default``."""
    if qpanels_fast() and not _decode_threads_set():
        return LARGE_M_THREADS
    return default


def _decode_threads_set() -> bool:
    """Whether ``MTP_RUNNER_DECODE_THREADS`` holds a count the runner uses (a positive int;
    ``runner.blas`` ignores anything else)."""
    try:
        return int(os.environ.get("MTP_RUNNER_DECODE_THREADS", "")) >= 1
    except ValueError:
        return False


def qpanel_isa() -> str | None:
    """The fast quantized product's integer path (``avx512-vnni``, ``avx512bw``, ``avx2`` or
    ``portable``), None without the product."""
    return _ext.qpanel_isa() if qpanels_available() else None


def qpanel_matmul(
    x: mx.array, panels: mx.array, n: int, *, exact: bool = False, threads: int | None = None
) -> mx.array:
    """``x @ W`` ([..., K] -> [..., n]) for W given as quantized panels
    (:func:`runner.native.quantized.to_qpanels`). ``exact``: bit-for-bit the float32 panel
    product of the dequantized weight; otherwise each row of ``x`` quantized to int8 per
    block of 32 inputs (``qkernels.h``; from 32 rows on, AVX2 builds compute the exact product
    instead, the faster one there). Either way row ``i``'s result does not depend on the other
    rows of a call of up to 31 rows (decode, verify rows, shared forwards). ``threads``
    defaults as for :func:`panel_matmul` (all cores for decode sizes too where
    :func:`quantized_decode_threads` says so). Shapes that do not match are a ``ValueError``
    (the primitive checks them). Without the compiled product: the dequantized weight through
    MLX (the exact values, slowly)."""
    if not qpanels_available() or x.dtype != mx.float32:
        return x @ quantized.dense(panels, n).astype(x.dtype)
    if threads is None:
        few = _rows(x) <= SMALL_ROWS and panels.nbytes < SPLIT_BYTES
        threads = quantized_decode_threads(1) if few else LARGE_M_THREADS
    return _ext.qpanel_matmul(x, panels, n, exact, threads)


def row_attention_available() -> bool:
    """Whether the compiled module has the few-row attention."""
    return _ext is not None and hasattr(_ext, "row_attention")


def row_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, threads: int = 1
) -> mx.array:
    """softmax(scale q k^T) v for a few float32 query rows ``q`` ``[B, H, L, D]`` over ``k``,
    ``v`` ``[B, G, T, D]``, row ``i`` over keys ``0 .. T - L + i`` (causal, lower-right), each
    row computed alone: row ``i`` of an ``L``-row call has the bits of the one-row call over
    the same keys, whatever ``threads`` (the heads' rows split over that many threads when
    there is enough work). Raises RuntimeError without the build
    (:func:`row_attention_available`)."""
    if not row_attention_available():
        raise RuntimeError(
            "runner.native has no row attention: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext.row_attention(q, k, v, scale, threads)


def qpanel_columns_available() -> bool:
    """Whether the compiled module reads columns of quantized panels (embedding lookups)."""
    return _ext is not None and hasattr(_ext, "qpanel_columns")


def qpanel_columns(panels: mx.array, ids: mx.array) -> mx.array:
    """Columns ``ids`` (integers, any shape) of the weight held as quantized ``panels``,
    float32 ``[*ids.shape, K]``, each value ``float32(s * q) + b``: for int32 and uint32 ids
    one node of the compiled module where it is built (an id outside the panels' columns gives
    a row of zeros), else :func:`quantized.columns`' MLX ops, the same values (a tied
    embedding's lookups, ``layers.PanelEmbedding``)."""
    if not qpanel_columns_available() or ids.dtype not in (mx.int32, mx.uint32):
        return quantized.columns(panels, ids)
    k = quantized.layout(panels)[0]  # refuses what is not quantized panels, by its shape
    return _ext.qpanel_columns(panels, ids.reshape(-1)).reshape(*ids.shape, k)


def top_k_ids_available() -> bool:
    """Whether the compiled module has the sampler's one-pass top-k."""
    return _ext is not None and hasattr(_ext, "top_k_ids")


def top_k_ids(logits: mx.array, k: int) -> mx.array:
    """Per row of float32 ``logits`` ``[R, V]`` the ids (uint32 ``[R, k]``, ascending) of the
    ``k`` largest values, ties toward the lower id, -0.0 as 0.0 (``runner.sampler``'s top-k
    rule): the same array as an argpartition of the sampler's rank key then a sort, from one
    pass over each row. ``0 < k < V``, else a ``ValueError``. Raises RuntimeError without the
    build (:func:`top_k_ids_available`)."""
    if not top_k_ids_available():
        raise RuntimeError(
            "runner.native has no top-k: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext.top_k_ids(logits, k)


def argmax_ids_available() -> bool:
    """Whether the compiled module has the sampler's native row argmax."""
    return _ext is not None and hasattr(_ext, "argmax_ids")


def argmax_ids(logits: mx.array) -> mx.array:
    """Per row of float32 ``logits`` ``[R, V]`` the index (int32 ``[R]``) ``mx.argmax`` gives:
    the first NaN of the row, else the first value equal to its maximum (-0.0 equal to 0.0).
    MLX's CPU argmax compares value by value, one row after another; this reads each row in
    vectors. Raises RuntimeError without the build (:func:`argmax_ids_available`)."""
    if not argmax_ids_available():
        raise RuntimeError(
            "runner.native has no row argmax: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext.argmax_ids(logits)


def penalise_rows_available() -> bool:
    """Whether the compiled module has the sampler's native penalties."""
    return _ext is not None and hasattr(_ext, "penalise_rows")


def penalise_rows(
    logits: mx.array, windows: mx.array, repeat: float, presence: float, frequency: float
) -> mx.array:
    """Float32 ``logits`` ``[R, V]`` with each distinct token ``t`` of row i's window (int32
    ``windows`` ``[R, W]``, or ``[1, W]`` for every row; ids outside ``[0, V)`` ignored)
    rewritten in float32 as ``runner.sampler`` does: ``old / repeat`` if ``old > 0`` else
    ``old * repeat`` (repeat != 1), ``- presence`` (!= 0), ``- frequency * count(t)`` (!= 0).
    One copy of each row, where the MLX ops make several passes over it. Raises
    RuntimeError without the build (:func:`penalise_rows_available`)."""
    if not penalise_rows_available():
        raise RuntimeError(
            "runner.native has no penalties: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext.penalise_rows(logits, windows, repeat, presence, frequency)


def rows_attention_available() -> bool:
    """Whether the compiled module attends several sequences' rows in one node."""
    return _ext is not None and hasattr(_ext, "rows_attention")


def rows_attention(
    q: mx.array,
    keys: list[mx.array],
    values: list[mx.array],
    lengths: list[int],
    counts: list[int],
    *,
    scale: float,
    threads: int = 1,
) -> mx.array:
    """:func:`row_attention` for several sequences in one node (a shared forward): ``q``
    ``[1, H, R, D]`` holds ``counts[i]`` rows of sequence ``i`` in turn, each over the first
    ``lengths[i]`` positions of its whole cache buffers ``keys[i]``, ``values[i]``
    ``[1, G, capacity, D]`` (no fetched views: two nodes fewer a sequence), row ``j`` at
    position ``lengths[i] - counts[i] + j``. Every row has the bits :func:`row_attention`
    gives it over its own cache. Raises RuntimeError without the build."""
    if not rows_attention_available():
        raise RuntimeError(
            "runner.native has no multi-sequence row attention: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext.rows_attention(q, keys, values, lengths, counts, scale, threads)


def row_attention_quantized_available(dim: int) -> bool:
    """Whether the compiled module attends over packed quantized rows of head dim ``dim``."""
    return (
        _ext is not None
        and hasattr(_ext, "row_attention_quantized")
        and dim in (16, 32, 64, 80, 96, 128, 256)
    )


def row_attention_quantized(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    bits: int,
    group: int,
    threads: int = 1,
) -> mx.array:
    """:func:`row_attention` over the packed rows of a ``cache.kv_quantized`` cache (uint32
    ``[B, G, T, words]``): each key and value is dequantized 16 values at a time as it is read,
    as ``scale * q + bias`` per group, never the whole cache. Row ``i`` of an ``L``-row call has
    the bits of the one-row call over the same keys."""
    if not row_attention_quantized_available(q.shape[-1]):
        raise RuntimeError(
            "runner.native has no quantized row attention for this head dimension: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext.row_attention_quantized(q, k, v, scale, bits, group, threads)


def flash_attention_quantized_available() -> bool:
    """Whether the compiled module has the fused attention over packed quantized rows."""
    return _ext is not None and hasattr(_ext, "flash_attention_quantized")


def flash_attention_quantized(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool,
    bits: int,
    group: int,
    threads: int | None = None,
) -> mx.array:
    """:func:`flash_attention` over the packed rows of a ``cache.kv_quantized`` cache (uint32
    ``[B, G, T, words]``): each block dequantizes a key tile (64 keys) into its scratch as it
    reads it, so no float copy of the cache is made."""
    if not flash_attention_quantized_available():
        raise RuntimeError(
            "runner.native has no quantized fused attention: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext.flash_attention_quantized(
        q, k, v, scale, causal, bits, group, threads or LARGE_M_THREADS
    )


def block_available() -> bool:
    """Whether the compiled module has the few-row decoder block (``block.h``)."""
    return _ext is not None and hasattr(_ext, "block_front")


def block_front(*args, **kwargs) -> list[mx.array]:
    """q, k, v of a decoder block's few rows in one node (``block.h``; arguments as
    ``_smallrow.block_front``). Raises RuntimeError without the build."""
    return _block_ext().block_front(*args, **kwargs)


def block_back(*args, **kwargs) -> mx.array:
    """A decoder block's output after its attention in one node (``block.h``; arguments as
    ``_smallrow.block_back``). Raises RuntimeError without the build."""
    return _block_ext().block_back(*args, **kwargs)


def _block_ext():
    if not block_available():
        raise RuntimeError(
            "runner.native has no decoder block: "
            + (_reason or "rebuild it with `python -m runner.native.build`")
        )
    return _ext
