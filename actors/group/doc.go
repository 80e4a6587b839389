// Package group is where the design card puts a KV group's actor. kvactors
// has no actor per group, deliberately; this package holds only this note so
// that a reader looking for the group actor finds why.
//
// A group's store state (its GPU block ids, store cursor, chunks to redo and
// the deferral it last reported) is the plain value sched.group, one per group
// inside the request's sched.Request; the group computes its own ready prefix
// and candidate chunks, and the request combines them into one decision. The
// request actor (actors/request) is the only caller.
//
// The protocol makes one store decision per request across all its groups
// (docs/PROTOCOL.md: "All candidates of the request go to the pool in one
// decision", and the pool's answer "is all-or-nothing"). With an actor per group,
// every batch would need a gather round trip (request → each group →
// request → pool → each group) before that decision: 2G more messages per
// request per batch on the hot path, and a decision split across mailboxes
// that must be held back while new events arrive. Keeping the group values
// inside the request's core keeps the decision atomic and the event path at
// one actor hop; the group rules are tested in isolation in sched
// (group_test.go). See docs/ARCHITECTURE.md, "The pure core".
package group
