package main

import (
	"context"
	"log"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/dra"
)

// serveMetrics serves the plugin's metrics on address until ctx is done (none when address is
// empty: the plugin then records nothing). It logs the address it listens on.
func serveMetrics(ctx context.Context, address string, logger *log.Logger) (*dra.Metrics, error) {
	if address == "" {
		return nil, nil
	}
	reg, metrics, err := dra.NewRegistry()
	if err != nil {
		return nil, err
	}
	listening, err := dra.ServeMetrics(ctx, address, reg, func(err error) { logger.Printf("%v", err) })
	if err != nil {
		return nil, err
	}
	logger.Printf("serving metrics on http://%s/metrics", listening)
	return metrics, nil
}
