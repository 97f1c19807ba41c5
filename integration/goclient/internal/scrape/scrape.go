// Package scrape reads Prometheus metrics for tests and benchmarks: a /metrics page as Prometheus
// parses it, or what a registry gathers, and the value of one series.
package scrape

import (
	"context"
	"net/http"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Page reads http://address/metrics as Prometheus parses it, by family name.
func Page(ctx context.Context, t testing.TB, address string) map[string]*dto.MetricFamily {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+address+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("the scrape does not parse: %v", err)
	}
	return families
}

// Gathered is what g gathers now, by family name.
func Gathered(t testing.TB, g prometheus.Gatherer) map[string]*dto.MetricFamily {
	t.Helper()
	list, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	families := make(map[string]*dto.MetricFamily, len(list))
	for _, f := range list {
		families[f.GetName()] = f
	}
	return families
}

// Value is the sample of family whose labels are exactly labels (a histogram's: its count); ok is
// false when there is none.
func Value(families map[string]*dto.MetricFamily, family string, labels map[string]string) (value float64, ok bool) {
	for _, m := range families[family].GetMetric() {
		if len(m.GetLabel()) != len(labels) {
			continue
		}
		match := true
		for _, l := range m.GetLabel() {
			if want, ok := labels[l.GetName()]; !ok || want != l.GetValue() {
				match = false
			}
		}
		switch {
		case !match:
		case m.Counter != nil:
			return m.GetCounter().GetValue(), true
		case m.Gauge != nil:
			return m.GetGauge().GetValue(), true
		case m.Histogram != nil:
			return float64(m.GetHistogram().GetSampleCount()), true
		}
	}
	return 0, false
}
