"""``dt.resolve_cluster()``: which cluster resolver describes this process.

Its own module, above every resolver it chooses from (``resolvers.py``, ``tf_config``,
``kubernetes``, ``ray_train``), which build on ``resolvers.py``'s shared pieces.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from distrain._src.cluster.base import ENV_PROCESS_ID, ENV_TF_CONFIG, ClusterResolver
from distrain._src.cluster.kubernetes import KubernetesClusterResolver
from distrain._src.cluster.ray_train import RayTrainClusterResolver
from distrain._src.cluster.resolvers import AutoClusterResolver, EnvClusterResolver
from distrain._src.cluster.tf_config import TFConfigClusterResolver


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """Picks the resolver for this process from what its environment says.

    In order, the first that applies:

    1. `EnvClusterResolver`: DISTRAIN_PROCESS_ID, or any DISTRAIN_* cluster variable
       outside Kubernetes (inside, DISTRAIN_NUM_PROCESSES and
       DISTRAIN_COORDINATOR_ADDRESS may complete what Kubernetes gives);
    2. `TFConfigClusterResolver`: TF_CONFIG;
    3. `RayTrainClusterResolver`: inside a Ray Train training function;
    4. `KubernetesClusterResolver`: Kubeflow Trainer's JAX_* variables, or a
       JobSet / Indexed Job pod's JOB_COMPLETION_INDEX with DISTRAIN_NUM_PROCESSES;
    5. `AutoClusterResolver`: what JAX detects (Slurm, Open MPI, Kubernetes through
       its API with jax[k8s], Cloud TPU), else one process. A JobSet pod that JAX
       does not detect and that lacks DISTRAIN_NUM_PROCESSES is an error, not one
       process.

    Args:
        environ: the environment to inspect; `os.environ` by default.

    Example:
        >>> resolve_cluster({"DISTRAIN_NUM_PROCESSES": "1"}).num_processes
        1
    """
    env = os.environ if environ is None else environ
    in_kubernetes = KubernetesClusterResolver.is_present(env)
    if env.get(ENV_PROCESS_ID) or (EnvClusterResolver.is_present(env) and not in_kubernetes):
        return EnvClusterResolver(env)
    if TFConfigClusterResolver.is_present(env):
        return TFConfigClusterResolver(env[ENV_TF_CONFIG])
    if RayTrainClusterResolver.is_present():
        return RayTrainClusterResolver(environ=env)
    if in_kubernetes:
        return KubernetesClusterResolver(env)
    auto = AutoClusterResolver()
    if auto.environment is None and KubernetesClusterResolver.is_incomplete(env):
        return KubernetesClusterResolver(env)  # raises, naming what is missing
    return auto
