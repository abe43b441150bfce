"""Peer all-reduce runners that ``benchmarks/allreduce.py`` compares daskdist with.

One small module per peer (``gloo_allreduce``, ``mpi_allreduce``), each with a
``run(n_ranks, plan)`` function for the main script and a command line of its
own (``.venv/bin/python benchmarks/peers/mpi_allreduce.py --help``). What they
share (message sizes, the iteration plan, the timing loop every rank runs) is
in ``_base``.
"""
