// Package drabench is the Go half of bench/dra_claims.py, which starts the sidecar and runs
// BenchmarkClaimTrace (go test -bench, never part of make test): a claim trace through the real
// kube-scheduler and the DRA kubelet plugin (package dra), with NodePrepareResources and
// NodeUnprepareResources called as kubelet calls them.
//
// Each arrival of the trace is a ResourceClaim for one device of its profile (a CEL selector on
// the profile attribute, no preference for warm devices: the slice order alone brings a claim to
// an IDLE instance) and a pod using it; the scheduler binds the pod and allocates the claim, then
// the claim is prepared and the time of NodePrepareResources is the claim-prepare latency, and the
// plugin's warm-hit counter says whether it reused an IDLE instance. A pod the scheduler reports
// unschedulable is given retryWait to be tried again and bound; after that it is deleted with its
// claim and counted as refused. Each
// departure unprepares the claim and deletes the pod and the claim, as kubelet and
// kube-controller-manager would. Events run in trace order, one at a time. Unless
// DRA_BENCH_SETTLE is "0", before each arrival the benchmark waits until the node settled: the
// published slices show as warm exactly the IDLE instances the sidecar reports, and the sidecar's
// trim freed the placements the plugin asked it to keep free, so a claim sees the cache as the
// plugin republished it and the result does not depend on how fast the machine replays. With "0"
// each arrival follows the last event at once: a lag in republishing or trimming is measured.
package drabench
