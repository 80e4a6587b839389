// Package transfer is the transfer actor: one per device, it queues store and
// load jobs, runs their copies on a bounded pool of worker goroutines (never
// on its own mailbox goroutine, so a slow copy does not stall anything), and
// reports JobDone to the job's owner. In-flight bytes are bounded; the queue
// itself is bounded by the host pool, since every queued store holds pending
// slots.
package transfer
