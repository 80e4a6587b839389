// Package transfer is the transfer actor: one per node, it queues store and
// load jobs, runs their copies on a bounded pool of worker goroutines (never
// on its own mailbox goroutine, so a slow copy does not stall anything), and
// reports JobDone to the job's owner. A copy is one call to the job's Store
// (package store owns the pool, the arena and the copy plan). In-flight bytes
// are bounded; the queue itself is bounded by the host pool, since every
// queued store holds pending room.
package transfer
