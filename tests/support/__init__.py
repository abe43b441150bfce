"""The shared test harness: real worker processes, the kill watchers, model and data helpers.

Test modules import from here, never from one another. ``processes`` holds the
real-process workers (``ProcessWorkers``, a warm pool of them, the
``process_workers`` fixture registered in ``tests/conftest.py``), ``killers``
the ways a test places a kill (at a fault point, at a reported step),
``models`` the small Keras models and data sets the elastic tests share, and
``transports`` the collective checks shared by the transport tests.
"""
