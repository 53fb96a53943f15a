"""The committed tuning logs, shipped as package data: one directory per target key (see
:func:`rlx_tvm.target.target_key`), each a MetaSchedule JSON database with the record of the run
that wrote it (``TUNING.json``, rendered as ``TUNING.md``). :func:`rlx_tvm.compile` finds them
through :mod:`importlib.resources`."""
