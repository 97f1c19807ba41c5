module github.com/Project-HAMi/hami-mig-sidecar/tests/e2e/cdi_probe

go 1.26.0
