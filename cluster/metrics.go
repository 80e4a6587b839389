package cluster

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvactors/kvactors/cluster/ownership"
)

// Metrics are the cluster's collectors, registered on the registerer the
// node passes in (never the global one). Safe for concurrent use.
type Metrics struct {
	Decisions     *prometheus.CounterVec // action: serve, claim, refuse, ignore
	Fenced        prometheus.Counter
	Unsettled     *prometheus.CounterVec // outcome: landed, in_process, unexplained, stale
	FetchBytes    prometheus.Counter
	FetchSeconds  prometheus.Histogram
	FetchFailures *prometheus.CounterVec // reason: corrupt, piece, refused, other
	ServedBytes   prometheus.Counter
	ServeRefused  prometheus.Counter
	FeedRejected  *prometheus.CounterVec // reason: unattributed, bad_message, refused, no_geometry
	CatchUps      *prometheus.CounterVec // result: ok, superseded, error
	KeysOverCap   prometheus.Counter     // keys left out: their node held Config.MaxPeerKeys
}

// NewMetrics builds the collectors and registers them on reg; nil reg
// leaves them unregistered (tests, or a node without metrics).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvactors_cluster_ownership_decisions_total",
			Help: "Ownership decisions on engine messages, by action (ignore: another node owns the engine).",
		}, []string{"action"}),
		Fenced: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvactors_cluster_ownership_fenced_total",
			Help: "Claims and keep-alives that lost their compare-and-set: the engine belongs to another node.",
		}),
		Unsettled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvactors_cluster_ownership_unsettled_writes_total",
			Help: "Claim writes whose reply did not settle them, by outcome: landed (this node's own write found in the bucket after its reply was lost or refused; a renewal), in_process (refused as another write in process at the stream leader; tried again), unexplained (refused past the claim's revision with no read showing the write past it; no verdict), stale (refused as below the claim's revision while a read shows the record at it: a deposed stream leader's answer; tried again).",
		}, []string{"outcome"}),
		FetchBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvactors_cluster_fetch_bytes_total",
			Help: "Chunk bytes fetched from other nodes and verified.",
		}),
		FetchSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvactors_cluster_fetch_seconds",
			Help:    "Time to fetch and verify one remote chunk.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		FetchFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvactors_cluster_fetch_failures_total",
			Help: "Remote chunk fetches that failed, by reason.",
		}, []string{"reason"}),
		ServedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvactors_cluster_fetch_served_bytes_total",
			Help: "Chunk bytes this node served to other nodes.",
		}),
		ServeRefused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvactors_cluster_fetch_refused_total",
			Help: "Fetch requests this node answered with an error.",
		}),
		FeedRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvactors_cluster_holders_rejected_total",
			Help: "Messages the holder index did not apply, by reason.",
		}, []string{"reason"}),
		CatchUps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvactors_cluster_holders_catchups_total",
			Help: "Key-set catch-ups of other nodes, by result.",
		}, []string{"result"}),
		KeysOverCap: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvactors_cluster_holders_keys_over_cap_total",
			Help: "Keys other nodes stored (kv_events) or listed (catch-up pages) that the holder index left out: their node already had --cluster-max-peer-keys keys indexed.",
		}),
	}
	// Every label value exists at 0 from the start, as the node's own
	// counters do (docs/OBSERVABILITY.md): an alert on rate() sees 0, not
	// "no data".
	for _, a := range []ownership.Action{ownership.Serve, ownership.Claim, ownership.Refuse, ownership.Ignore} {
		m.Decisions.WithLabelValues(a.String())
	}
	for _, o := range []string{"landed", "in_process", "unexplained", "stale"} { // claim
		m.Unsettled.WithLabelValues(o)
	}
	for _, r := range []string{"corrupt", "piece", "refused", "other"} { // fetchReason
		m.FetchFailures.WithLabelValues(r)
	}
	for _, r := range []string{"unattributed", "bad_message", "refused", "no_geometry"} { // feed.go
		m.FeedRejected.WithLabelValues(r)
	}
	for _, r := range []string{"ok", "superseded", "error"} { // feed.go catchUp
		m.CatchUps.WithLabelValues(r)
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.Decisions, m.Fenced, m.Unsettled, m.FetchBytes, m.FetchSeconds,
			m.FetchFailures, m.ServedBytes, m.ServeRefused, m.FeedRejected, m.CatchUps, m.KeysOverCap} {
			reg.MustRegister(c)
		}
	}
	return m
}

// orNew is m, or unregistered collectors when m is nil.
func (m *Metrics) orNew() *Metrics {
	if m == nil {
		return NewMetrics(nil)
	}
	return m
}

// fetchReason is the failure label of a fetch error.
func fetchReason(err error) string {
	switch {
	case errors.Is(err, ErrCorrupt):
		return "corrupt"
	case errors.Is(err, ErrPiece):
		return "piece"
	case errors.Is(err, ErrRefused):
		return "refused"
	}
	return "other"
}
