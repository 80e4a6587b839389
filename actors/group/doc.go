// Package group is where the design card puts a KV group's actor. kvactors
// has no actor per group, deliberately; this package holds only this note so
// that a reader looking for the group actor finds why.
//
// A group's store state (its GPU block ids, store cursor, chunks to redo, the
// ready prefix it computes and the deferral it last reported) is the plain
// value sched.group, one per group inside the request's sched.Request, and the
// request actor (actors/request) is its only caller.
//
// The protocol makes one store decision per request across all its groups,
// all-or-nothing against the host pool (PROTOCOL.md: "All candidates of one
// request go to the host pool in one prepare_store"). With an actor per group,
// every batch would need a gather round trip (request → each group →
// request → pool → each group) before that decision: 2G more messages per
// request per batch on the hot path, and a decision split across mailboxes
// that must be held back while new events arrive. Keeping the group values
// inside the request's core keeps the decision atomic and the event path at
// one actor hop; the group rules are tested in isolation in sched. See
// docs/ARCHITECTURE.md, "Group state lives in sched".
package group
