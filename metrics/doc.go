// Package metrics owns kvactors' Prometheus collectors, in one small set per
// subsystem (Events, Engines, Store, Transfer, Load, NATS, Actors: sets.go),
// each built and registered by its own constructor on a registerer passed
// in (never the global one). Metrics embeds every set: the node builds it
// once and hands each component only what it counts (the transfer and load
// actors one set each; request.Metrics and engine.Metrics pick theirs out of
// the sets); nothing but node holds the whole. Names follow kvactors_<subsystem>_<what>_<unit>; the transfer
// counters keep vLLM's kv_offload_total_bytes / kv_offload_total_time names
// with a transfer_type label so existing dashboards work.
//
// client_golang rather than the OTel Prometheus exporter: the hot path pays
// one atomic add per counter, tests read values with testutil, and nothing
// touches OTel's global meter provider.
package metrics
