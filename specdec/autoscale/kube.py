"""The Kubernetes side: read and set the replicas of the draft and target Deployments.

Through the scale subresource (``/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``), as
``kubectl scale`` and the HorizontalPodAutoscaler do: it touches nothing but ``spec.replicas``, and
the RBAC it needs is ``get`` and ``patch`` on ``deployments/scale`` only.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from kubernetes import client, config

FIELD_MANAGER = "specdec-autoscaler"  # who server-side field ownership says last set the replicas
IN_CLUSTER_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class Scale:
    name: str
    spec_replicas: int  # what the Deployment asks for
    status_replicas: int  # pods that exist now (ready or not)


def api_client(kubeconfig: str | None = None, context: str | None = None, host: str | None = None) -> client.ApiClient:
    """A client on its own Configuration (the kubernetes package's global default is left alone).

    ``host``: talk to this URL without credentials (``kubectl proxy``, tests); else a kubeconfig
    when one is named, else the pod's service account when running in a cluster, else
    ``~/.kube/config``.
    """
    configuration = client.Configuration()
    if host is not None:
        configuration.host = host
    elif kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    return client.ApiClient(configuration)


def default_namespace() -> str:
    """The pod's own namespace in a cluster, else ``default``."""
    try:
        with open(IN_CLUSTER_NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


class DeploymentScaler:
    """Replicas of Deployments in one namespace, via their scale subresource."""

    def __init__(self, api: client.ApiClient, namespace: str, request_timeout_s: float = 10.0) -> None:
        self.apps = client.AppsV1Api(api)
        self.namespace = namespace
        self.timeout_s = request_timeout_s

    def read(self, name: str) -> Scale:
        scale = self.apps.read_namespaced_deployment_scale(name, self.namespace, _request_timeout=self.timeout_s)
        return Scale(name, int(scale.spec.replicas or 0), int((scale.status.replicas if scale.status else 0) or 0))

    def set_replicas(self, name: str, replicas: int) -> Scale:
        """Patch ``spec.replicas`` only (a merge patch: nothing else in the object is sent or changed)."""
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        scale = self.apps.patch_namespaced_deployment_scale(
            name, self.namespace, {"spec": {"replicas": int(replicas)}}, field_manager=FIELD_MANAGER,
            _content_type="application/merge-patch+json", _request_timeout=self.timeout_s)
        return Scale(name, int(scale.spec.replicas or 0), int((scale.status.replicas if scale.status else 0) or 0))
