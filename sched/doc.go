// Package sched is kvactors' store scheduler: the deterministic core that
// decides, per request and per KV-cache group, which offload chunks are safe to
// store (PROTOCOL.md, "What kvactors does"). It mirrors vLLM's
// OffloadingConnector store path after its "defer stores until metadata is
// ready" fix: the store cursor is bounded by the common ready prefix of
// tokens, hashes and complete block chunks; lagging chunks are deferred and
// retried, never skipped.
//
// Like etcd's raft package it does no I/O and reads no clock. Events come in
// through Request.Step, a decision is taken by Request.Advance against a
// hostpool, and the work the caller owes (a store job to run, deferrals to
// trace, a retry to schedule, copies to cancel, a release to publish) comes
// back as Effects. Copy completions come back in through Request.JobDone. The
// actors in actors/request own one Request each and are its only caller.
//
// sched keeps only the decision: where a chunk lives in the pool and how it
// is copied (ranges, merging, copy bytes, checksums) belong to package store.
// sched imports only the standard library, messages and hostpool (for the
// Preparer's answer); an import test keeps it that way.
package sched
