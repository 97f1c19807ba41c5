"""hami-mig-sidecar: the node-local owner of NVIDIA MIG instances for HAMi's device plugin."""

__version__ = "0.1.0"
