package dra

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/dynamic-resource-allocation/resourceslice"

	"github.com/Project-HAMi/hami-mig-sidecar/integration/goclient/migclient"
)

// The plugin's own Prometheus metrics (docs/operations.md names them and the alert on them). They
// say what kubelet sees of the plugin, which the sidecar's metrics cannot: a claim whose prepare
// fails before any Allocate (its device is not in the plugin's model), a prepare's whole time
// including the sidecar's retries, and whether the node's slices still follow the sidecar.
//
// result is "success" or "failure"; reason is the sidecar's error reason (PLACEMENT_BUSY, GPU_LOST,
// ...), OTHER for an error of the plugin's own that carries none (a device it does not publish, no
// CDI spec written), and "" on success, so the series stay few. stage says where a republish failed: info
// (GetInfo), sync (after the sidecar restarted), state (GetState) or publish (the API server).
const (
	MetricPrepares          = "hami_mig_dra_prepares_total"
	MetricPrepareDuration   = "hami_mig_dra_prepare_duration_seconds"
	MetricPreparesInFlight  = "hami_mig_dra_prepares_in_flight"
	MetricPreparedDevices   = "hami_mig_dra_prepared_devices_total"
	MetricUnprepares        = "hami_mig_dra_unprepares_total"
	MetricSlicePublishes    = "hami_mig_dra_slice_publishes_total"
	MetricPublishedDevices  = "hami_mig_dra_published_devices"
	MetricRepublishErrors   = "hami_mig_dra_republish_errors_total"
	reasonOther             = "OTHER"
	resultSuccess           = "success"
	resultFailure           = "failure"
	republishStageInfo      = "info"
	republishStageSync      = "sync"
	republishStageState     = "state"
	republishStagePublish   = "publish"
	prepareDurationMaxBound = 60 // seconds: the command's default --allocate-timeout
)

// PrepareBuckets are the prepare latency histogram's upper bounds, in seconds: a warm prepare
// answers in milliseconds, a create in a fraction of a second to seconds, and a prepare that waits
// out a busy placement up to the allocate timeout.
var PrepareBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, prepareDurationMaxBound}

// Metrics are the plugin's metrics. A nil *Metrics (Options.Metrics unset) records nothing.
type Metrics struct {
	prepares         *prometheus.CounterVec
	prepareDuration  *prometheus.HistogramVec
	inFlight         prometheus.Gauge
	preparedDevices  *prometheus.CounterVec
	unprepares       *prometheus.CounterVec
	slicePublishes   prometheus.Counter
	publishedDevices *prometheus.GaugeVec
	republishErrors  *prometheus.CounterVec
}

// NewMetrics registers the plugin's metrics with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		prepares: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricPrepares,
			Help: "Claims prepared (NodePrepareResources, per claim), by result and the sidecar's error reason."}, []string{"result", "reason"}),
		prepareDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: MetricPrepareDuration,
			Help:    "Time to prepare one claim, the sidecar's Allocate and its retries included, by result.",
			Buckets: PrepareBuckets}, []string{"result"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricPreparesInFlight,
			Help: "Claims being prepared now."}),
		preparedDevices: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricPreparedDevices,
			Help: `Devices of prepared claims; warm="true": an IDLE instance reused (a warm hit), "false": one created.`}, []string{"warm"}),
		unprepares: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricUnprepares,
			Help: "Claims unprepared (NodeUnprepareResources, per claim), by result and the sidecar's error reason."}, []string{"result", "reason"}),
		slicePublishes: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricSlicePublishes,
			Help: "Updates of the node's ResourceSlices handed to the kubelet plugin helper, which writes them."}),
		publishedDevices: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: MetricPublishedDevices,
			Help: `Devices in the node's ResourceSlices as last published; warm="true": over an IDLE instance, or a claim's that goes IDLE at its unprepare.`}, []string{"warm"}),
		republishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricRepublishErrors,
			Help: "Failed republishing rounds, by stage: info, sync, state, publish."}, []string{"stage"}),
	}
	for _, c := range []prometheus.Collector{m.prepares, m.prepareDuration, m.inFlight, m.preparedDevices, m.unprepares,
		m.slicePublishes, m.publishedDevices, m.republishErrors} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register the DRA plugin's metrics: %w", err)
		}
	}
	// Every series an alert or a panel reads exists from the start, at 0, so a rate over it is
	// defined before the first failure.
	m.prepares.WithLabelValues(resultSuccess, "")
	m.unprepares.WithLabelValues(resultSuccess, "")
	for _, result := range []string{resultSuccess, resultFailure} {
		m.prepareDuration.WithLabelValues(result)
	}
	for _, warm := range []string{"true", "false"} {
		m.preparedDevices.WithLabelValues(warm)
		m.publishedDevices.WithLabelValues(warm)
	}
	for _, stage := range []string{republishStageInfo, republishStageSync, republishStageState, republishStagePublish} {
		m.republishErrors.WithLabelValues(stage)
	}
	return m, nil
}

func outcome(err error) (result, reason string) {
	if err == nil {
		return resultSuccess, ""
	}
	if r := migclient.ReasonOf(err); r != "" {
		return resultFailure, r
	}
	return resultFailure, reasonOther
}

// prepareStarted counts a claim in flight; the function it returns records the claim's result.
func (m *Metrics) prepareStarted() func(err error) {
	if m == nil {
		return func(error) {}
	}
	start := time.Now()
	m.inFlight.Inc()
	return func(err error) {
		m.inFlight.Dec()
		result, reason := outcome(err)
		m.prepares.WithLabelValues(result, reason).Inc()
		m.prepareDuration.WithLabelValues(result).Observe(time.Since(start).Seconds())
	}
}

// allocated counts the devices of a successful Allocate, warm (reused) or created. A repeat
// (ALREADY_ALLOCATED) counts neither: its devices were counted the first time.
func (m *Metrics) allocated(res migclient.AllocateResult) {
	if m == nil {
		return
	}
	for _, d := range res.Devices {
		switch d.Outcome {
		case migclient.OutcomeReused:
			m.preparedDevices.WithLabelValues("true").Inc()
		case migclient.OutcomeCreated:
			m.preparedDevices.WithLabelValues("false").Inc()
		case migclient.OutcomeUnspecified, migclient.OutcomeAlreadyAllocated:
		}
	}
}

func (m *Metrics) unprepared(err error) {
	if m == nil {
		return
	}
	result, reason := outcome(err)
	m.unprepares.WithLabelValues(result, reason).Inc()
}

// published records slices handed to the helper: their devices, warm or not.
func (m *Metrics) published(res resourceslice.DriverResources) {
	if m == nil {
		return
	}
	m.slicePublishes.Inc()
	warm, cold := 0, 0
	for _, pool := range res.Pools {
		for _, slice := range pool.Slices {
			for _, d := range slice.Devices {
				if a, ok := d.Attributes[AttrWarm]; ok && a.BoolValue != nil && *a.BoolValue {
					warm++
				} else {
					cold++
				}
			}
		}
	}
	m.publishedDevices.WithLabelValues("true").Set(float64(warm))
	m.publishedDevices.WithLabelValues("false").Set(float64(cold))
}

func (m *Metrics) republishFailed(stage string) {
	if m == nil {
		return
	}
	m.republishErrors.WithLabelValues(stage).Inc()
}

// NewRegistry is a registry with the plugin's metrics and the Go runtime's and process's
// collectors, as the command serves them.
func NewRegistry() (*prometheus.Registry, *Metrics, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(collectors.NewGoCollector()); err != nil {
		return nil, nil, fmt.Errorf("register the Go collector: %w", err)
	}
	if err := reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, nil, fmt.Errorf("register the process collector: %w", err)
	}
	m, err := NewMetrics(reg)
	if err != nil {
		return nil, nil, err
	}
	return reg, m, nil
}

// ServeMetrics serves reg's metrics on address (host:port) at /metrics until ctx is done; it
// returns once it listens, with the address it listens on (port 0 picks one), and reports a
// later serving error to onError.
func ServeMetrics(ctx context.Context, address string, reg prometheus.Gatherer, onError func(error)) (string, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", address)
	if err != nil {
		return "", fmt.Errorf("metrics on %s: %w", address, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) && onError != nil {
			onError(fmt.Errorf("metrics on %s: %w", address, err))
		}
	}()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown) //nolint:contextcheck // ctx is done; the shutdown gets its own deadline
	}()
	return ln.Addr().String(), nil
}
