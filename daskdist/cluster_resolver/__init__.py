"""Cluster resolvers (TF's ``tf.distribute.cluster_resolver`` and ``tf.train.ClusterSpec``), plus one for Dask."""

from __future__ import annotations

from daskdist.cluster_resolver.base import ClusterResolver, SimpleClusterResolver
from daskdist.cluster_resolver.cluster_spec import ClusterSpec
from daskdist.cluster_resolver.dask import DaskClusterResolver
from daskdist.cluster_resolver.tfconfig import TFConfigClusterResolver

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "DaskClusterResolver",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
]
