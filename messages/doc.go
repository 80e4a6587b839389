// Package messages holds the data and the words that cross a boundary in
// kvactors, each defined once: the protocol v2 bodies (body.go: EngineSpec,
// EventBatch, the replies and notifications kvactors publishes; session.go:
// hello, heartbeats, unregister, resync), the verbs and the subject builders
// (session.go; ingest.ParseSubject is the one parser), the release and resync
// reasons, the reject labels (reject.go), and the checked, typed events that
// ingest hands to the actors. It has no logic beyond small pure helpers, so
// every other package can import it.
package messages
