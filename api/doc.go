// Package api holds the hami-mig-sidecar gRPC contract and its generated Go code; import
// github.com/Project-HAMi/hami-mig-sidecar/api/hami/migsidecar/v1.
package api
