"""The Extended contract (TF's ``StrategyExtended``) and each strategy's implementation of it.

``contract.py`` holds the abstract ``StrategyExtended``; ``spmd.py`` and ``parameter_holder.py`` the two kinds of
implementation (replicas in lockstep; variables held by parameter stores); one module per strategy subclasses them;
``elastic_options.py`` holds the option value type the strategies take. A new strategy implements ``contract.py``.
"""
