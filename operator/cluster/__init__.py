"""The operator's I/O: the Kubernetes API, config sources (ConfigMap, hub), the engine pods' metrics."""
