"""Autoscaler for the draft and target pools: observe (Prometheus scrapes) → decide (a pure policy) → act (the
Kubernetes scale subresource). Run it as ``specdec autoscale``; see `specdec.autoscale.run`."""
