"""Multi-process set-up: cluster resolvers, collectives options, JAX runtime start, launcher.

Users import these names from ``distrain``; this package only groups them.
"""

from distrain.cluster.base import ClusterResolver as ClusterResolver
from distrain.cluster.communication import (
    CommunicationImplementation as CommunicationImplementation,
)
from distrain.cluster.communication import CommunicationOptions as CommunicationOptions
from distrain.cluster.resolvers import AutoClusterResolver as AutoClusterResolver
from distrain.cluster.resolvers import EnvClusterResolver as EnvClusterResolver
from distrain.cluster.resolvers import SimpleClusterResolver as SimpleClusterResolver
from distrain.cluster.resolvers import resolve_cluster as resolve_cluster
from distrain.cluster.runtime import initialize_distributed as initialize_distributed
from distrain.cluster.tf_config import TFConfigClusterResolver as TFConfigClusterResolver

__all__ = [
    "AutoClusterResolver",
    "ClusterResolver",
    "CommunicationImplementation",
    "CommunicationOptions",
    "EnvClusterResolver",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "initialize_distributed",
    "resolve_cluster",
]
