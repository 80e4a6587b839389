package engine

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvactors/kvactors/actors"
	"github.com/kvactors/kvactors/metrics"
)

// Metrics are the collectors an engine actor counts on: the engine
// sessions' and the inbound path's sets, and the release counters it shares
// with its requests (a request it releases itself: unknown, failed).
type Metrics struct {
	*metrics.Engines
	*metrics.Events
	Release        func(reason string) prometheus.Counter // metrics.Store.Release: resolved per reason
	RequestFailure prometheus.Counter                     // metrics.Store
	Unexpected     prometheus.Counter                     // metrics.Actors, actor="engine"
}

// NewMetrics picks an engine actor's collectors out of the node's sets.
func NewMetrics(engines *metrics.Engines, events *metrics.Events, store *metrics.Store, act *metrics.Actors) Metrics {
	return Metrics{Engines: engines, Events: events, Release: store.Release, RequestFailure: store.RequestFailure,
		Unexpected: act.Unexpected.WithLabelValues(actors.KindEngine)}
}
