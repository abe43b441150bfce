"""Pieces of ``benchmarks/training.py``: the Keras-path parts (1, 2) and the PyTorch part (3).

Functions here run on daskdist replicas (sent by reference: the Dask worker
processes are spawned with this process's ``sys.path``, which holds
``benchmarks/``) and in the ``torch.multiprocessing`` ranks of the DDP peer.
"""
