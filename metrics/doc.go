// Package metrics owns kvactors' Prometheus collectors, in one small set per
// subsystem (Events, Engines, Store, Transfer, Load, NATS, Actors: sets.go),
// each built and registered by its own constructor on a registerer passed
// in (never the global one). Metrics embeds every set: the node builds it
// once and hands it, or one set, to the actors, ingest and the transfer
// workers. Names follow kvactors_<subsystem>_<what>_<unit>; the transfer
// counters keep vLLM's kv_offload_total_bytes / kv_offload_total_time names
// with a transfer_type label so existing dashboards work.
//
// client_golang rather than the OTel Prometheus exporter: the hot path pays
// one atomic add per counter, tests read values with testutil, and nothing
// touches OTel's global meter provider.
package metrics
