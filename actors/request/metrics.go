package request

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/metrics"
)

// Metrics are the collectors a request actor counts on: the store
// decisions' set and three counters of other sets (STYLE: a component
// takes what it counts, not the node's whole registry).
type Metrics struct {
	*metrics.Store
	EventsApplied prometheus.Counter     // metrics.Events
	Rejected      *prometheus.CounterVec // metrics.Events: reason
	Unexpected    prometheus.Counter     // metrics.Actors, actor="request"
}

// NewMetrics picks a request actor's collectors out of the node's sets.
func NewMetrics(events *metrics.Events, store *metrics.Store, act *metrics.Actors) Metrics {
	return Metrics{Store: store, EventsApplied: events.EventsApplied, Rejected: events.Rejected,
		Unexpected: act.Unexpected.WithLabelValues(actors.KindRequest)}
}
