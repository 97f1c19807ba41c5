// Package manifests checks the files an operator installs from deploy/ with the types the cluster
// itself decodes them with: the DaemonSet with k8s.io/api's apps/v1 types, the PrometheusRule with
// the prometheus-operator's monitoring/v1 types, both strictly (sigs.k8s.io/yaml: a field the type
// does not have is an error, as `kubectl apply --validate=strict` would report it), and every PromQL
// expression of the rules and the Grafana dashboard with Prometheus' own parser.
//
// Beyond decoding, it checks what an operator relies on (see CheckDaemonSet). The tests of this
// package run the checks on the files of deploy/ and on broken copies of them, so a check that
// stopped failing would be noticed. It is a module of its own so that these dependencies stay out
// of the client module HAMi imports.
package manifests
