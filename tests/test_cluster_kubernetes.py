"""KubernetesClusterResolver on the variables Kubernetes controllers set (no cluster runs here).

The variables and values are those the controllers document: Kubeflow Trainer's JAX
plugin (kubeflow/trainer pkg/runtime/framework/plugins/jax/jax.go sets JAX_NUM_PROCESSES,
JAX_PROCESS_ID from the job-completion-index and JAX_COORDINATOR_ADDRESS as
'<trainjob>-node-0-0.<trainjob>:<port>'), Kubernetes' Indexed Job (JOB_COMPLETION_INDEX)
and JobSet's pod annotations (jobset.sigs.k8s.io/jobset-name, replicatedjob-name,
job-index, replicatedjob-replicas, coordinator) mapped by the downward API.
"""

import pytest

from distrain import (
    AutoClusterResolver,
    EnvClusterResolver,
    KubernetesClusterResolver,
    TFConfigClusterResolver,
    resolve_cluster,
)


def kubeflow(trainjob="mnist", nodes=2, index=0, port=6666):
    return {
        "JAX_NUM_PROCESSES": str(nodes),
        "JAX_PROCESS_ID": str(index),
        "JAX_COORDINATOR_ADDRESS": f"{trainjob}-node-0-0.{trainjob}:{port}",
        "JAX_COORDINATOR_PORT": str(port),
        "JAX_DISTRIBUTED_BACKEND": "gloo",
        "JOB_COMPLETION_INDEX": str(index),
    }


def jobset(name="train", rjob="workers", job=0, pod=0, replicas=1, pods=2, **extra):
    env = {
        "JOBSET_NAME": name,
        "REPLICATED_JOB_NAME": rjob,
        "JOB_INDEX": str(job),
        "REPLICATED_JOB_REPLICAS": str(replicas),
        "JOB_COMPLETION_INDEX": str(pod),
        "HOSTNAME": f"{name}-{rjob}-{job}-{pod}",
        "DISTRAIN_NUM_PROCESSES": str(pods),
    }
    env.update(extra)
    return env


@pytest.mark.parametrize("index", [0, 1, 2])
def test_kubeflow_trainer_jax_runtime(index):
    r = KubernetesClusterResolver(kubeflow(nodes=3, index=index))
    assert r.source == "kubeflow"
    assert (r.num_processes, r.process_id, r.is_chief) == (3, index, index == 0)
    assert r.coordinator_address == "mnist-node-0-0.mnist:6666"
    assert isinstance(resolve_cluster(kubeflow(nodes=3, index=index)), KubernetesClusterResolver)


@pytest.mark.parametrize(
    "job, pod, process_id", [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3), (2, 1, 5)]
)
def test_jobset_process_id_is_job_index_times_pods_per_job_plus_completion_index(
    job, pod, process_id
):
    r = KubernetesClusterResolver(jobset(job=job, pod=pod, replicas=3, pods=6))
    assert (r.source, r.num_processes, r.process_id) == ("jobset", 6, process_id)
    # The first pod of the first job, through the JobSet's headless service, on JAX's port.
    assert r.coordinator_address == "train-workers-0-0.train:55527"


def test_jobset_coordinator_from_annotation_port_and_override():
    env = jobset(JOBSET_COORDINATOR="train-leader-0-0.train", JAX_COORDINATOR_PORT="7000")
    assert KubernetesClusterResolver(env).coordinator_address == "train-leader-0-0.train:7000"
    env["DISTRAIN_COORDINATOR_ADDRESS"] = "10.0.0.1:8476"
    assert KubernetesClusterResolver(env).coordinator_address == "10.0.0.1:8476"


def test_indexed_job_with_address_and_count_from_the_manifest():
    env = {
        "JOB_COMPLETION_INDEX": "1",
        "DISTRAIN_NUM_PROCESSES": "2",
        "DISTRAIN_COORDINATOR_ADDRESS": "train-0.jaxpods:1234",
        "DISTRAIN_LOCAL_DEVICES": "4",
    }
    r = resolve_cluster(env)
    assert isinstance(r, KubernetesClusterResolver)
    assert (r.source, r.process_id, r.num_processes, r.local_device_count) == (
        "indexed-job",
        1,
        2,
        4,
    )


def test_resolution_order():
    # DISTRAIN_PROCESS_ID wins over what Kubernetes says; TF_CONFIG over Kubernetes.
    env = {**kubeflow(index=1), "DISTRAIN_PROCESS_ID": "0", "DISTRAIN_NUM_PROCESSES": "2"}
    env["DISTRAIN_COORDINATOR_ADDRESS"] = "a:1"
    assert isinstance(resolve_cluster(env), EnvClusterResolver)
    tf = '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}'
    assert isinstance(resolve_cluster({**kubeflow(), "TF_CONFIG": tf}), TFConfigClusterResolver)
    # A plain Indexed Job pod (JOB_COMPLETION_INDEX only) is left to JAX's own detection.
    assert isinstance(resolve_cluster({"JOB_COMPLETION_INDEX": "0"}), AutoClusterResolver)


def test_a_jobset_pod_without_the_number_of_processes_is_an_error_not_one_process():
    env = jobset()
    del env["DISTRAIN_NUM_PROCESSES"]
    with pytest.raises(ValueError, match=r"DISTRAIN_NUM_PROCESSES must be set .*parallelism"):
        resolve_cluster(env)


@pytest.mark.parametrize(
    "env, match",
    [
        # world size that disagrees with the variables
        (
            {**kubeflow(nodes=2), "DISTRAIN_NUM_PROCESSES": "3"},
            r"number of processes disagrees: DISTRAIN_NUM_PROCESSES=3 \(set by the manifest.*\) "
            r"but JAX_NUM_PROCESSES=2 \(set by Kubeflow Trainer's JAX runtime, from the "
            r"TrainJob's spec.trainer.numNodes\)",
        ),
        (
            jobset(replicas=2, pods=3),
            r"DISTRAIN_NUM_PROCESSES=3 .* is not a multiple of REPLICATED_JOB_REPLICAS=2 \(set "
            r"by the JobSet annotation jobset.sigs.k8s.io/replicatedjob-replicas",
        ),
        # rank out of range
        (
            kubeflow(nodes=2, index=2),
            r"JAX_PROCESS_ID must be in 0..1 \(JAX_NUM_PROCESSES=2 .*\)\. Received: "
            r"JAX_PROCESS_ID=2 \(set by Kubeflow Trainer's JAX runtime, from the pod's "
            r"batch.kubernetes.io/job-completion-index\)",
        ),
        (
            jobset(pod=2, pods=2),
            r"JOB_COMPLETION_INDEX must be in 0..1 .*Received: JOB_COMPLETION_INDEX=2 \(set by "
            r"Kubernetes, in every pod of an Indexed Job\)",
        ),
        (
            jobset(job=2, replicas=2, pods=4),
            r"JOB_INDEX must be in 0..1 .*JOB_INDEX=2 \(set by the JobSet annotation "
            r"jobset.sigs.k8s.io/job-index",
        ),
        (
            {**kubeflow(), "JAX_PROCESS_ID": "-1"},
            r"JAX_PROCESS_ID \(set by Kubeflow Trainer's JAX runtime.*\) must be an integer >= 0"
            r"\. Received: '-1'",
        ),
        # missing coordinator
        (
            {k: v for k, v in kubeflow().items() if k != "JAX_COORDINATOR_ADDRESS"},
            r"JAX_COORDINATOR_ADDRESS \(set by Kubeflow Trainer's JAX runtime\) must be process "
            r"0's 'host:port' when JAX_NUM_PROCESSES=2\. Received: unset",
        ),
        (
            {"JOB_COMPLETION_INDEX": "0", "DISTRAIN_NUM_PROCESSES": "2"},
            r"no coordinator for DISTRAIN_NUM_PROCESSES=2 .*Expected DISTRAIN_COORDINATOR_ADDRESS"
            r" \('<job>-0.<headless service>:<port>'",
        ),
        (
            {**kubeflow(), "JAX_COORDINATOR_ADDRESS": "mnist-node-0-0.mnist"},
            r"JAX_COORDINATOR_ADDRESS \(set by Kubeflow.*\) must be a 'host:port' string",
        ),
        (
            {k: v for k, v in kubeflow().items() if k != "JAX_PROCESS_ID"},
            r"JAX_PROCESS_ID must be set together with JAX_NUM_PROCESSES .*Received: "
            r"JAX_NUM_PROCESSES='2', JAX_PROCESS_ID unset",
        ),
        (
            {k: v for k, v in jobset(replicas=2, pods=4).items() if k != "JOB_INDEX"},
            r"JOB_INDEX \(set by the JobSet annotation jobset.sigs.k8s.io/job-index .*\) must be "
            r"set when REPLICATED_JOB_REPLICAS=2",
        ),
    ],
)
def test_bad_input_names_the_variable_and_its_source(env, match):
    with pytest.raises(ValueError, match=match):
        KubernetesClusterResolver(env)
    with pytest.raises(ValueError, match=match):
        resolve_cluster(env)  # what dt.MultiWorkerMirroredStrategy() calls, on every pod
