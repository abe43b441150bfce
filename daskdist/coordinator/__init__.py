"""The parameter-server client API (TF's ``distribute/coordinator/``): ``ClusterCoordinator``, remote values and
per-worker datasets, over ``ParameterServerStrategy``."""
