// Package messages holds the data that crosses a boundary in kvactors: the
// protocol v1 wire bodies (EngineSpec, EventBatch, the replies and
// notifications kvactors publishes) and the checked, typed events that ingest
// hands to the actors. It has no logic beyond trivial accessors, so every
// other package can import it.
package messages
