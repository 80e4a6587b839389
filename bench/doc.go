// Package bench measures a kvactors node against the limits that decide how
// many engines one node can serve (issue 5, "kvactors bench"): event
// throughput against a raw NATS+decode baseline, publish-to-copy latency at
// fractions of the saturation rate, copy bandwidth through the shm backend
// against a plain copy(), and memory and throughput with 100,000 live
// requests.
//
// Run starts a node in-process (embedded NATS on a free port unless
// Config.NATSURL names a server, admin HTTP off, its own Prometheus
// registry, shm segments under /dev/shm when writable) for each phase and
// drives it with lightweight generated engines, not the full simulator
// (package sim): every batch is encoded before its phase starts, so the
// numbers measure the node, the NATS server and the client library, not the
// generator.
//
// Progress is read from the node's own metrics
// (kvactors_events_batches_total for flow control,
// kvactors_events_applied_total to know when the node has caught up), so
// the bench drives the real service and changes nothing in it.
//
// Files: config.go (settings), gen.go and wire.go (the workload), metrics.go
// (reading the node's metrics), rig.go (node, engines, flow-controlled
// publishing), one file per phase (throughput.go, latency.go, copy.go,
// scale.go), report.go (the table and JSON) and run.go. Out of process
// (issue 14): child.go (the `kvactors serve` child, its CPU and memory),
// external.go (the store-heavy and nothing-stored runs and the raw
// baseline), external_latency.go (paced levels), external_burst.go (a
// burst through SDK engines) and external_report.go.
package bench
