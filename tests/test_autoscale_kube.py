"""specdec.autoscale.kube through the real kubernetes client, against a FAKE API server (tests/fake_kube_api.py)."""
from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from specdec.autoscale import kube
from fake_kube_api import FakeKubeApi


@pytest.fixture
def fake_api():
    api = FakeKubeApi({("specdec", "specdec-target"): 2, ("specdec", "specdec-draft"): 1}).start()
    yield api
    api.stop()


@pytest.fixture
def scaler(fake_api):
    client = kube.api_client(host=fake_api.url)
    yield kube.DeploymentScaler(client, "specdec", request_timeout_s=5)
    client.close()


def test_read_scale(scaler, fake_api):
    assert scaler.read("specdec-target") == kube.Scale("specdec-target", 2, 2)
    (request,) = fake_api.requests
    assert (request.method, request.path) == ("GET", "/apis/apps/v1/namespaces/specdec/deployments/specdec-target/scale")


def test_set_replicas_sends_a_merge_patch_of_spec_replicas_only(scaler, fake_api):
    assert scaler.set_replicas("specdec-draft", 3) == kube.Scale("specdec-draft", 3, 3)
    (patch,) = fake_api.patches()
    assert patch.path == "/apis/apps/v1/namespaces/specdec/deployments/specdec-draft/scale"
    assert patch.content_type == "application/merge-patch+json"
    assert patch.body == {"spec": {"replicas": 3}}
    assert f"fieldManager={kube.FIELD_MANAGER}" in patch.query
    assert fake_api.deployments[("specdec", "specdec-draft")] == 3
    assert fake_api.deployments[("specdec", "specdec-target")] == 2  # untouched
    assert scaler.read("specdec-draft").spec_replicas == 3


def test_errors_surface_as_api_exceptions(scaler, fake_api):
    with pytest.raises(ApiException) as missing:
        scaler.read("no-such-deployment")
    assert missing.value.status == 404
    fake_api.fail_patches = True
    with pytest.raises(ApiException) as failed:
        scaler.set_replicas("specdec-target", 4)
    assert failed.value.status == 500
    assert fake_api.deployments[("specdec", "specdec-target")] == 2
    with pytest.raises(ValueError):
        scaler.set_replicas("specdec-target", -1)


def test_a_kubeconfig_is_loaded_into_its_own_configuration(tmp_path, fake_api):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(f"""
apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {{server: "{fake_api.url}"}}
users:
- name: robot
  user: {{token: "not-a-real-token"}}
contexts:
- name: fake
  context: {{cluster: fake, user: robot, namespace: specdec}}
current-context: fake
""")
    client = kube.api_client(kubeconfig=str(kubeconfig))
    try:
        assert kube.DeploymentScaler(client, "specdec").read("specdec-target").spec_replicas == 2
    finally:
        client.close()
    from kubernetes import client as k8s

    assert k8s.Configuration.get_default_copy().host != fake_api.url  # the global default is left alone
