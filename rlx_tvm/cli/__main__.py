"""``python -m rlx_tvm.cli``: the ``rlx-tvm`` command line."""

import sys

from . import main

sys.exit(main())
