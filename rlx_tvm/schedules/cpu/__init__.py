"""Default CPU schedules for kernels that have no tuning record.

TVM 0.27's CPU pipeline schedules nothing: every kernel runs as serial loops. ``default_cpu_rules``
is the rule list for ``dlight.ApplyDefaultSchedule``, one rule per pattern, in priority order (the
first rule that returns a schedule wins; a rule that does not fit returns None):

* :class:`GEMV` (``gemv.py``): dlight's matrix-vector rule;
* :class:`Product` (``product.py``): matrix products and convolutions with fused epilogues;
* :class:`RowKernel` (``row_kernel.py``): multi-stage row kernels (norm, softmax-CE backward);
* one-block kernels: :class:`FullReduction`, :class:`ColumnReduction` (register-blocked products
  among them), :class:`WindowReduction` (pooling), :class:`RowReduction`, :class:`Transpose`,
  :class:`Elementwise`;
* :class:`ParallelFallback` (``fallback.py``): any other kernel, block by block.
"""

from .analysis import SMALL_WINDOW
from .column_reduction import (REDUCTION_BLOCK, ROW_TILE, TILE_ACCUMULATORS, TILE_GROUP, TILES_PER_CORE,
                               ColumnReduction, product_tile)
from .elementwise import MIN_ROWS_PARALLEL, Elementwise
from .fallback import BLOCK_RULES, ParallelFallback
from .full_reduction import FULL_REDUCTION_PARTS, MIN_FULL_REDUCTION, FullReduction
from .gemv import GEMV
from .product import Product, is_product
from .row_kernel import RowKernel, _merge_independent_passes  # noqa: F401 (tests check it directly)
from .row_reduction import RowReduction
from .transpose import Transpose
from .window import WindowReduction

__all__ = ["BLOCK_RULES", "FULL_REDUCTION_PARTS", "GEMV", "MIN_FULL_REDUCTION", "MIN_ROWS_PARALLEL", "REDUCTION_BLOCK",
           "ROW_TILE", "SMALL_WINDOW", "TILES_PER_CORE", "TILE_ACCUMULATORS", "TILE_GROUP", "ColumnReduction",
           "Elementwise", "FullReduction", "ParallelFallback", "Product", "RowKernel", "RowReduction", "Transpose",
           "WindowReduction", "default_cpu_rules", "is_product", "product_tile"]


def default_cpu_rules() -> list:
    """Rules in priority order: dlight's GEMV rule first, then products with epilogues (before the
    row-kernel rule, which would take a product's output for rows of statistics), multi-stage row
    kernels, the one-block rules, and the fallback for everything else.

    dlight's ``cpu.Reduction`` is left out: it keeps every row reduction a serial loop of dependent
    scalar adds (softmax-CE backward took 58 ms at 2048 x 8192, 11 ms with the vector row
    reductions of :class:`RowReduction`), and put fake-quantize's full reduction ``max|x|`` under
    the consumer's parallel row loop, recomputing it once per row."""
    return [GEMV(), Product(), RowKernel(), FullReduction(), ColumnReduction(), WindowReduction(), RowReduction(),
            Transpose(), Elementwise(), ParallelFallback()]
