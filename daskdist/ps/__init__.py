"""The parameter-server service: variables held once, in stores on Dask workers, and the closures that use them.

Modules, bottom up:

``entries``
    a stored variable's value, version and copy-on-write hand-out;
``rounds``
    synchronous rounds (every replica contributes, the store finishes once);
``store``
    ``ParameterStore``, the worker extension serving one worker's stores;
``channel``
    the direct TCP channel from a replica thread to a store;
``refs``
    ``StoreRef``: reaching a store from a replica thread or from the client;
``members``
    the stores as members with role ``ps`` of a group (worker plugin, scheduler plugin);
``session``
    a closure's batched reads and updates on a worker;
``values``
    ``AggregatingVariable``, the client's handle and the workers' views of a stored variable;
``input``
    per-worker input planned by locality, and the ledger of what each closure loaded;
``closures``
    the worker half of the coordinator: closures and per-worker datasets and iterators;
``client``
    what the strategies (``daskdist.strategy``) use of all this: the one module they import.
"""
