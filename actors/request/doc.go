// Package request is the request actor: one per live request, a child of its
// engine actor (a released one is kept for the engine's next request:
// Spawner). It owns one sched.Request (the store state of every KV group
// of the request), steps it with the request's events, takes a store decision
// against the node's host pool after each batch, and performs the effects:
// store jobs to the transfer actor, stored / released messages (kv_events
// are the pool journal's: node/kvjournal.go),
// retry timers, span events and counters.
//
// Supervision: the parent stops a failed request actor rather than restart it
// (a fresh instance would have lost the request's state); the engine then
// has the transfer actor drain its copies (queued ones cancelled, running
// ones finished), releases the request, logs and counts the failure.
//
// Group state lives in sched as a plain value per group inside the request,
// not in an actor per group: one store job per request per decision needs
// every group's candidates at once, which a group actor could only supply by
// a gather round trip on every event. See docs/ARCHITECTURE.md.
package request
